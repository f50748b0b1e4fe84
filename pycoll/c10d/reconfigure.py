"""torch's reconfigure API (torch >= 2.14) on a pycoll group: the same group object takes new
members in place: shrink, grow, a new process joining, split halves merging back.

``dist._get_reconfigure_handle(group)`` gives this process's handle; the members exchange
handles out of band (the Store, a file, a controller) and every one of them calls
``dist._reconfigure(uuid, handles, group)`` with the same fresh ``uuid`` and the same
handles. A list numbers the new ranks by position. A set is ordered as pycoll chooses:
processes already in a configuration first, by the rank they had in their first one (so a
split group merging back gets its old order and a shrink keeps its survivors' order), then
joiners by the rank they gave ``init_process_group``, ties by handle.

Everything a rank can check alone is checked before any I/O (handles parse, are unique,
include this process, come from the same torch and pycoll; a uuid this process has used).
What needs the others is checked through the Store under the uuid's own keys: the first
rank to arrive records the members, a rank with a different list (or a uuid used before,
by other processes) records why it fails there, and every rank's set-up asks that key at
each wait, so all fail at once with the same words. The new members then build a fresh
communicator under ``pycoll/reconfigure/<uuid>/``: nothing of the old one is shared, and
the old one (whose queued ops are failed first: a reconfigure is not a collective of the
old membership) is closed once the new one works.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pycoll import observe, rendezvous, torch_compat
from pycoll.c10d import dispatch
from pycoll.core.communicator import Communicator
from pycoll.core.work import completed
from pycoll.cuda.paths import backend_devices
from pycoll.errors import PycollError

PREFIX = "pycoll1"   # the handle format's name and version


class ReconfigureError(PycollError):
    """A reconfigure failed on this rank or another (the message says which and why)."""


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("pycoll")
    except PackageNotFoundError:
        mine = "src"
    return f"{mine}+torch{torch.__version__}".replace(":", "_")


_PROCESS: dict[int, str] = {}


def _process() -> str:
    """This process's name in handles (by pid: a forked child is another process)."""
    pid = os.getpid()
    if pid not in _PROCESS:
        _PROCESS[pid] = f"{socket.gethostname()}.{pid}.{secrets.token_hex(4)}".replace(":", "_")
    return _PROCESS[pid]


@dataclass(frozen=True)
class Handle:
    """What one process tells the others: who it is and where it stands."""

    process: str      # host, pid and a nonce: unique per process, never reused
    versions: str     # pycoll and torch: a joiner of another build is refused
    uuid: int         # the reconfigure it is in (-1: the group as made, or none yet)
    rank: int         # its rank there (a joiner: the rank it gave init_process_group)
    first: int        # its rank in its first configuration (-1: a joiner, in none yet)

    def encode(self) -> str:
        return f"{PREFIX}:{self.process}:{self.versions}:{self.uuid}:{self.rank}:{self.first}"

    @classmethod
    def parse(cls, text) -> "Handle":
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 6 or parts[0] != PREFIX:
            raise ValueError(f"pycoll reconfigure: {text!r} is not a pycoll handle "
                             f"(dist._get_reconfigure_handle of a pycoll group)")
        try:
            return cls(parts[1], parts[2], int(parts[3]), int(parts[4]), int(parts[5]))
        except ValueError:
            raise ValueError(f"pycoll reconfigure: garbled handle {text!r}") from None


def handle_of(pg) -> str:
    return Handle(_process(), versions(), pg._uuid, pg._rank, pg._first_rank).encode()


def plan(uuid: int, handles, mine: str, used: set[int]) -> list[str]:
    """The new members in rank order, after every check this rank can make alone."""
    if isinstance(uuid, bool) or not isinstance(uuid, int):
        raise TypeError(f"pycoll reconfigure: uuid must be an int, got {uuid!r}")
    if uuid in used:
        raise ValueError(f"pycoll reconfigure: uuid {uuid} was already used by this group; "
                         f"each reconfigure needs a fresh uuid")
    ordered = list(handles)
    if not ordered:
        raise ValueError("pycoll reconfigure: no handles")
    if len(set(ordered)) != len(ordered):
        raise ValueError("pycoll reconfigure: the handles are not unique")
    parsed = {h: Handle.parse(h) for h in ordered}
    if len({p.process for p in parsed.values()}) != len(ordered):
        raise ValueError("pycoll reconfigure: two handles name the same process")
    if mine not in parsed:
        raise ValueError(f"pycoll reconfigure: this process's handle {mine!r} is not among the "
                         f"handles (get it again with dist._get_reconfigure_handle: it changes "
                         f"with every configuration)")
    own = parsed[mine].versions
    other = [h for h, p in parsed.items() if p.versions != own]
    if other:
        raise ValueError(f"pycoll reconfigure: {other[0]!r} comes from another build "
                         f"({parsed[other[0]].versions}; this process: {own})")
    if not isinstance(handles, (list, tuple)):
        ordered.sort(key=lambda h: (parsed[h].first < 0, parsed[h].first if parsed[h].first >= 0
                                    else parsed[h].rank, h))
    return ordered


def run(pg, opts):
    """``pg.reconfigure(opts)``: every new member calls it; synchronous, as gloo's."""
    torch_compat.require_reconfigure()
    uuid, handles = opts.uuid, opts.handles
    timeout = opts.timeout.total_seconds() if opts.timeout is not None else pg._timeout.total_seconds()
    meet = dist.PrefixStore("pycoll/reconfigure/", pg._base_store)
    mine = handle_of(pg)
    try:
        members = plan(uuid, handles, mine, pg._uuids)
    except (TypeError, ValueError) as exc:
        # Refused before any communication; the others are told, so that they fail at once
        # instead of waiting for this rank until their timeout.
        meet.set(f"{uuid}/failed", f"a rank refused the handles: {exc}")
        raise
    rank, size = members.index(mine), len(members)
    pg._uuids.add(uuid)                 # tried once, never again (failed or not)
    old = pg._comm
    # Queued and running ops of the old configuration fail now: the others are here, not
    # in them. Its point-to-point connections stay up and tell the watch who dies meanwhile.
    old.fail(PycollError(f"the group is being reconfigured (uuid {uuid})"))
    try:
        agree(meet, uuid, members)
        meet.set(f"{uuid}/arrived/{rank}", "1")
        store = dist.PrefixStore(f"{uuid}/", meet)
        with rendezvous.watched(_watch(meet, uuid, pg, members, timeout)):
            comm = Communicator(store, rank, size, timeout, observers=observe.for_group(rank))
    except Exception as exc:
        meet.set(f"{uuid}/failed", f"rank {rank} of the new configuration: {type(exc).__name__}: {exc}")
        if isinstance(exc, ReconfigureError):
            raise
        raise ReconfigureError(f"pycoll reconfigure: uuid {uuid}, as rank {rank} of {size}: {exc}") from exc
    meet.set(f"{uuid}/done", "1")
    if pg._cuda is not None:
        pg._cuda.close(True)
        pg._cuda = None
    pg._comm, pg._store, pg._uuid = comm, store, uuid
    pg._rank, pg._size = rank, size
    dispatch.attach(pg, backend_devices(torch.version.cuda is not None))   # c10d's copies of rank and size
    if pg._first_rank < 0:
        pg._first_rank = rank
    # With its goodbyes (the others' watches see no death); what is pending fails saying why.
    old.shutdown(why=f"the group was reconfigured (uuid {uuid}) with this request pending")
    torch_compat.renumbered(pg, size)
    return completed("reconfigure", [])


def agree(store, uuid: int, members: list[str]) -> None:
    """Record or compare the members under the uuid's keys; raise when this rank's list
    differs or the uuid was used before by other processes (``run`` tells the others)."""
    digest = hashlib.sha256("\n".join(members).encode()).hexdigest()
    if store.check([f"{uuid}/done"]):
        problem = f"uuid {uuid} was already used; each reconfigure needs a fresh uuid"
    else:
        first = store.compare_set(f"{uuid}/members", "", digest)
        first = first.decode() if isinstance(first, bytes) else first
        problem = None if first == digest else \
            f"the ranks passed different handles for uuid {uuid} (or it was used before)"
    if problem:
        raise ReconfigureError(f"pycoll reconfigure: {problem}")


def _watch(store, uuid: int, pg, members: list[str], timeout: float):
    """The check every wait of the build asks: another rank failed, a member that was in
    this group's old configuration has died (its connection says so), or the reconfigure's
    own timeout has passed (the Store's may be longer)."""
    old = pg._comm
    deadline = time.monotonic() + timeout
    parsed = [Handle.parse(h) for h in members]
    olds = {p.rank: new for new, p in enumerate(parsed)
            if pg._first_rank >= 0 and p.first >= 0 and p.uuid == pg._uuid}

    def check() -> None:
        if time.monotonic() > deadline:
            missing = [new for new in range(len(members)) if not store.check([f"{uuid}/arrived/{new}"])]
            raise ReconfigureError(f"pycoll reconfigure: uuid {uuid}: timed out after {timeout:g} s; "
                                   f"new ranks that never arrived: {missing or 'none (all arrived)'} "
                                   f"(their handles: {[members[r] for r in missing]})")
        if store.check([f"{uuid}/failed"]):
            raise ReconfigureError(f"pycoll reconfigure: {store.get(f'{uuid}/failed').decode()}")
        dead = old.p2p.dead_peers() if olds else {}
        for was, new in olds.items():
            if was in dead:
                raise ReconfigureError(f"pycoll reconfigure: the member at new rank {new} (rank {was} of "
                                       f"the old configuration) has died: its connection {dead[was]}")
    return check


class Unconfigured:
    """The communicator of a group made with ``enable_reconfigure=True`` until its first
    reconfigure: every use is a clear error."""

    error = None

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, size, timeout

    def __getattr__(self, name):
        raise PycollError("pycoll: this group was made with enable_reconfigure=True and has no "
                          "members until its first dist._reconfigure(uuid, handles, group)")

    def fail(self, exc) -> None:
        pass

    def shutdown(self, abort: bool = False, reason: str = "", why: str = "") -> None:
        pass
