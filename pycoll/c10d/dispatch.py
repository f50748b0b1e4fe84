"""torch's own ProcessGroup path for a pycoll group: where torch's per-op hooks run.

torch runs its group-level machinery inside the C++ ``ProcessGroup``'s op methods: the pre
and post hooks that torch's Flight Recorder (``FlightRecorderHook``, attached to every new
group from torch 2.15), its NaN check (``NanCheckHook``) and users (``pg.register_pre_hook``)
attach, then the dispatcher's c10d op, which calls the ``Backend`` registered for the
tensors' device. A pycoll group is a ``ProcessGroup`` subclass whose op methods are Python
(its rank and size follow a reconfigure, and the 8 B path pays no C++ round trip), so none
of that sees its ops unless an op goes through a C++ ProcessGroup.

So every pycoll group has a ``TorchBackend`` (torch >= 2.14, the first whose c10d Backend
has a Python constructor), registered on the group itself, where it answers what C++ asks
of a group's default backend (``group_name``, which the recorder files entries under), and
on a plain C++ ``ProcessGroup`` of the group's own, its *torch path*. While torch has a
hook on the group (``hooked``), each op method made by ``op`` calls the torch path's method
of the same name: torch runs the hooks (mirrored onto the torch path: ``_mirror``), and its
dispatcher calls the TorchBackend, which runs the op's pycoll implementation. With no hook
the op runs directly. docs/c10d.md has the measurements behind this choice.
"""

from __future__ import annotations

import os
import threading
import weakref
from threading import get_ident

import torch
import torch.distributed as dist

from pycoll import torch_compat

_C10D = torch_compat.c10d_classes
_BASE = dist.ProcessGroup

# The groups torch attached its Flight Recorder to: membership is one lookup per op.
_RECORDED = torch_compat.recorded_groups()

# Only the main thread's ops take torch's path: calls from two threads at once into torch's
# C++ path of one recorded group crashed torch 2.15 (a segmentation fault in an irecv that
# pycoll's partial all-reduce posts from its own thread beside the main thread's
# all_reduce). Other threads' ops run directly and are not in the recorder.
_MAIN = threading.main_thread().ident

# The op methods ``op`` made, by name: TorchBackend serves each under that name.
_IMPLS: dict[str, object] = {}
_P2P = {"send", "recv", "recv_anysource"}   # numbered apart from the collectives by the recorder


def backend_supported() -> bool:
    """Whether this torch lets Python subclass c10d's Backend (torch >= 2.14)."""
    try:
        _C10D.Backend(0, 1)
    except TypeError:   # torch 2.13: "No constructor defined"
        return False
    return True


_SUPPORTED = backend_supported()


def nan_check_requested() -> bool:
    """torch attaches its NaN check hook to every new group when this is set."""
    return os.environ.get("TORCH_DIST_NAN_CHECK", "0") == "1"


def hooked(group) -> bool:
    """Whether torch has a per-op hook on ``group``: its ops must take torch's C++ path."""
    return group._torch_hooks or group in _RECORDED


def op(impl, name: str | None = None):
    """The group's op method ``name`` (default: ``impl``'s name) for the pycoll
    implementation ``impl``: direct, or by the group's torch path when it is hooked."""
    name = name or impl.__name__
    _IMPLS[name] = impl
    if getattr(_BASE, name, None) is None or not _SUPPORTED:
        return impl

    collective = name not in _P2P

    def method(self, *args, **kwargs):
        if (self._torch_hooks or self in _RECORDED) and get_ident() == _MAIN and not _views(args):
            path = _torch_path(self)
            if collective and self._mirrored_recorder is not None:
                _count(self)
            try:
                getattr(path, name)(*args, **kwargs)
            finally:
                self._comm.recording = 0   # an op that submitted nothing leaves none for the next
                # (also when interrupted: the slot must not keep the op's tensors alive)
                work = _served.__dict__.pop("work", None)
            return work
        return impl(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = impl.__doc__
    method.impl = impl
    return method


def _views(args) -> bool:
    """Whether a tensor argument is a view torch marks as negated or conjugated: torch's
    dispatcher hands the backend a resolved copy, so the result would never reach the
    caller's tensor; pycoll resolves such views itself on the direct path."""
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj()):
                return True
    return False


def _count(group) -> None:
    """The recorder numbers a group's collectives 1, 2, ... as they pass its hooks (its
    ``collective_seq_id``): the communicator pairs the next op's sequence number with it."""
    group._recorded += 1
    if hasattr(group._comm, "recorded"):
        group._comm.recording = group._recorded


def alias(name: str, method):
    """The op method ``name`` for the implementation of ``method`` (made by ``op``)."""
    return op(getattr(method, "impl", method), name)


def _torch_path(group):
    """The group's C++ ProcessGroup, with torch's hooks on the group mirrored onto it."""
    if group._mirrored_recorder is None and group in _RECORDED:
        _mirror(group)
    return group._torch_path


def _mirror(group) -> None:
    """Attach to the torch path the Flight Recorder torch attached to the group, under
    the group's name, description and global ranks (the recorder's keys)."""
    path = group._torch_path
    path._set_group_name(group.group_name)
    path._set_group_desc(group.group_desc)
    ranks = torch_compat.global_ranks(group)
    if not ranks:
        ranks = list(range(group._size))
    group._mirrored_recorder = _C10D.FlightRecorderHook.attach(path, ranks)


def register_hook(group, kind: str, hook_id: int, hook) -> None:
    """A user's ``pg.register_pre_hook`` / ``register_post_hook``: on the torch path."""
    group._torch_hooks = True
    getattr(group._torch_path, f"register_{kind}_hook")(hook_id, hook)


# The Work the innermost TorchBackend call on this thread made. What torch's C++ method
# returns is a plain c10d Work over it, whose is_completed, exception and source_rank are
# c10d's defaults, not pycoll's: the op method returns pycoll's own Work instead.
_served = threading.local()


def _serving(name: str, impl):
    def serve(self, *args):
        group = self._group()
        if group is None:
            raise RuntimeError(f"pycoll: {name} on a process group that was freed")
        work = _served.work = impl(group, *args)
        return work

    serve.__name__ = name
    return serve


def backend_class():
    """TorchBackend: c10d's Backend whose ops are the group's pycoll implementations."""

    class TorchBackend(_C10D.Backend):
        """What torch's dispatcher calls for a pycoll group's tensors (module docstring)."""

        def __init__(self, group) -> None:
            super().__init__(group._rank, group._size)
            self._group = weakref.ref(group)   # the group owns this backend, not the reverse

        def getBackendName(self) -> str:
            return "pycoll"

        def name(self) -> str:
            return "pycoll"

    for name, impl in _IMPLS.items():
        setattr(TorchBackend, name, _serving(name, impl))
    return TorchBackend


_backend_class = None


def attach(group, devices: list[str]) -> None:
    """Give ``group`` its TorchBackend and torch path for ``devices`` (again after a
    reconfigure: c10d keeps a backend's and a ProcessGroup's rank and size, which a
    reconfigure changes)."""
    group._torch_hooks = group._torch_hooks or nan_check_requested()
    group._mirrored_recorder = None
    group._recorded = 0
    if not _SUPPORTED:
        return
    global _backend_class
    if _backend_class is None:
        _backend_class = backend_class()
    backend = _backend_class(group)
    path = _BASE(group._rank, group._size)
    kind = _BASE.BackendType.CUSTOM
    for pg in (group, path):
        for device in devices:
            pg._register_backend(torch.device(device), kind, backend)
        pg._set_default_backend(kind)
    group._torch_path = path
    if nan_check_requested():
        _C10D.NanCheckHook.attach(path)
