"""pycoll: a collective-communication backend for torch.distributed, written in Python.

``import pycoll`` registers the backend ``"pycoll"``::

    import torch.distributed as dist
    import pycoll
    dist.init_process_group(backend="pycoll")
"""

from __future__ import annotations


def _autoload() -> None:
    """torch's ``torch.backends`` entry point (pyproject.toml): ``import torch`` calls it in
    every process unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so every process knows the
    backend by name, also those that never import pycoll (Ray Train's workers, spawned
    children). Loading it imported this package, which registers the backend below; it is
    defined before ``import torch`` because a process that imports pycoll first reaches it
    from inside that import, while this module is still half made."""


import importlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pycoll import torch_compat  # noqa: E402
from pycoll.cuda.paths import backend_devices  # noqa: E402
from pycoll.errors import (  # noqa: E402
    AuthenticationError,
    CommError,
    CommTimeoutError,
    MismatchError,
    PeerClosedError,
    ProtocolError,
    PycollError,
)

__version__ = "0.1.0"
BACKEND_NAME = "pycoll"

# The public names that need the rest of pycoll, imported on first use (PEP 562), so that
# ``import pycoll``, which torch runs in every process through the entry point, stays cheap:
# no threads, sockets or Store at import, and none of the data path until a group is made.
_LAZY = {
    "ProcessGroupPycoll": "pycoll.c10d.backend",
    "Work": "pycoll.core.work",
    "can_share_memory": "pycoll.shm.shared",   # registered buffers
    "empty_shared": "pycoll.shm.shared",
    "is_registered": "pycoll.shm.shared",
    "shared_scratch": "pycoll.shm.shared",
    "stats": "pycoll.observe.stragglers",
    "PartialAllReduce": "pycoll.partial",        # eager-SGD partial all-reduce; also pycoll.partial.*
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pycoll' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


_installed = False


def _install() -> None:
    """What a pycoll group needs from torch: two torch functions wrapped so that they reach a
    Python process group, and Dynamo told not to trace the group's code. Done when the first
    group is created: none of it matters before one exists."""
    global _installed
    if _installed:
        return
    from pycoll.c10d.backend import ProcessGroupPycoll
    from pycoll.core.work import Work

    torch_compat.install()
    torch_compat.skip_dynamo(ProcessGroupPycoll, Work)
    _installed = True


def create(opts, backend_options=None):
    """The creator torch.distributed calls for backend="pycoll" (registered with torch's
    extended API: ``opts`` is its ``_DistributedBackendOptions``)."""
    _install()
    from pycoll.c10d.backend import create as make

    return make(opts, backend_options)


def _register() -> None:
    if BACKEND_NAME.upper() not in torch_compat.registered_backends():
        # "cuda" only on a CUDA build of torch, decided without touching the driver (a CUDA
        # context made at import would break ranks forked from this process).
        devices = backend_devices(torch.version.cuda is not None)
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=devices)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """gloo's monitored_barrier for pycoll groups (torch's own wrapper only accepts gloo)."""
    pg = group if group is not None else torch_compat.default_group()
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def set_algorithm(collective: str, name: str, group=None) -> None:
    """Force ``collective``'s TCP algorithm in one group (as PYCOLL_ALGO does for all groups).

    Call it on every rank of the group with the same arguments, between collectives.
    """
    from pycoll import algorithms

    algorithms.get(collective, name)  # ValueError listing the valid names
    pg = group if group is not None else torch_compat.default_group()
    pg.communicator.tuner.overrides[collective] = name


def shrink(group=None, exclude=(), flags: int = 0):
    """The group of ``group``'s ranks but ``exclude``, in-process, for the ranks that stay.

    ``dist.shrink_group`` on a torch that has it (the returned group replaces ``group``; the
    new default group if ``group`` is the default), the same steps otherwise. Call it on
    every remaining rank, typically after a collective failed naming the dead ``exclude``
    rank (docs/faults.md, "Surviving a failure"). ``flags=1`` (SHRINK_ABORT) fails the old
    group's outstanding operations first.
    """
    pg = group if group is not None else torch_compat.default_group()
    excluded = sorted({int(r) for r in exclude})
    return torch_compat.shrink_group(pg, excluded, flags, lambda: pg.shrink(excluded, flags))


def failed_ranks(group=None, wait: float = 5.0) -> list[int]:
    """The ranks of ``group`` that died: their connection to this rank ended without the
    goodbye a clean destroy sends. Waits up to ``wait`` seconds for at least one (a rank
    that just caught a peer's error may see it a moment before its connection says so).
    Survivors of the same deaths get the same answer, so it can go to ``shrink`` as it is.
    """
    import time

    pg = group if group is not None else torch_compat.default_group()
    deadline = time.monotonic() + wait
    while True:
        dead = sorted(pg.communicator.p2p.dead_peers())
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.005)


_register()

__all__ = ["ProcessGroupPycoll", "PycollError", "CommError", "CommTimeoutError", "PeerClosedError",
           "MismatchError", "ProtocolError", "AuthenticationError", "monitored_barrier", "set_algorithm", "shrink", "failed_ranks", "stats", "PartialAllReduce", "BACKEND_NAME",
           "empty_shared", "can_share_memory", "is_registered", "shared_scratch"]
