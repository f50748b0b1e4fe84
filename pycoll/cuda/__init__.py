"""CUDA tensors for pycoll: NCCL through CuPy, CUDA IPC between processes, host staging.

    PYCOLL_CUDA_PATH=auto|nccl|ipc|staging   (docs/cuda.md)

Modules: ``paths`` (which path, a pure function), ``dtypes`` (torch -> NCCL table), ``facts``
(GPU facts), ``channel`` (a group's CUDA calls: the plans of ``pycoll.c10d.plans`` on the
stream), ``nccl``, ``ipc``, ``staging`` (the three paths), ``work`` (Work handles), ``bench``
(the GPU benchmark). Importing this package imports neither cupy nor anything that touches the
CUDA driver.
"""

from pycoll.cuda.paths import CudaPathError, backend_devices, choose_path, cuda_hint

__all__ = ["CudaPathError", "backend_devices", "choose_path", "cuda_hint", "channel_for"]


def channel_for(pg):
    """The CUDA channel of process group ``pg`` (its first CUDA call makes it)."""
    from pycoll.cuda.channel import CudaChannel

    return CudaChannel(pg)
