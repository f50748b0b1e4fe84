"""Shrinking a pycoll group: the survivors of a failure go on in a smaller group, in-process.

torch's ``dist.shrink_group(ranks_to_exclude, group, flags)`` asks the group's backend for
``shrink(excluded, flags, options)`` and registers what it returns as the new group (the
new default group when the default one is shrunk), then destroys the old one. A pycoll
group is its own backend (``lookups``), so ``shrink`` returns a whole new
``ProcessGroupPycoll`` of the remaining ranks, numbered 0..n-1 in their old order.

The new group meets through the old group's Store under a key of its own (the old group's
prefix, how many shrinks this group has seen, the excluded ranks), so no message goes to
or through an excluded rank and no new Store is needed; it builds fresh connections and
shared memory, so nothing of the old group is shared with it (the old group, failed or
not, is destroyed by torch afterwards, or by ``pycoll.shrink``). While it is built, the
old group's point-to-point connections, which stay up after a collective failed, tell
whether a remaining rank dies meanwhile: every wait of the set-up asks (``rendezvous.watched``)
and the shrink fails at once naming it, instead of at the init deadline; it can be retried
without that rank. The Store itself must
outlive the failure: under torchrun its agent hosts it; with ``env://`` rank 0's process
hosts it (docs/faults.md, "Surviving a failure").
"""

from __future__ import annotations

import torch.distributed as dist

from pycoll import rendezvous
from pycoll.c10d.lookups import Options
from pycoll.errors import PeerClosedError, PycollError

SHRINK_ABORT = 0x01   # torch's flag: fail the old group's outstanding ops before shrinking


def remaining_ranks(size: int, excluded) -> list[int]:
    """The ranks of a group of ``size`` that stay, after checking ``excluded``."""
    excluded = sorted({int(r) for r in excluded})
    bad = [r for r in excluded if not 0 <= r < size]
    if bad:
        raise ValueError(f"shrink: ranks {bad} are not ranks of a group of size {size}")
    if not excluded:
        raise ValueError("shrink: no rank to exclude")
    stay = [r for r in range(size) if r not in excluded]
    if not stay:
        raise ValueError("shrink: every rank is excluded")
    return stay


def shrink(pg, excluded, flags: int = 0, opts=None):
    """A new group of ``pg``'s ranks but ``excluded`` (called by every remaining rank)."""
    stay = remaining_ranks(pg.size(), excluded)
    if pg.rank() not in stay:
        raise RuntimeError(f"shrink: rank {pg.rank()} is excluded, so it must not call shrink")
    pg._shrinks += 1
    if flags & SHRINK_ABORT:
        # Fail what is queued and running, but keep the point-to-point connections: they
        # tell the shrink's watch which of the remaining ranks are still alive.
        pg.communicator.fail(PycollError("aborted by shrink_group"))
    timeout = opts._timeout if isinstance(opts, Options) else pg._timeout
    gone = "-".join(str(r) for r in range(pg.size()) if r not in stay)
    store = dist.PrefixStore(f"pycoll/shrink/{pg._shrinks}/{gone}/", pg._store)
    try:
        with rendezvous.watched(lambda: _check_alive(pg, stay)):
            return type(pg)(store, stay.index(pg.rank()), len(stay), timeout)
    except Exception as exc:
        mapping = ", ".join(f"{new}={old}" for new, old in enumerate(stay))
        raise PycollError(f"shrink: building the group of ranks {stay} failed (its ranks are the old "
                          f"ones renumbered, new=old: {mapping}): {exc}") from exc


def _check_alive(pg, stay: list[int]) -> None:
    """The watch of a shrink: a remaining rank whose old connection ended has died during it."""
    dead = pg.communicator.p2p.dead_peers()
    for new, old in enumerate(stay):
        if old in dead:
            raise PeerClosedError(f"shrink: rank {old} (new rank {new}) died during the shrink: its "
                                  f"connection to rank {pg.rank()} {dead[old]}", op="shrink",
                                  rank=pg.rank(), peer=old)
