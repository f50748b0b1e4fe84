"""pycoll's own DistributedDataParallel: gradient buckets, overlap, no_sync, comm hooks, join.

``from ddp import DistributedDataParallel`` is a drop-in for torch's class of that name
(torch's arguments in torch's order, less the multi-device and mixed-precision ones;
``no_sync``, ``register_comm_hook``, ``join``) and works on any
torch.distributed process group, using only torch.distributed's public API.
"""

from . import hooks
from .buckets import GradBucket, assign_buckets
from .distributed import DistributedDataParallel, default_bucket_cap_mb
from .timeline import BucketTimes, Timeline

__all__ = ["DistributedDataParallel", "default_bucket_cap_mb", "GradBucket", "assign_buckets", "hooks", "Timeline",
           "BucketTimes"]
