"""CUDA tensors for pycoll: NCCL through CuPy, CUDA IPC between processes, host staging.

    PYCOLL_CUDA_PATH=auto|nccl|ipc|staging   (docs/cuda.md)

Modules: ``paths`` (which path, a pure function), ``dtypes`` (torch -> NCCL table), ``checks``
(argument checks, GPU facts), ``frontend`` (the c10d methods on CUDA tensors), ``nccl``, ``ipc``,
``staging`` (the three paths), ``work`` (Work handles), ``dispatch`` (routing from
ProcessGroupPycoll), ``bench`` (the GPU benchmark). Importing this package imports neither cupy
nor anything that touches the CUDA driver.
"""

from pycoll.cuda.paths import CudaPathError, backend_devices, choose_path, cuda_hint

__all__ = ["CudaPathError", "backend_devices", "choose_path", "cuda_hint"]
