"""The c10d backend: torch.distributed's ProcessGroup surface on top of a Communicator.

Thin on purpose: every method is a plan and a submit. The plan (``plans``) checks the
arguments before any I/O (dtype, device, layout, list lengths, sizes, roots, ops) and says
which primitive runs on which flat tensors; ``_call`` hands it to the CPU channel (a task
of the communicator, ``cpu``; point-to-point on its engine, ``p2p``) or, for CUDA tensors,
to the CUDA channel (``pycoll.cuda``). Whatever a rank can check alone is checked in the
plan; what needs the other ranks (sizes, ops, roots agreeing) travels in the frame headers
and is checked by the transport.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll import observe, rendezvous, torch_compat
from pycoll.c10d import cpu, dispatch, p2p, plans, reconfigure, shrink
from pycoll.c10d.lookups import DeviceLookups
from pycoll.core.collectives import all_reduce_task
from pycoll.core.communicator import Communicator
from pycoll.core.work import Work, completed
from pycoll.cuda import channel_for
from pycoll.cuda.paths import backend_devices

log = logging.getLogger("pycoll")


class ProcessGroupPycoll(DeviceLookups, dist.ProcessGroup):
    is_pycoll = True   # how torch_compat's wrappers tell a pycoll group from others
    _torch_hooks = False      # a hook is on the group that only torch's path runs (``dispatch``)
    _torch_path = None        # the group's own C++ ProcessGroup (``dispatch``; torch >= 2.14)
    _mirrored_recorder = None

    def __init__(self, store, rank: int, size: int, timeout: timedelta, *,
                 enable_reconfigure: bool = False) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._base_store = store       # where reconfigures meet (``reconfigure``)
        self._cuda = None              # the CUDA channel, made at the first call with CUDA tensors
        self._monitored_calls = 0
        self._shrinks = 0              # shrinks attempted: each attempt's keys are its own
        self._abort_hooks: dict = {}
        self._uuids: set[int] = set()  # reconfigure uuids this group has tried
        self._uuid = -1                # the reconfigure it is in (-1: as made)
        dispatch.attach(self, backend_devices(torch.version.cuda is not None))
        if enable_reconfigure:         # no members until the first reconfigure, as gloo's
            self._first_rank = -1
            self._store = None
            self._comm = reconfigure.Unconfigured(rank, size, timeout.total_seconds())
            return
        self._first_rank = rank
        # This generation's keys only; CUDA calls and splits exchange their set-up through it.
        self._store = store = rendezvous.generation_store(store, rank, size)
        self._comm = Communicator(store, rank, size, timeout.total_seconds(), observers=observe.for_group(rank))

    @property
    def communicator(self) -> Communicator:
        """The engine of this group (``pycoll.core.communicator``)."""
        return self._comm

    # -- identity ----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "pycoll"

    def name(self) -> str:
        return "pycoll"

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # C++ callers of a Python group (DDP's reducer) ask these: they follow a reconfigure too.
    getRank = rank
    getSize = size

    def __repr__(self) -> str:
        return f"ProcessGroupPycoll(rank={self._rank}, size={self._size})"

    # c10d keeps a group's name and description on its backends; this class is its own
    # backend, so it keeps them itself (torch calls these through its C++ trampoline).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    # torch runs a group's pre and post hooks in its C++ op methods: a group with one
    # sends its ops through a C++ ProcessGroup of its own (``dispatch``).
    def register_pre_hook(self, hook_id: int, hook) -> None:
        dispatch.register_hook(self, "pre", hook_id, hook)

    def register_post_hook(self, hook_id: int, hook) -> None:
        dispatch.register_hook(self, "post", hook_id, hook)

    # -- collectives --------------------------------------------------------------------
    @dispatch.op
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        fast = plans.latency_allreduce(self._size, tensors, opts)
        if fast is not None:
            # The task straight to the communicator, without the generic channel's frames.
            return self._comm.submit("all_reduce", [tensors[0]], all_reduce_task(self._comm, *fast),
                                     not opts.asyncOp, _op_timeout(opts))
        plan = plans.allreduce(self._rank, self._size, tensors, opts)
        return self._dispatch(plan, plans.allreduce, opts, (tensors,))

    @dispatch.op
    def allreduce_coalesced(self, tensors, opts=None):
        return self._call(plans.allreduce_coalesced, opts, tensors)

    @dispatch.op
    def reduce(self, tensors, opts=None):
        return self._call(plans.reduce, opts, tensors)

    @dispatch.op
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        return self._call(plans.reduce_scatter, opts, output_tensors,
                          input_tensors)

    @dispatch.op
    def reduce_scatter_single(self, output, input, opts=None):
        return self._call(plans.reduce_scatter_single, opts, output, input)

    _reduce_scatter_base = dispatch.alias("_reduce_scatter_base", reduce_scatter_single)

    @dispatch.op
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(ProcessGroupPycoll.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = dispatch.alias("reduce_scatter_tensor_coalesced", reduce_scatter_single_coalesced)

    @dispatch.op
    def broadcast(self, tensors, opts=None):
        return self._call(plans.broadcast, opts, tensors)

    @dispatch.op
    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._call(plans.allgather, opts, output_tensors, input_tensors)

    @dispatch.op
    def all_gather_single(self, output, input, opts=None):
        return self._call(plans.all_gather_single, opts, output, input)

    _allgather_base = dispatch.alias("_allgather_base", all_gather_single)

    @dispatch.op
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(ProcessGroupPycoll.all_gather_single, outputs, inputs, opts)

    allgather_into_tensor_coalesced = dispatch.alias("allgather_into_tensor_coalesced", all_gather_single_coalesced)

    @dispatch.op
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._call(plans.allgather_coalesced, opts, output_lists, input_list)

    @dispatch.op
    def gather(self, output_tensors, input_tensors, opts=None):
        return self._call(plans.gather, opts, output_tensors, input_tensors)

    @dispatch.op
    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._call(plans.scatter, opts, output_tensors, input_tensors)

    @dispatch.op
    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._call(plans.alltoall, opts, output_tensors, input_tensors)

    @dispatch.op
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._call(plans.all_to_all_single, opts, output, input, output_split_sizes, input_split_sizes)

    alltoall_base = dispatch.alias("alltoall_base", all_to_all_single)

    @dispatch.op
    def barrier(self, opts=None):
        plan = plans.barrier(self._rank, self._size, opts)
        if plan.device is not None:
            return self._cuda_channel().run(plan, None, ())
        if self._cuda is not None:
            # "Everyone passed the barrier" also means: everyone's CUDA work issued before it
            # has finished (as torch's NCCL backend behaves).
            self._cuda.sync_device()
        return self._run_cpu(plan, opts)

    # -- point to point ----------------------------------------------------------------------
    @dispatch.op
    def send(self, tensors, dst_rank: int, tag: int = 0):
        return self._call(plans.send, None, tensors, dst_rank, tag)

    @dispatch.op
    def recv(self, tensors, src_rank: int, tag: int = 0):
        return self._call(plans.recv, None, tensors, src_rank, tag)

    @dispatch.op
    def recv_anysource(self, tensors, tag: int = 0):
        return self._call(plans.recv_anysource, None, tensors, tag)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """Gloo's monitored barrier: rank 0 names every rank that did not arrive in time.

        It runs on the point-to-point channel, so a failed monitored barrier does not
        break the group. torch's ``dist.monitored_barrier`` only accepts gloo; call this
        as ``pycoll.monitored_barrier(group, timeout, wait_all_ranks)``.
        """
        self._monitored_calls += 1
        return p2p.monitored_barrier(self, self._monitored_calls, self._timeout if timeout is None else timeout,
                                     wait_all_ranks)

    # -- lifecycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._cuda is not None:
            self._cuda.close(False)
        self._comm.shutdown()

    def abort(self) -> None:
        if self._cuda is not None:
            self._cuda.close(True)
        self._comm.shutdown(abort=True)
        for hook in list(self._abort_hooks.values()):   # on the caller's thread, no lock held
            try:
                hook()
            except Exception:  # noqa: BLE001 - one user hook must not stop the others
                log.exception("pycoll: an abort hook raised")

    def shrink(self, ranks_to_exclude, shrink_flags: int = 0, opts=None):
        """c10d's ``Backend.shrink``, which ``dist.shrink_group`` calls: the remaining ranks'
        new group (``pycoll.c10d.shrink``)."""
        return shrink.shrink(self, ranks_to_exclude, shrink_flags, opts)

    # -- torch's reconfigure API (torch >= 2.14; ``pycoll.c10d.reconfigure``) ------------------
    @property
    def supports_reconfigure(self) -> bool:
        return torch_compat.reconfigure_supported()

    def get_reconfigure_handle(self) -> str:
        torch_compat.require_reconfigure()
        return reconfigure.handle_of(self)

    def reconfigure(self, opts) -> Work:
        return reconfigure.run(self, opts)

    def get_error(self):
        """c10d's ``ErrorType`` of what broke the group (``SUCCESS`` while nothing has)."""
        err = self._comm.error
        name = "SUCCESS" if err is None else "TIMEOUT" if isinstance(err, TimeoutError) else \
            "REMOTE_ERROR" if isinstance(err, ConnectionError) else "COMM_ERROR"
        return torch_compat.error_type(name)

    def register_abort_hook(self, hook_id: int, hook) -> None:
        """``hook()`` runs when the group is aborted (``pg.abort()``), on the aborting thread."""
        self._abort_hooks[hook_id] = hook

    def unregister_abort_hook(self, hook_id: int) -> None:
        self._abort_hooks.pop(hook_id, None)

    registerAbortHook = register_abort_hook
    unregisterAbortHook = unregister_abort_hook

    # -- running a plan ----------------------------------------------------------------------
    def _call(self, builder, opts, *args) -> Work:
        """Plan the call, then run it where its tensors live (a call without options gets
        torch's defaults for it: ``plans.OPTIONS``)."""
        if opts is None and builder in plans.OPTIONS:
            opts = plans.OPTIONS[builder]()
        plan = builder(self._rank, self._size, *args) if opts is None else \
            builder(self._rank, self._size, *args, opts)
        return self._dispatch(plan, builder, opts, args)

    def _dispatch(self, plan: plans.Plan, builder, opts, args) -> Work:
        if plan.device.type == "cpu":
            return self._run_cpu(plan, opts)
        return self._cuda_channel().run(plan, lambda *host: self._call(builder, opts, *host), args)

    def _run_cpu(self, plan: plans.Plan, opts) -> Work:
        if plan.op in ("send", "recv"):
            return p2p.post(self._comm, plan, self._timeout.total_seconds())
        return self._comm.submit(plan.op, plan.outputs, cpu.task(self._comm, plan),
                                 not getattr(opts, "asyncOp", True), _op_timeout(opts))

    def _cuda_channel(self):
        if self._cuda is None:
            self._cuda = channel_for(self)
        return self._cuda

    def _coalesced(self, fn, outputs, inputs, opts) -> Work:
        if len(outputs) != len(inputs):
            raise ValueError("coalesced collective: output and input lists differ in length")
        fn = getattr(fn, "impl", fn)   # each part runs directly: torch's hooks saw the whole call
        works = [fn(self, o, i, opts) for o, i in zip(outputs, inputs)]
        if not works:
            return completed("coalesced", [])
        return works[-1]  # ops complete in issue order, so the last one finishing covers all


def _op_timeout(opts) -> float | None:
    """Seconds of ``opts.timeout`` when the caller set one; None for c10d's unset (-1 ms) or 0."""
    t = getattr(opts, "timeout", None)
    secs = t.total_seconds() if t is not None else 0.0
    return secs if secs > 0 else None


def create(opts, backend_options=None) -> ProcessGroupPycoll:
    """The creator torch.distributed calls for backend="pycoll" (its extended form: torch's
    ``_DistributedBackendOptions``, which carries ``enable_reconfigure`` on torch >= 2.14)."""
    return ProcessGroupPycoll(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                              enable_reconfigure=getattr(opts, "enable_reconfigure", False))
