"""Every private or version-dependent piece of torch that pycoll touches, in one place.

pycoll is tested with torch 2.13, 2.14 and 2.15 (README). Newer releases may move what is private; each
piece is looked up here, once, and a missing one fails with a message that names this
torch's version and the piece, instead of an AttributeError deep inside a collective.
Optional pieces (the Dynamo skip) degrade with one log line.

Two torch functions cannot reach a Python process group as torch writes them, and are
wrapped (the wrapper hands every other group to torch's original):

- ``distributed_c10d._set_pg_timeout`` sets timeouts only on ``ProcessGroupGloo`` /
  ``ProcessGroupNCCL`` instances found through ``_get_backend``;
- ``distributed_c10d._create_shrunk_process_group`` registers the shrunk backend on a
  fresh C++ ``ProcessGroup``, which accepts only C++ backends: a pycoll group is already
  a whole ProcessGroup, so it is used as the shrunk group itself.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger("pycoll")

TESTED = "2.13, 2.14 and 2.15"


class TorchCompatError(RuntimeError):
    """This torch lacks a piece that pycoll needs."""


def _need(owner, attr: str, what: str):
    try:
        return getattr(owner, attr)
    except AttributeError:
        name = getattr(owner, "__name__", type(owner).__name__)
        raise TorchCompatError(
            f"pycoll needs {what} ({name}.{attr}), which torch {torch.__version__} does not have; "
            f"pycoll is tested with torch {TESTED} (see the README)") from None


# -- pieces used on every call -----------------------------------------------------------
# The grad-mode setter from torch._C: torch.set_grad_enabled is a context-manager class, and
# constructing it costs three times as much on every op.
set_grad_enabled = _need(torch._C, "_set_grad_enabled", "the grad-mode setter")
has_internal_overlap = _need(torch, "_debug_has_internal_overlap", "the memory-overlap check")
default_group = _need(c10d, "_get_default_group", "the default group lookup")

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns
# (FutureWarning) on every call of the old names; older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def registered_backends() -> dict:
    """torch's table of third-party backends (name -> plugin)."""
    return _need(dist.Backend, "_plugins", "the backend plugin table")


def cpu_backend(pg):
    """The backend object serving CPU tensors in the c10d ProcessGroup ``pg`` (None where
    torch has none for it): a pycoll group reached through a wrapping ProcessGroup."""
    try:
        return pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None


def reset_group_count() -> None:
    """Set torch's count of created groups back to 0: a failed ``init_process_group`` leaves
    it advanced, and a process that inits again (a reused test rank) would then key its
    default group under another Store prefix than its fresh peers do."""
    _need(c10d, "_world", "the c10d world state").group_count = 0


def premul_sum(factor):
    """torch's ReduceOp.PREMUL_SUM with ``factor`` (what ``dist._make_nccl_premul_sum`` makes)."""
    return _need(dist, "_make_nccl_premul_sum", "the PREMUL_SUM op maker")(factor)


def foreach_copy(dst: list, src: list) -> None:
    """``d.copy_(s)`` for each pair, fused into one call where torch offers it."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)


# -- CUDA storage shared between processes (torch.multiprocessing's own calls) ---------------
def share_cuda_storage(storage) -> list:
    """The handle another process opens ``storage`` (a CUDA UntypedStorage) with: its first
    element is the device index, as this process numbers it."""
    return list(_need(storage, "_share_cuda_", "CUDA storage IPC export")())


def open_cuda_storage(handle: list):
    """A CUDA UntypedStorage over another process's memory from its ``share_cuda_storage``
    handle (the device index rewritten to this process's numbering)."""
    return _need(torch.UntypedStorage, "_new_shared_cuda", "CUDA storage IPC import")(*handle)


# -- torch.compile -----------------------------------------------------------------------
def skip_dynamo(*classes) -> None:
    """Make Dynamo run these classes' methods, and everything they call, without tracing.

    Dynamo traces every Python frame that runs while a compiled region is active, also one
    that C++ calls back into: DDP's reducer rebuilding its buckets inside a compiled DDP
    forward calls the group's ``broadcast`` (gloo's is C++, so nothing is traced there).
    Marking the code objects is what ``torch._dynamo.disable`` does, without importing
    Dynamo (1.7 s) at ``import pycoll``.
    """
    try:
        ef = torch._C._dynamo.eval_frame
        strategy = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
        mark = ef.set_code_exec_strategy
    except AttributeError as exc:
        log.info("pycoll: torch %s has no frame-skip hook (%s); torch.compile may trace into "
                 "pycoll's process group", torch.__version__, exc)
        return
    for cls in classes:
        for klass in cls.__mro__:
            if klass.__module__.split(".")[0] != "pycoll":
                continue
            for value in vars(klass).values():
                for fn in (value, getattr(value, "fget", None), getattr(value, "__func__", None)):
                    code = getattr(fn, "__code__", None)
                    if code is not None:
                        mark(code, strategy)


# -- wrapped torch functions -----------------------------------------------------------------
def _is_pycoll(group) -> bool:
    return getattr(group, "is_pycoll", False) is True


def _wrap_set_pg_timeout() -> None:
    original = _need(c10d, "_set_pg_timeout", "_set_pg_timeout")
    if getattr(original, "_pycoll", False):
        return

    def _set_pg_timeout(timeout, group=None):
        pg = group if group is not None else default_group()
        if _is_pycoll(pg):
            pg._set_default_timeout(timeout)
            return None
        return original(timeout, group)

    _set_pg_timeout._pycoll = True
    _set_pg_timeout.__doc__ = original.__doc__
    c10d._set_pg_timeout = _set_pg_timeout


def _wrap_create_shrunk_process_group() -> None:
    original = getattr(c10d, "_create_shrunk_process_group", None)
    if original is None or getattr(original, "_pycoll", False):
        return   # a torch without shrink_group: nothing to reach

    def _create_shrunk_process_group(new_backend, remaining_ranks, metadata, is_default_group):
        if not _is_pycoll(new_backend):
            return original(new_backend, remaining_ranks, metadata, is_default_group)
        name = metadata["new_group_name"]
        desc = "default:shrunken" if is_default_group else f"{metadata['original_group_name']}:shrunk"
        new_backend._set_group_name(name)
        new_backend._set_group_desc(desc)
        if metadata.get("bound_device_id") is not None:
            new_backend.bound_device_id = metadata["bound_device_id"]
        if metadata.get("backend_config") is not None:
            c10d._world.pg_backend_config[new_backend] = metadata["backend_config"]
        return new_backend

    _create_shrunk_process_group._pycoll = True
    c10d._create_shrunk_process_group = _create_shrunk_process_group


def shrink_group(pg, excluded: list[int], flags: int, build):
    """torch's ``dist.shrink_group`` where this torch has it; else the same steps by hand.

    ``build()`` makes the new pycoll group (``pg.shrink``). By hand, on a torch without
    ``shrink_group``: register the new group as torch's ``new_group`` does (its name, its
    ranks' global numbers, the default group when ``pg`` was the default), then destroy ``pg``.
    """
    torch_shrink = getattr(dist, "shrink_group", None)
    if torch_shrink is not None:
        return torch_shrink(sorted(excluded), group=pg, shrink_flags=flags)
    world = _need(c10d, "_world", "the table of process groups")
    is_default = pg is default_group()
    old_global = dist.get_process_group_ranks(pg)
    backend_name, store = world.pg_map[pg]
    new = build()
    remaining = [g for i, g in enumerate(old_global) if i not in set(excluded)]
    name = f"{world.pg_names.get(pg, 'pycoll')}:shrunk:{pg._shrinks}"
    new._set_group_name(name)
    dist.destroy_process_group(pg)
    if is_default:
        update = getattr(c10d, "_update_default_pg", None)
        update(new) if update is not None else setattr(world, "default_pg", new)
        remaining = list(range(len(remaining)))   # the shrunk default group renumbers the world
    world.pg_map[new] = (backend_name, store)
    world.pg_names[new] = name
    world.pg_backend_config[new] = backend_name
    world.pg_group_ranks[new] = {g: i for i, g in enumerate(remaining)}
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(new)
    world.pg_to_tag[new] = f"ptd:{name}"
    register = getattr(c10d, "_register_process_group", None)
    if register is not None:
        register(name, new)
    return new


# -- torch's per-op hooks (``pycoll.c10d.dispatch``) -----------------------------------------
c10d_classes = torch._C._distributed_c10d   # Backend, FlightRecorderHook, NanCheckHook (by release)


def recorded_groups() -> dict:
    """torch's table of the groups it attached its Flight Recorder to (torch >= 2.15; torch
    clears and pops it, never replaces it), or an empty dict where torch has none."""
    table = getattr(getattr(c10d, "_world", None), "pg_flight_recorder_hooks", None)
    return table if isinstance(table, dict) else {}


def global_ranks(pg) -> list[int]:
    """The global ranks of ``pg``'s members in group-rank order, as torch recorded them."""
    return list(_need(c10d, "_world", "the process-group registry").pg_group_ranks.get(pg, {}))


# -- the reconfigure API (torch >= 2.14) --------------------------------------------------
def reconfigure_supported() -> bool:
    """Whether this torch has c10d's reconfigure API (``ReconfigureOptions``)."""
    return hasattr(torch._C._distributed_c10d, "ReconfigureOptions")


def require_reconfigure() -> None:
    if not reconfigure_supported():
        raise TorchCompatError(f"pycoll: reconfigure needs torch >= 2.14 (c10d's ReconfigureOptions); "
                               f"this torch is {torch.__version__}")


def error_type(name: str):
    """c10d's ``ErrorType`` member ``name`` (torch >= 2.14), or ``name`` on an older torch."""
    kind = getattr(torch._C._distributed_c10d, "ErrorType", None)
    return getattr(kind, name) if kind is not None else name


def renumbered(pg, size: int) -> None:
    """torch's record of the default group's ranks after it took ``size`` members in place
    (torch updates nothing after a reconfigure; its rank and size come from the group)."""
    world = _need(c10d, "_world", "the process-group registry")
    if pg is world.default_pg or pg is getattr(c10d.GroupMember, "WORLD", None):
        world.pg_group_ranks[pg] = {r: r for r in range(size)}


def install() -> None:
    """Wrap the torch functions above (idempotent; called by ``import pycoll``)."""
    _wrap_set_pg_timeout()
    _wrap_create_shrunk_process_group()
