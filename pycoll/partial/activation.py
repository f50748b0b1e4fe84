"""Activation messages of the partial all-reduce: p2p over the private group, any source.

An activation is ``int64[2] = [round, sender]`` on one fixed tag. Each rank keeps exactly
one any-source receive posted and re-posts it after each message: torch.distributed cannot
cancel a posted receive, so a per-round tag would leave a dangling receive behind every
round a rank started alone. The round number in the payload identifies duplicates (several
solo initiators) and stale activations, which the caller drops.

An activation only matters to a rank that is not already in the round (its training thread
is computing); when every rank arrives within the initiator's grace period (balanced
steps), ``pycoll.partial`` sends none at all. But the posted receive is bounded by the
group's timeout (gloo and pycoll both apply it), so a thread sends a *keepalive* (round
``KEEPALIVE``) to the next rank in the ring every quarter of it: every rank's receive
completes, and is posted afresh, well before it could time out.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist

from pycoll import callbacks

TAG = 0x5041  # "PA"; the group is private, so it cannot collide with user tags
KEEPALIVE = -1  # the round number of a keepalive: older than any round, so always dropped


class Activations:
    def __init__(self, group, rank: int, peers: list[int], lock: threading.Lock,
                 on_arrival: Callable[[], None], successor: int, keepalive_s: float,
                 runner: callbacks.Runner) -> None:
        self.runner = runner
        self.group, self.rank, self.peers = group, rank, peers
        self.successor, self.keepalive_s = successor, keepalive_s
        self._send_lock = threading.Lock()   # sends come from the progress, user and keepalive threads
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._waiter: threading.Thread | None = None   # gloo: the thread in the receive's wait()
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
            self._waiter = callbacks.start_thread(lambda: self._wait(work), self._died, "pycoll-partial-recv",
                                                  self.runner)
            return
        fut.add_done_callback(self._arrived)

    def _wait(self, work) -> None:
        try:
            work.wait()
            self._waited = (work, None)
        except Exception as exc:  # noqa: BLE001 - take() re-raises it on the progress thread
            self._waited = (work, exc)
        self._arrived(None)

    def _died(self, exc: BaseException) -> None:
        """A thread of ours failed unexpectedly: the waiting side sees it on take()."""
        self._waited = (self._inbox[0] if self._inbox else None, exc)
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
        self._send(k, self.peers)
        self.sent += len(self.peers)

    def _send(self, k: int, dsts: list[int]) -> None:
        with self._send_lock:
            still = []
            for work, payload in self._sends:
                if work.is_completed():
                    work.wait()  # re-raises a failed send
                else:
                    still.append((work, payload))  # keep the payload alive until it is sent
            payload = torch.tensor([k, self.rank], dtype=torch.int64)
            for dst in dsts:
                still.append((dist.isend(payload, dst=dst, group=self.group, tag=TAG), payload))
            self._sends = still

    def start_keepalive(self) -> None:
        self._keeper = callbacks.start_thread(self._keep, self._died, "pycoll-partial-keepalive",
                                              self.runner)

    def _keep(self) -> None:
        while not self._stop.wait(self.keepalive_s):
            try:
                self._send(KEEPALIVE, [self.successor])
            except Exception:  # noqa: BLE001 - the group broke: its own calls report it
                return

    def close(self) -> None:
        """Collective, once nothing posts receives any more: a last keepalive to the next
        rank completes its posted receive, so no thread stays in a gloo receive's wait()."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(5)
        try:
            self._send(KEEPALIVE, [self.successor])
        except Exception:  # noqa: BLE001 - a broken group: its receive failed already
            pass
        if self._waiter is not None:
            self._waiter.join(5)
