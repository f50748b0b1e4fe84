"""torch's per-device backend lookups, answered by a pycoll group itself (docs/c10d.md).

torch finds a group's backend per device (``pg._get_backend(device)``) and asks it what it
supports: DCP's async save wants a CPU backend, the full-state-dict broadcast into FSDP2
takes ``pg._device_types[0]``, ``split_group`` and ``shrink_group`` ask ``supports_splitting``
and ``supports_shrinking``, and FSDP2 asks ``supports_tensor_alloc`` before it allocates its
communication buffers with ``allocate_tensor`` (registered memory: ``c10d.shared``). A
C++ ``Backend`` cannot be made from Python on torch 2.13 ("No constructor defined"; on 2.14
it can, but cannot change its rank and size after a reconfigure), and torch uses a
ProcessGroup subclass as the group itself, so a pycoll group is its own backend for every
device it serves. ``DeviceLookups`` is a base class of ``backend.ProcessGroupPycoll``; it
uses the group's ``_rank``, ``_size``, ``_timeout``, ``_store`` and ``_comm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll.shm import shared
from pycoll.cuda.paths import backend_devices


@dataclass
class Options:
    """What c10d copies from a parent group's backend into a split (``backend.options``)."""

    _timeout: timedelta


class DeviceLookups:
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in backend_devices(torch.version.cuda is not None)]

    def _get_backend(self, device):
        kind = torch.device(device).type
        if kind not in backend_devices(torch.version.cuda is not None):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    get_backend = _get_backend   # torch 2.15's public name (``get_backend_impl``)

    # A property torch's C++ trampoline looks up on a Python group finds the inherited one
    # and calls it again without end (RecursionError on torch 2.15): answered here.
    supports_window = False      # no symmetric-memory windows, as gloo

    supports_splitting = True
    supports_coalescing = False

    @property
    def supports_shrinking(self) -> bool:
        return hasattr(self, "shrink")

    @property
    def options(self) -> Options:
        return Options(self._timeout)

    def supports_tensor_alloc(self, device) -> bool:
        """Whether ``allocate_tensor`` gives registered memory for ``device`` (FSDP2 asks this
        under ``set_allocate_memory_from_process_group_for_comm(True)``)."""
        return torch.device(device).type == "cpu" and shared.can_share_memory(self)

    def allocate_tensor(self, size: int, *, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat tensor of ``size`` elements in the group's shared heap: a collective, as
        ``pycoll.empty_shared`` (FSDP2 allocates its all_gather output and reduce_scatter
        input with it on every rank in the same order)."""
        if not self.supports_tensor_alloc(device):
            raise RuntimeError(f"pycoll: allocate_tensor on {device} needs a one-host group on shared memory")
        return shared.empty_shared((int(size),), dtype, group=self)

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        """c10d asks gloo and nccl to agree on a first sequence number; ours start at 0."""

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """The timeout of every later op (``dist.distributed_c10d._set_pg_timeout``)."""
        self._timeout = timeout
        self._comm.timeout = timeout.total_seconds()

    def set_timeout(self, timeout: timedelta) -> None:
        """torch 2.15's ``dist.set_timeout(timeout, group)``."""
        self._set_default_timeout(timeout)

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this rank has issued on the group (gloo's answer too)."""
        return getattr(self._comm, "_seq", 0)

    def _enable_collectives_timing(self) -> None:
        """gloo times its ops for the Flight Recorder's durations; the recorder's hooks that
        see pycoll's ops keep no durations, so there is nothing to switch on."""

    def eager_connect_single_device(self, device=None) -> None:
        """Connections are made at construction: nothing is left to connect."""

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """A new group of the parent-group ranks ``ranks`` (c10d's ``ProcessGroup.split_group``).

        Called by every rank of this group with the split it belongs to; ranks outside
        ``ranks`` get None. The members meet through this group's store, under the split's
        name (c10d gives each split a unique one).
        """
        ranks = sorted(int(r) for r in ranks)
        if self._rank not in ranks:
            return None
        if timeout is None:
            timeout = opts._timeout if isinstance(opts, Options) else self._timeout
        name = group_name or f"split-{'-'.join(map(str, ranks))}"
        store = dist.PrefixStore(f"pycoll/split/{name}/", self._store)
        pg = type(self)(store, ranks.index(self._rank), len(ranks), timeout)
        pg._set_group_name(name)
        pg._set_group_desc(group_desc or f"{self.getGroupDesc()}:split")
        return pg
