"""Round buffers of a partial all-reduce: made once, lent out, filled, reused.

A buffer holds the template's elements followed by ``world * NF`` metadata values, so one
all-reduce carries a round's data and its bookkeeping. A deposit's buffer doubles as its
round's buffer (one deposit per round: no copy); ``lend`` gives the user a buffer to fill
in place, ``recycle`` takes a result's buffer back. Every method is called holding the
owner's lock (``owner.lock``), except ``new`` and ``combine``, which touch no shared state
but the tensors they are given.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# Results whose buffers recycle() takes back without looking at them (a result that is never
# recycled keeps its buffer alive until this many later results are made).
KEEP_FOR_RECYCLE = 2


class Slot(NamedTuple):
    """A round buffer and its views, made once per buffer: a view costs a microsecond or more,
    and every round needs three."""

    base: torch.Tensor     # the template's elements, then world * NF metadata
    data: torch.Tensor     # base[:n], flat
    result: torch.Tensor   # data shaped like the template
    meta: np.ndarray       # base[n:] in numpy (a few small writes a round, no dispatcher cost)
    ptr: int               # base.data_ptr()


class SlotPool:
    def __init__(self, n: int, shape: tuple, dtype: torch.dtype, meta: int) -> None:
        self.n, self.shape, self.dtype = n, shape, dtype
        self.size = n + meta
        self._flat = shape == (n,)
        self.free: list[Slot] = []          # buffers ready for reuse
        self.lent: dict[int, Slot] = {}     # data_ptr -> lent to the user, not yet deposited
        self.out: dict[int, Slot] = {}      # data_ptr -> the latest results, for recycle

    def new(self, base: torch.Tensor | None = None) -> Slot:
        base = torch.empty(self.size, dtype=self.dtype) if base is None else base
        data = base[:self.n]
        return Slot(base, data, data if self._flat else data.view(self.shape),
                    base.detach().numpy()[self.n:], base.data_ptr())

    def take(self) -> Slot:
        return self.free.pop() if self.free else self.new()

    def lend(self) -> torch.Tensor:
        slot = self.take()
        self.lent[slot.ptr] = slot
        return slot.data

    def for_deposit(self, tensor: torch.Tensor) -> tuple[Slot, bool]:
        """The buffer a deposit of ``tensor`` goes into, and whether it must be copied there
        (not when ``tensor`` is a lent buffer, filled in place)."""
        ptr = tensor.data_ptr()
        if ptr in self.lent and tensor.is_contiguous():
            return self.lent.pop(ptr), False
        return self.take(), True

    def keep_result(self, slot: Slot) -> None:
        self.out[slot.ptr] = slot
        if len(self.out) > KEEP_FOR_RECYCLE:
            del self.out[next(iter(self.out))]

    def recycle(self, tensor: torch.Tensor) -> bool:
        """Take a result's buffer back; False if ``tensor`` is not a result of this pool."""
        slot = self.out.pop(tensor.data_ptr(), None)
        if slot is not None and slot.result is tensor:
            self.free.append(slot)
            return True
        base = tensor._base
        if base is None or base.numel() != self.size or base.dtype != self.dtype:
            return False
        if all(s.ptr != base.data_ptr() for s in self.free):   # not twice
            self.free.append(self.new(base))
        return True

    def combine(self, slots: list[Slot]) -> Slot:
        """One buffer holding the sum of ``slots``' data (zero for none): a round that takes
        several deposits, or none (a flush). Hand ``slots`` back with ``give_back``."""
        out = self.new()
        data = out.data
        if slots:
            data.copy_(slots[0].data)
            for s in slots[1:]:
                data.add_(s.data)
        else:
            data.zero_()
        return out

    def give_back(self, slots: list[Slot]) -> None:
        self.free.extend(slots)
