"""The CUDA channel of a process group: a plan's primitive on the caller's stream.

``CudaChannel`` is created for a process group at its first call with a CUDA tensor. That first
call is collective (every rank makes its CUDA calls in the same order, as with NCCL): each rank
publishes its facts through the group's Store (host, GPU, what it can import, the path it asks
for), every rank runs the same pure ``paths.choose_path`` on the same list, and the chosen path
is built (the NCCL communicator, or the IPC buffers and events).

After that, each call runs in the calling thread. The group has checked the arguments and made
its plan (``pycoll.c10d.plans``, the same plan as for CPU tensors); the channel runs the plan's
primitive of its path (``nccl``, ``ipc``: methods of the same names) on the caller's *current*
stream (captured when the call is made) and returns a ``CudaWork`` that holds an event
recorded after it. The staging path (and point-to-point calls on the ipc path) runs the same
call on pinned host copies instead (``staging.run``).
"""

from __future__ import annotations

import json
import logging
import threading

import torch
import torch.distributed as dist

from pycoll import rendezvous
from pycoll.cuda import paths, staging
from pycoll.cuda.facts import local_facts
from pycoll.cuda.work import CudaWork
from pycoll.errors import PycollError

log = logging.getLogger("pycoll")

P2P = ("send", "recv")
ANY = -1   # a receive from any source (transport.p2p.ANY)


class CudaChannel:
    """The CUDA side of one ProcessGroupPycoll (see the module docstring)."""

    def __init__(self, pg) -> None:
        self.pg, self.rank, self.world = pg, pg.rank(), pg.size()
        self.store = pg.get_group_store()
        self.timeout = pg.communicator.timeout
        self.path: str | None = None
        self.impl = None
        self.device: torch.device | None = None
        self.facts: list[paths.RankFacts] = []
        self.error: BaseException | None = None
        self._attempts = 0
        self._lock = threading.RLock()

    # -- set-up ------------------------------------------------------------------------------
    def _init(self, device: torch.device) -> None:
        self._attempts += 1
        gr = dist.get_rank() if dist.is_initialized() else self.rank
        mine = local_facts(device, gr)
        key = f"pycoll/cuda/facts/{self._attempts}"
        got = rendezvous.exchange_all(self.store, key, self.rank, self.world, json.dumps(mine.to_json()))
        facts = [paths.RankFacts.from_json(json.loads(v)) for v in got]
        path = paths.choose_path(facts)  # same list everywhere: same path or same error everywhere
        if path == "nccl":
            from pycoll.cuda.nccl import NcclPath
            impl = NcclPath(self.store, self.rank, self.world, device)
        elif path == "ipc":
            from pycoll.cuda.ipc import IpcPath
            impl = IpcPath(self.store, self.rank, self.world, device, self.timeout, facts)
        else:
            impl = None
            if not mine.nccl and self.world > 1 and len({(f.host, f.gpu) for f in facts}) == self.world:
                log.info("pycoll: CUDA tensors take host staging; %s", paths.cuda_hint(path="nccl"))
        self.path, self.impl, self.device, self.facts = path, impl, device, facts
        log.info("pycoll rank %d: CUDA path %s", self.rank, paths.explain(facts))

    def close(self, abort: bool = False) -> None:
        with self._lock:
            if self.impl is not None:
                self.impl.close(abort)
            self.impl = None

    def sync_device(self) -> None:
        """Before a host barrier: this rank's CUDA work so far has finished."""
        if self.device is not None:
            torch.cuda.current_stream(self.device).synchronize()

    # -- calls -------------------------------------------------------------------------------
    def run(self, plan, host_call, args: tuple):
        """Run ``plan`` on this group's path; ``host_call(*host_args)`` makes the same call on
        host copies of ``args`` (the staging path)."""
        device = plan.device
        with self._lock:
            if self.path is None:
                self._init(device)
            elif device != self.device:
                raise ValueError(f"{plan.op}: this group's CUDA tensors live on {self.device}, got {device} "
                                 f"(one device per rank and group)")
            stream = torch.cuda.current_stream(device)
            if self.path == "staging" or (self.path == "ipc" and plan.op in P2P):
                if host_call is None:   # a CUDA barrier on the staging path: the host's
                    host_call = lambda: self.pg.barrier()  # noqa: E731
                return staging.run(plan, host_call, args, device, stream)
            if self.error is not None:
                raise PycollError(f"{plan.op}: the CUDA {self.path} path is unusable after an earlier "
                                  f"error: {self.error}")
            if plan.op == "recv" and plan.args[1] == ANY:
                raise ValueError("recv from any source is not supported on the nccl path "
                                 "(as with torch's NCCL backend)")
            if plan.red is not None:
                self.impl.check_reduction(plan.outputs[0].dtype, plan.red)
            return self._run(plan, device, stream)

    def _run(self, plan, device, stream) -> CudaWork:
        fn = getattr(self.impl, plan.op)
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            try:
                fn(*plan.arguments())
                plan.finish()
            except BaseException as exc:
                if getattr(exc, "before_io", False) or isinstance(exc, (ValueError, TypeError)):
                    raise
                self.error = exc
                self.impl.abort_peers(str(exc))
                raise
            event = torch.cuda.Event()
            event.record(stream)
        source = plan.args[1] if plan.op == "recv" else -1
        return CudaWork(plan.op, plan.outputs, event, device, source)
