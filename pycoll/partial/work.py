"""What a partial all-reduce hands back: a round's result, and the handle of one deposit.

``RoundResult`` is a round's SUM with how many deposits it holds and its ``RoundInfo``;
``PartialWork`` resolves to the result of the round paired with its deposit (it asks its
owner, ``pycoll.partial.PartialAllReduce``, to run or wait for rounds until then).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from pycoll.partial.rounds import RoundInfo


class Rounds(Protocol):
    """What a handle needs of its owner (``PartialAllReduce``)."""

    rounds_done: int

    def claim(self, k: int, timeout: float | None = None) -> "RoundResult": ...


class RoundResult(NamedTuple):
    tensor: torch.Tensor   # SUM of the deposits in the round, shaped like the template
    count: int             # how many deposits (over all ranks) it holds
    info: RoundInfo

    def mean(self) -> torch.Tensor:
        """``tensor / count``; zeros for a round with no deposit (only after a flush)."""
        return self.tensor / self.count if self.count else torch.zeros_like(self.tensor)


class PartialWork:
    """The handle of one deposit: resolves to the result of the round paired with it."""

    def __init__(self, owner: Rounds, round_: int) -> None:
        self._owner, self.round = owner, round_
        self._result: RoundResult | None = None

    def is_completed(self) -> bool:
        return self._result is not None or self._owner.rounds_done > self.round

    def result(self, timeout: float | None = None) -> RoundResult:
        if self._result is None:
            self._result = self._owner.claim(self.round, timeout)
        return self._result

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until round ``self.round`` is done; its SUM (``count`` deposits in it)."""
        return self.result(timeout).tensor

    @property
    def count(self) -> int:
        return self.result().count

    @property
    def info(self) -> RoundInfo:
        return self.result().info
