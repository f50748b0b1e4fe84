"""How a group is wired at init: the path it takes, its TCP mesh, its host's shared memory.

Every rank publishes its host identity (hostname + boot id, or ``PYCOLL_HOST_ID``); from
the list and ``PYCOLL_TRANSPORT`` every rank derives the same mode (``choose_mode``):
``tcp`` (sockets only), ``shm`` (one host: the arena carries collectives) or
``hierarchical`` (several hosts with several ranks each: an arena per host, and the host
leaders' TCP sub-transport between them). The TCP mesh is built in every mode: point-to-point
traffic always takes its own sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from pycoll import rendezvous, settings
from pycoll.core.executor import Executor
from pycoll.transport import spin
from pycoll.transport.base import Transport
from pycoll.shm.arena import ShmArena
from pycoll.shm.links import Links
from pycoll.transport.tcp.mesh import build_mesh
from pycoll.transport.tcp.transport import TcpTransport

MODES = ("auto", "tcp", "shm", "hierarchical")


def choose_mode(requested: str, hosts: list[str]) -> str:
    """PYCOLL_TRANSPORT -> the path this group takes, given each rank's host identity."""
    requested = requested.lower()
    if requested not in MODES:
        raise ValueError(f"PYCOLL_TRANSPORT={requested!r}: choose one of {', '.join(MODES)}")
    n_hosts = len(set(hosts))
    if requested == "shm" and n_hosts > 1:
        raise ValueError(f"PYCOLL_TRANSPORT=shm needs all ranks on one host; they span {n_hosts} hosts")
    if requested != "auto":
        return requested
    if len(hosts) == 1:
        return "tcp"
    if n_hosts == 1:
        return "shm"
    return "hierarchical" if n_hosts < len(hosts) else "tcp"


def crowded_cores(mode: str, local_ranks: int) -> int | None:
    """This host's cores when every rank runs the TCP rounds and they outnumber the cores
    (forced TCP on one host), for the tuner to price crowded rounds; else None. On the
    hierarchical path only one rank per host runs the TCP schedule."""
    cores = spin.cores()
    return cores if mode == "tcp" and local_ranks > cores else None


def tcp_spin() -> float:
    """The longest a TCP step polls before it blocks: ``PYCOLL_TCP_SPIN_US`` (1000). Whether
    and how long a step does poll is decided per step (``transport.spin``)."""
    return max(0.0, settings.get("PYCOLL_TCP_SPIN_US") / 1e6)


@dataclass
class Wiring:
    """What ``wire`` built for one rank of one group."""

    mode: str
    hosts: list[str]
    tcp: TcpTransport                 # the collective sockets, as built
    transport: Transport              # the same, as the observers see it (perhaps wrapped)
    executor: Executor
    p2p_socks: dict
    arena: ShmArena | None = None
    local_ranks: list[int] = field(default_factory=list)   # group ranks on this host
    crowded_cores: int | None = None  # cores here, when this host's TCP ranks outnumber them
    host_of: list[int] = field(default_factory=list)       # host index of every group rank
    leaders: list[int] = field(default_factory=list)       # lowest group rank of every host
    leader_executor: Executor | None = None                 # hierarchical: this leader's TCP


def wire(store, rank: int, world: int, timeout: float, observe_transport=None) -> Wiring:
    """Build this rank's paths; ``observe_transport(t) -> t`` sees each TCP transport."""
    wrap = observe_transport or (lambda t: t)
    global_rank = dist.get_rank() if dist.is_initialized() else rank
    hosts = rendezvous.exchange_all(store, "pycoll/host", rank, world, rendezvous.host_identity(global_rank))
    mode = choose_mode(settings.get("PYCOLL_TRANSPORT"), hosts)
    coll_socks, p2p_socks = build_mesh(store, rank, world, timeout, channels=2)
    tcp = TcpTransport(rank, world, coll_socks)
    local = [r for r in range(world) if hosts[r] == hosts[rank]]
    tcp.spin = tcp_spin()
    transport = wrap(tcp)
    segment = settings.get("PYCOLL_SEGMENT_BYTES")
    w = Wiring(mode, hosts, tcp, transport, Executor(transport, segment), p2p_socks)
    w.crowded_cores = crowded_cores(mode, len(local))
    if mode == "tcp":
        return w
    order = list(dict.fromkeys(hosts))           # hosts in order of their lowest rank
    try:
        w.arena = ShmArena(store, f"pycoll/shm/{order.index(hosts[rank])}", local.index(rank), len(local),
                           local, timeout)
    except BaseException:
        tcp.close()
        for s in p2p_socks.values():
            s.close()
        raise
    w.local_ranks = local
    w.host_of = [order.index(h) for h in hosts]
    w.leaders = [next(r for r in range(world) if hosts[r] == h) for h in order]
    if mode == "hierarchical" and rank in w.leaders:
        w.leader_executor = Executor(wrap(tcp.subset(w.leaders)), segment)
    return w


def p2p_links(store, w: Wiring, rank: int, timeout: float):
    """What makes this rank's shared-memory point-to-point links (given its engine's wake
    pipe), or None: point-to-point with the ranks of this host goes through shared memory
    wherever the group has an arena, unless ``PYCOLL_P2P_TRANSPORT=tcp``."""
    choice = settings.get("PYCOLL_P2P_TRANSPORT").lower()
    if choice not in ("auto", "tcp"):
        raise ValueError(f"PYCOLL_P2P_TRANSPORT={choice!r}: choose auto or tcp")
    if choice == "tcp" or w.arena is None or len(w.local_ranks) < 2:
        return None
    key = f"pycoll/p2p/{w.host_of[rank]}"
    return lambda wake_fd: Links(store, key, w.local_ranks, rank, wake_fd, timeout)
