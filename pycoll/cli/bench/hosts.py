"""The bench over emulated hosts: ``--hosts HxR --link RATE``.

The launcher builds ``H`` hosts (``pycoll.testing.netns.EmulatedHosts``: a namespace each,
links shaped both ways with tc's tbf to ``RATE``) and places ``R`` consecutive ranks on each.
A rank joins the launcher's Store first, over the launcher's loopback, then enters its host
(``enter_rank``): every socket it opens from then on, pycoll's and gloo's, runs over the
emulated links; ``PYCOLL_HOST_ID`` tells pycoll which ranks share a host (shared memory
between them, TCP across), ``GLOO_SOCKET_IFNAME`` points gloo at the host's link.

``bound_fraction`` is the least traffic a host's link must carry, in units of the row's size
S, so that the least time the links allow is ``fraction * S / rate``: for all_reduce a host
sends and receives 2(H-1)/H * S (a ring over the hosts, or any schedule that reduces inside a
host first), for all_gather and reduce_scatter (H-1)/H * S (nccl-tests' S: the total
gathered / scattered), for broadcast and reduce S.
"""

from __future__ import annotations

import os
import re


def parse_hosts(text: str) -> tuple[int, int]:
    """'4x1' -> (4 hosts, 1 rank each)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"not a host layout: {text!r} (HOSTSxRANKS_PER_HOST, e.g. 4x1, 2x2)")
    return int(m.group(1)), int(m.group(2))


def placement(names: list[str], addrs: list[str], per_host: int) -> dict:
    """The cfg entry the ranks read: per rank, its namespace and the environment it sets."""
    netns, env = [], []
    for h, (name, addr) in enumerate(zip(names, addrs)):
        for _ in range(per_host):
            netns.append(name)
            env.append({"PYCOLL_SOCKET_ADDR": addr, "PYCOLL_HOST_ID": f"emulated-host-{h}",
                        "GLOO_SOCKET_IFNAME": "eth0"})
    return {"netns": netns, "env": env}


def enter_rank(hosts_cfg: dict, rank: int) -> None:
    """In rank ``rank``, after its Store connection is up: move onto its emulated host."""
    from pycoll.testing.netns import enter

    enter(hosts_cfg["netns"][rank])
    os.environ.update(hosts_cfg["env"][rank])


def bound_fraction(collective: str, hosts: int, per_host: int) -> float | None:
    """Bytes a host's link carries each way per byte of the row's size; None: no bound given."""
    if hosts < 2:
        return None
    across = (hosts - 1) / hosts
    return {
        "all_reduce": 2 * across,
        "all_gather": across,
        "reduce_scatter": across,
        "gather": across,
        "scatter": across,
        "all_to_all": per_host * across,      # S is what each rank sends, all of it
        "broadcast": 1.0,
        "reduce": 1.0,
        "sendrecv": 1.0 if per_host == 1 else None,   # ranks 0 and 1 on one host: no link
    }.get(collective)


def bound_us(collective: str, nbytes: int, hosts: int, per_host: int, bytes_per_s: float) -> float | None:
    """The least time, in microseconds, the links allow for one op of ``nbytes``."""
    f = bound_fraction(collective, hosts, per_host)
    if f is None or not bytes_per_s:
        return None
    return f * nbytes / bytes_per_s * 1e6
