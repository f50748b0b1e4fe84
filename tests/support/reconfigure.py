"""How the reconfigure tests' processes meet, as torch's users do: a group over the test's
Store, each process's handle published under a step's keys, a sum that names the members,
the outcome of a reconfigure that may be refused, and a Store handshake.
Used by tests/ranks/test_reconfigure.py and tests/ranks/test_reconfigure_faults.py.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll.testing.ranks import rank_store


def init(rank, world, timeout: float = 30, **kw):
    """A pycoll default group over the run's Store (under "job/"); that Store."""
    store = dist.PrefixStore("job", rank_store())
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=timeout), **kw)
    return store


def meet(store, step: str, rank: int, members, group=None) -> list[str]:
    """Publish this process's handle under ``step``; the handles of ``members`` in order."""
    store.set(f"{step}/{rank}", dist._get_reconfigure_handle(group))
    return [store.get(f"{step}/{r}").decode() for r in members]


def total(group=None) -> float:
    """The sum of (rank + 1) over the group: 3.0 for two members, 6.0 for three."""
    t = torch.full((5,), float(dist.get_rank(group) + 1))
    dist.all_reduce(t, group=group)
    return t[0].item()


def outcome(uuid: int, handles, **kw) -> tuple[str, float]:
    """(the error of ``dist._reconfigure(uuid, handles)``, or "no error"; seconds it took)."""
    t0 = time.monotonic()
    try:
        dist._reconfigure(uuid, handles, **kw)
        out = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out = str(exc)
    return out, time.monotonic() - t0


def all_reach(store, key: str, world: int, timeout: float = 60) -> None:
    """Every one of ``world`` processes has reached ``key`` (a Store handshake), within
    ``timeout`` seconds."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while (arrived := store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of {world} processes reached {key!r} in {timeout:g} s")
        time.sleep(0.005)
