"""The reducer: gradient readiness, bucket launches in order, end-of-backward write-back.

Per synchronised iteration:
1. The first post-accumulate-grad hook opens the iteration: it queues ``_finalize`` on the
   autograd engine (runs once backward is done) and marks the parameters that the forward
   graph cannot reach (find_unused_parameters) ready at once, with zero contribution.
2. Each hook copies its gradient into its bucket view, scaled by 1/world (one pass), or
   scales the view in place when ``param.grad`` already is that view.
3. A bucket whose last gradient arrived is launched (async all-reduce or comm hook) if
   every earlier bucket has been; buckets are therefore launched in index order on every
   rank, whatever order their gradients arrive in.
4. ``_finalize`` launches buckets that never filled (zeros for the missing gradients, so
   every rank issues the same collectives and nobody hangs), waits for all, writes the
   averages back to ``param.grad`` and raises a clear error if a gradient was missing.
After the first iteration the buckets are rebuilt in the order gradients arrived (one
rank's observed order, the same on every rank; see ``rebuild_if_pending``).
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .buckets import (MB, Bucket, GradBucket, assign_buckets, host_cpus, overlap_pays, shadow_bucket,
                      sharing_pycoll)
from .graph import reachable_leaves
from .timeline import BucketTimes, Timeline

_now = time.perf_counter


class Reducer:
    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], group,
                 bucket_cap_mb: float | None, first_bucket_cap_mb: float | None, find_unused: bool,
                 grad_as_view: bool, static_graph: bool, shared_buckets: bool | None = None) -> None:
        self.params, self.names = list(params), list(names)
        self.group = group
        # Buckets in the memory the group's ranks share, where the group can (pycoll on one
        # host): its all_reduce then works in place on every rank's bucket, without staging.
        one_host = one_host_pycoll(group, self.params)
        self._alloc = shared_allocator(one_host, group) if shared_buckets is not False else None
        self.world = dist.get_world_size(group)
        # No cap given: torch's 25 MB (first bucket 1 MB), unless the ranks share a host
        # whose cores are all computing; then one bucket, reduced once backward is done.
        self.overlap = (bucket_cap_mb is not None or first_bucket_cap_mb is not None
                        or overlap_pays_for(group, self.params))
        if self.overlap:
            self.cap = max(1, int((25 if bucket_cap_mb is None else bucket_cap_mb) * MB))
            self.first_cap = max(1, int((1 if first_bucket_cap_mb is None else first_bucket_cap_mb) * MB))
        else:
            self.cap = self.first_cap = sys.maxsize
        self.find_unused, self.grad_as_view, self.static_graph = find_unused, grad_as_view, static_graph
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self.timeline = Timeline()
        self.num_synced_iters = 0
        # Rebuilding needs the same arrival order every iteration, so it is off when the
        # set of used parameters may change (dynamic find_unused_parameters), as in torch.
        self._may_rebuild = static_graph or not find_unused
        self._rebuilt = False
        self.rebuild_pending = False
        self._order: list[int] = []
        self._static_unused: list[int] | None = None   # static_graph: found in iteration 1
        self._global_unused: set[int] = set()
        self._expect = False   # the coming backward synchronises
        self._active = False   # a synchronised backward is running
        self._unused: list[int] = []
        self._inv = 1.0 / self.world
        self._build(list(reversed(range(len(self.params)))))
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_ready_hook(me, i)) for i, p in enumerate(self.params)]
        # A dropped wrapper (re-wrapped after a shrink, say) takes its hooks off the parameters.
        weakref.finalize(self, _remove_hooks, handles)

    # ---- layout -----------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        assignment = assign_buckets(sizes, keys, order, self.first_cap, self.cap)
        if getattr(self, "buckets", None) is not None and assignment == self.bucket_indices():
            return  # the observed order gives the same buckets: keep the buffers
        self.buckets = []  # drop the old buffers before allocating the new ones
        self.buckets = [Bucket.allocate(b, idx, [self.params[i] for i in idx], self._alloc)
                        for b, idx in enumerate(assignment)]
        self._where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for pos, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket.index, pos)
        self._counts = [len(b.param_indices) for b in self.buckets]
        if self.grad_as_view:  # existing gradients move into (become) the bucket views
            with torch.no_grad():
                for bucket in self.buckets:
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is not None:
                            view.copy_(p.grad)
                            p.grad = view

    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices (into ``params``) of each bucket, in launch order."""
        return [list(b.param_indices) for b in self.buckets]

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook may only be called once")
        if self.num_synced_iters or self._active:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        self.comm_hook, self.comm_state = hook, state

    # ---- per iteration ----------------------------------------------------------------
    def prepare_for_backward(self, outputs: Any, sync: bool, divisor: int) -> None:
        """Called at the end of each forward: will the coming backward synchronise?"""
        if self._active:
            raise RuntimeError("DistributedDataParallel: a forward started while the previous "
                               "backward was still reducing gradients")
        self._expect = sync
        if not sync:
            return
        self._inv = 1.0 / divisor
        if self.static_graph and self._static_unused is not None:
            self._unused = self._static_unused
        elif self.find_unused or self.static_graph:
            reached = reachable_leaves(outputs)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
            if self.static_graph:
                self._static_unused = self._unused
        else:
            self._unused = []

    def _needs_used_map(self) -> bool:
        if self.static_graph:
            return self.num_synced_iters == 0
        return self.find_unused

    def on_ready(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter i."""
        if not self._expect:
            return  # no_sync, or a forward without grad sync: accumulate locally
        if not self._active:
            self._begin()
        if self._marked[i]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[i]!r} received its gradient twice "
                "in one iteration (backward called twice, or a reentrant checkpoint); call the "
                "model's forward before each backward")
        if self._recording:
            self._order.append(i)
        self._mark(i, True)

    def _begin(self) -> None:
        self._active = True
        self._pending = self._counts.copy()
        self._marked = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next = 0
        self._works: list[Any] = [None] * len(self.buckets)
        self._inflight: list[int] = []
        self._recording = self._may_rebuild and not self._rebuilt and self.num_synced_iters == 0
        self.timeline = Timeline(backward_start=_now(),
                                 buckets=[BucketTimes(b.index, b.nbytes) for b in self.buckets])
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_callback)
        for i in self._unused:
            self._mark(i, False)

    def _mark(self, i: int, used: bool) -> None:
        self._marked[i] = True
        self._used[i] = used
        b, pos = self._where[i]
        bucket = self.buckets[b]
        view = bucket.views[pos]
        param = self.params[i]
        grad = param.grad
        scale = self.comm_hook is None  # a hook divides by itself (torch's contract)
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self.grad_as_view and grad.data_ptr() == view.data_ptr():
                if scale:
                    view.mul_(self._inv)
            else:
                if scale:
                    torch.mul(grad, self._inv, out=view)  # copy and average in one pass
                else:
                    view.copy_(grad)
                if self.grad_as_view:
                    param.grad = view
        if self._inflight:
            self._poll()
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self.timeline.buckets[b].ready = _now()
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._launch(self._next)
                self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self.timeline.buckets[b].start = _now()
        if self.comm_hook is None:
            self._works[b] = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        else:
            self._works[b] = self.comm_hook(self.comm_state, GradBucket(
                b, bucket.buffer, bucket.params, bucket.views, b == len(self.buckets) - 1))
        self._inflight.append(b)

    def _poll(self) -> None:
        """Stamp the end of collectives found complete (an upper bound on the true end).

        Polled from the hooks and at the end of backward, never from a completion callback:
        a Python callback would make the backend's thread wait for the GIL before it can
        start the next bucket.
        """
        still = []
        for b in self._inflight:
            handle = self._works[b]
            done = handle.is_completed() if hasattr(handle, "is_completed") else handle.done()
            if done:
                self.timeline.buckets[b].mark_end(_now())
            else:
                still.append(b)
        self._inflight = still

    # ---- end of backward --------------------------------------------------------------
    def _finalize_callback(self) -> None:
        try:
            self._finalize()
        finally:
            self._active = False
            self._expect = False
            self._works, self._inflight = [], []  # a Work holds its tensors: let old ones go

    def _finalize(self) -> None:
        self._poll()
        self.timeline.backward_end = _now()
        missing = [i for i, marked in enumerate(self._marked) if not marked]
        for i in missing:  # keep every rank's collectives matched, then report
            self._mark(i, False)
        used_work = used_map = None
        if self._needs_used_map():
            used_map = torch.tensor(self._used, dtype=torch.int32)
            used_work = dist.all_reduce(used_map, group=self.group, async_op=True)
        for b, bucket in enumerate(self.buckets):
            self._wait(b, bucket)
        if used_work is not None:
            used_work.wait()
            self._global_unused = {i for i, n in enumerate(used_map.tolist()) if n == 0}
        elif not (self.find_unused or self.static_graph):
            self._global_unused = set()
        if missing:
            self.num_synced_iters += 1
            raise RuntimeError(self._missing_message(missing))
        self._write_back()
        self.num_synced_iters += 1
        if self._recording:
            seen = set(self._order)
            self._order += [i for i in reversed(range(len(self.params))) if i not in seen]
            self.rebuild_pending = True
        self.timeline.finalized = _now()

    def _wait(self, b: int, bucket: Bucket) -> None:
        handle = self._works[b]
        result = handle.wait()
        if self.comm_hook is not None:
            if isinstance(result, (list, tuple)):
                result = result[0]
            if not isinstance(result, torch.Tensor) or result.shape != bucket.buffer.shape:
                raise RuntimeError("a DDP comm hook's future must resolve to a tensor shaped "
                                   f"like bucket.buffer() {tuple(bucket.buffer.shape)}")
            if result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result)
        self.timeline.buckets[b].mark_end(_now())

    def _write_back(self) -> None:
        unused = self._global_unused
        with torch.no_grad():
            for bucket in self.buckets:
                for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views):
                    if i in unused:
                        continue  # no rank produced a gradient: leave .grad as it was
                    grad = p.grad
                    if self.grad_as_view:
                        if grad is None or grad.data_ptr() != view.data_ptr():
                            p.grad = view
                    elif grad is None:
                        p.grad = view.clone()
                    else:
                        grad.copy_(view)

    def _missing_message(self, missing: list[int]) -> str:
        names = ", ".join(repr(self.names[i]) for i in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        if self.find_unused or self.static_graph:
            why = ("they are reachable from the forward's outputs, but the loss does not "
                   "depend on them; make the loss use every output")
        else:
            why = ("pass find_unused_parameters=True to DistributedDataParallel if some "
                   "parameters are legitimately unused in some iterations, or make sure every "
                   "forward output takes part in the loss")
        return (f"DistributedDataParallel: parameters {names}{more} received no gradient in this "
                f"backward, so their buckets could not be reduced; {why}. (Their gradients were "
                "reduced as zeros on this rank so that no rank hangs.)")

    # ---- rebuild and join -------------------------------------------------------------
    def rebuild_if_pending(self) -> None:
        """Rebuild buckets in observed arrival order; a collective, call it on every rank."""
        if not self.rebuild_pending:
            return
        self.rebuild_pending = False
        self._rebuilt = True
        n = len(self.params)
        complete = len(self._order) == n
        mine = torch.tensor(self._order if complete else [-1] * n, dtype=torch.int64)
        gathered = [torch.empty(n, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        for order in gathered:  # the lowest rank that observed a full order decides
            if n and order[0].item() >= 0:
                order_list = order.tolist()
                if sorted(order_list) != list(range(n)):
                    raise RuntimeError("DistributedDataParallel: corrupt rebuild order")
                self._build(order_list)
                return

    def shadow_backward(self) -> None:
        """A joined rank's stand-in for a synchronised backward: zeros for every bucket."""
        works = []
        for b, bucket in enumerate(self.buckets):
            shadow = shadow_bucket(bucket, b == len(self.buckets) - 1)
            if self.comm_hook is None:
                works.append(dist.all_reduce(shadow.buffer(), group=self.group, async_op=True))
            else:
                works.append(self.comm_hook(self.comm_state, shadow))
        used_map = None
        if self._needs_used_map():
            used_map = torch.zeros(len(self.params), dtype=torch.int32)
            works.append(dist.all_reduce(used_map, group=self.group, async_op=True))
        for work in works:
            work.wait()
        if used_map is not None and self.static_graph:
            self._static_unused = [i for i, n in enumerate(used_map.tolist()) if n == 0]
        self.num_synced_iters += 1
        if self._may_rebuild and not self._rebuilt and self.num_synced_iters == 1:
            self.rebuild_pending = True  # others rebuild now; this rank joins with no order


def one_host_pycoll(group, params: Sequence[torch.Tensor]):
    """The ``pycoll`` module when ``group`` is a pycoll group whose ranks all share one host
    (so the reducer can use its registered memory and knows its ranks compete for the same
    cores) and the parameters are CPU tensors; None otherwise. Every rank decides alike
    (the group's mode and the model are the same everywhere)."""
    return sharing_pycoll(group) if all(p.device.type == "cpu" for p in params) else None


def overlap_pays_for(group, params: Sequence[torch.Tensor]) -> bool:
    """Whether reducing buckets during backward can gain on ``group`` (``overlap_pays``):
    True unless it is a one-host pycoll group of CPU parameters whose ranks' threads, plus a
    worker each, outnumber the cores their affinity masks allow. On such a group it is a
    collective (every rank's thread count and mask are gathered: they may differ, and every
    rank must decide alike); elsewhere it communicates nothing."""
    if one_host_pycoll(group, params) is None:
        return True
    mine = (torch.get_num_threads(), sorted(host_cpus()))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    cores = set().union(*(set(cpus) for _, cpus in every))
    return overlap_pays([threads for threads, _ in every], len(cores))


def shared_allocator(pycoll, group) -> Callable | None:
    """``alloc(numel, dtype)`` of zeroed buckets in ``group``'s shared memory (``pycoll``
    from ``one_host_pycoll``), or None where there is none."""
    if pycoll is None:
        return None
    # cache=False: a bucket lives until a rebuild replaces it, usually by buckets of other
    # sizes, which a cached block would never serve while holding its pages. unmap_peers:
    # the buckets replace memory the user had in ordinary ones, so they count once in RSS
    # (a few per cent of a step where the buckets are large: docs/ddp.md).
    return lambda numel, dtype: pycoll.empty_shared(numel, dtype=dtype, group=group, cache=False,
                                                    unmap_peers=True).zero_()


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _ready_hook(reducer_ref: "weakref.ReferenceType[Reducer]", i: int) -> Callable:
    # A weak reference: a dropped DDP wrapper must not keep reducing through old hooks.
    def hook(_param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer.on_ready(i)
    return hook
