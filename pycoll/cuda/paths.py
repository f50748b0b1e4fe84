"""Which path CUDA tensors take, as a pure function of facts every rank published.

Three paths (docs/cuda.md):

- ``nccl``: NCCL through ``cupy.cuda.nccl``. Needs cupy with NCCL on every rank and one GPU
  per rank (NCCL refuses two ranks of one communicator on the same GPU).
- ``ipc``: CUDA IPC between the processes of one host: each rank exposes registered device
  buffers through IPC handles, peers read them directly. Needs every rank on one host and every
  rank's GPU visible to every other rank (several ranks may share one GPU). Uses torch's own
  IPC calls, so it needs no cupy.
- ``staging``: copy to pinned host memory, run this group's CPU algorithms, copy back. Works
  everywhere torch does.

``PYCOLL_CUDA_PATH=auto|nccl|ipc|staging`` (default auto) picks one. Auto takes nccl when it
can, then ipc, then staging. A forced path that cannot run raises an error that says why
(for nccl without cupy: the error names the ``cuda`` extra).

Everything here is pure (no torch, no cupy, no CUDA calls) so that it can be tested on any
machine, and so that ``import pycoll`` never touches the CUDA driver (a CUDA context made in a
forkserver parent breaks every forked rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from pycoll import settings

PATHS = ("auto", "nccl", "ipc", "staging")
ENV = "PYCOLL_CUDA_PATH"
EXTRA = "pip install 'pycoll[cuda]'"


class CudaPathError(RuntimeError):
    """A requested CUDA path cannot run on these ranks (raised the same way on every rank)."""


def cuda_hint(what: str = "", path: str = "nccl") -> str:
    """The message for a CUDA request that needs cupy (the ``cuda`` extra) where it is missing."""
    head = f"{what}: " if what else ""
    return (f"{head}the CUDA {path} path needs CuPy with NCCL: install the extra with `{EXTRA}` "
            f"(cupy-cuda12x; on CUDA 13 install cupy-cuda13x), or set {ENV}=staging (host "
            f"staging needs no CuPy)")


def requested_path(env: dict) -> str:
    """``PYCOLL_CUDA_PATH`` from an environment mapping, validated and lower-cased."""
    value = settings.get(ENV, env).lower()
    if value not in PATHS:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(PATHS)}")
    return value


@dataclass(frozen=True)
class RankFacts:
    """What one rank publishes at the first CUDA collective of a group."""

    host: str                 # rendezvous.host_identity: hostname + boot id
    gpu: str                  # the UUID of the GPU its tensors live on
    visible: tuple[str, ...]  # UUIDs of every GPU this process can see, in device-index order
    cupy: bool                # cupy importable
    nccl: bool                # cupy.cuda.nccl importable and available
    requested: str = "auto"   # this rank's PYCOLL_CUDA_PATH

    def to_json(self) -> dict:
        return {"host": self.host, "gpu": self.gpu, "visible": list(self.visible), "cupy": self.cupy,
                "nccl": self.nccl, "requested": self.requested}

    @classmethod
    def from_json(cls, d: dict) -> "RankFacts":
        return cls(d["host"], d["gpu"], tuple(d["visible"]), bool(d["cupy"]), bool(d["nccl"]),
                   d.get("requested", "auto"))


def _why_not_nccl(facts: list[RankFacts]) -> str | None:
    missing = [r for r, f in enumerate(facts) if not f.nccl]
    if missing:
        return f"rank(s) {_ranks(missing)} cannot import cupy.cuda.nccl"
    seen: dict[tuple[str, str], int] = {}
    for r, f in enumerate(facts):
        key = (f.host, f.gpu)
        if key in seen:
            return (f"ranks {seen[key]} and {r} share GPU {f.gpu} on one host "
                    f"(NCCL refuses two ranks of one communicator on the same GPU)")
        seen[key] = r
    return None


def _why_not_ipc(facts: list[RankFacts]) -> str | None:
    hosts = {f.host for f in facts}
    if len(hosts) > 1:
        return f"the ranks span {len(hosts)} hosts (CUDA IPC works within one host)"
    for r, f in enumerate(facts):
        for q, g in enumerate(facts):
            if g.gpu not in f.visible:
                return (f"rank {r} cannot see rank {q}'s GPU {g.gpu} "
                        f"(CUDA_VISIBLE_DEVICES hides it)")
    return None


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs[:8])) + (", ..." if len(rs) > 8 else "")


def choose_path(facts: list[RankFacts]) -> str:
    """The path every rank takes, from every rank's facts (rank order); raises CudaPathError.

    All ranks call this with the same list, so all of them choose the same path or all raise
    the same error.
    """
    if not facts:
        raise ValueError("choose_path: no ranks")
    requested = {f.requested for f in facts}
    if len(requested) > 1:
        by = ", ".join(f"rank {r}: {f.requested}" for r, f in enumerate(facts))
        raise CudaPathError(f"{ENV} differs between ranks ({by}); set the same value on every rank")
    want = requested.pop()
    if want not in PATHS:
        raise ValueError(f"{ENV}={want!r}: choose one of {', '.join(PATHS)}")
    if want == "staging":
        return "staging"
    if want == "nccl":
        why = _why_not_nccl(facts)
        if why is None:
            return "nccl"
        if any(not f.nccl for f in facts):
            raise CudaPathError(f"{ENV}=nccl: {why}. " + cuda_hint())
        raise CudaPathError(f"{ENV}=nccl: {why}; use {ENV}=ipc (one host) or staging")
    if want == "ipc":
        why = _why_not_ipc(facts)
        if why is None:
            return "ipc"
        raise CudaPathError(f"{ENV}=ipc: {why}; use {ENV}=staging")
    if _why_not_nccl(facts) is None:
        return "nccl"
    if _why_not_ipc(facts) is None:
        return "ipc"
    return "staging"


def explain(facts: list[RankFacts]) -> str:
    """One line for logs and ``pycoll doctor``: the path and why the better ones were not taken."""
    try:
        path = choose_path(facts)
    except CudaPathError as e:
        return f"error: {e}"
    why = []
    if path != "nccl" and facts[0].requested == "auto":
        why.append(f"not nccl: {_why_not_nccl(facts)}")
        if path != "ipc":
            why.append(f"not ipc: {_why_not_ipc(facts)}")
    return path + (f" ({'; '.join(why)})" if why else "")


def backend_devices(cuda_built: bool) -> list[str]:
    """The devices to register the backend for: "cuda" only on a torch built with CUDA.

    Decided from the build (``torch.version.cuda``), never by asking the driver: the backend is
    registered at ``import pycoll``, which must not create a CUDA context.
    """
    return ["cpu", "cuda"] if cuda_built else ["cpu"]
