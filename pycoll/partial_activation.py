"""Activation messages of the partial all-reduce: p2p over the private group, any source.

An activation is ``int64[2] = [round, sender]`` on one fixed tag. Each rank keeps exactly
one any-source receive posted and re-posts it after each message: torch.distributed cannot
cancel a posted receive, so a per-round tag would leave a dangling receive behind every
round a rank started alone. The round number in the payload identifies duplicates (several
solo initiators) and stale activations, which the caller drops.

An activation only matters to a rank that is not already in the round (its training thread
is computing); when every rank arrives within the initiator's grace period (balanced
steps), ``pycoll.partial`` sends none at all.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist

TAG = 0x5041  # "PA"; the group is private, so it cannot collide with user tags


class Activations:
    def __init__(self, group, rank: int, peers: list[int], lock: threading.Lock,
                 on_arrival: Callable[[], None]) -> None:
        self.group, self.rank, self.peers = group, rank, peers
        self.lock, self.on_arrival = lock, on_arrival
        self.ready = False        # a message is waiting (read and written under ``lock``)
        self.sent = 0             # activation messages sent (observability, tests)
        self._inbox: tuple | None = None
        self._sends: list[tuple] = []
        self._waited: tuple = (None, None)   # (work, error) of a receive a thread waited for

    def post(self) -> None:
        buf = torch.empty(2, dtype=torch.int64)
        work = dist.irecv(buf, src=None, group=self.group, tag=TAG)
        self._inbox = (work, buf)
        try:
            fut = work.get_future()
        except RuntimeError:  # gloo's receives have no future: a thread waits instead
            threading.Thread(target=self._wait, args=(work,), name="pycoll-partial-recv",
                             daemon=True).start()
            return
        fut.add_done_callback(self._arrived)

    def _wait(self, work) -> None:
        try:
            work.wait()
            self._waited = (work, None)
        except Exception as exc:  # noqa: BLE001 - take() re-raises it on the progress thread
            self._waited = (work, exc)
        self._arrived(None)

    def _arrived(self, _fut) -> None:
        # Runs on the backend's thread: only flag and notify, never call into the backend.
        with self.lock:
            self.ready = True
            self.on_arrival()

    def take(self) -> int:
        """The round of the message that arrived (call with ``ready`` seen and cleared,
        outside the lock: it posts the next receive)."""
        work, buf = self._inbox
        waited, exc = self._waited
        if waited is not work:
            work.wait()  # already complete: re-raises a failed receive
        elif exc is not None:
            raise exc    # (a second wait on a gloo receive would block: not again)
        k, _sender = buf.tolist()
        self.post()
        return k

    def send(self, k: int) -> None:
        """Activate round k on every peer (fire and forget; a failed send raises later)."""
        still = []
        for work, payload in self._sends:
            if work.is_completed():
                work.wait()  # re-raises a failed send
            else:
                still.append((work, payload))  # keep the payload alive until it is sent
        payload = torch.tensor([k, self.rank], dtype=torch.int64)
        for peer in self.peers:
            still.append((dist.isend(payload, dst=peer, group=self.group, tag=TAG), payload))
        self._sends = still
        self.sent += len(self.peers)
