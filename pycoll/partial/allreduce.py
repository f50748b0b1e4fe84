"""The partial all-reduce: its user-facing surface (deposits, results, flush, close).

``PartialAllReduce`` checks each call before anything is sent and hands it to its
``serving.RoundServer``, which holds the deposits and results and runs the rounds; what is
in a round is ``rounds``; the round buffers, ``slots``; the activation messages, ``activation``.
"""


from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll.partial.rounds import Ledger, RoundInfo
from pycoll.partial.serving import RoundServer
from pycoll.partial.work import PartialWork, RoundResult

# Metadata shares the data's buffer: dtypes that hold small integers exactly (< 2**24).
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
DEFAULT_TIMEOUT = 1800.0


class PartialAllReduce:
    """A persistent partial SUM all-reduce of tensors shaped like ``like`` over ``group``.

    Collective: every rank of ``group`` constructs it (it creates a process group), calls
    ``submit`` once per step, and calls ``flush``/``close`` together at the end.
    ``max_staleness`` = K bounds every contribution's age to K rounds (0: synchronous).
    """

    def __init__(self, like: torch.Tensor, group=None, mode: str = "solo", max_staleness: int = 4,
                 seed: int = 0, timeout: float | timedelta | None = None, history: int = 4096,
                 activation_delay: float = 0.01) -> None:
        if not isinstance(like, torch.Tensor) or like.dtype not in DTYPES or like.device.type != "cpu":
            raise TypeError(f"PartialAllReduce: the template must be a CPU tensor of one of "
                            f"{[str(d) for d in DTYPES]}, got {getattr(like, 'dtype', type(like))}")
        if not activation_delay >= 0:
            raise ValueError(f"PartialAllReduce: activation_delay must be >= 0 s, got {activation_delay!r}")
        self.activation_delay = float(activation_delay)
        group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ledger = Ledger(self.world, mode, max_staleness, seed)
        self.mode, self.max_staleness, self.seed = mode, max_staleness, seed
        self.shape, self.dtype, self._n = tuple(like.shape), like.dtype, like.numel()
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        self.timeout = float(timeout or DEFAULT_TIMEOUT)
        ranks = dist.get_process_group_ranks(group)
        pg = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout),
                            use_local_synchronization=group is not dist.group.WORLD)
        self._server = RoundServer(pg, ranks, self.rank, ledger, self._n, self.shape, self.dtype,
                                   self.timeout, self.activation_delay, history)

    def submit(self, tensor: torch.Tensor) -> PartialWork:
        """Deposit ``tensor`` (copied); the handle resolves to the round paired with it."""
        return PartialWork(self._server, self._server.deposit(self._checked(tensor)))

    def buffer(self) -> torch.Tensor:
        """A flat tensor of the template's size to fill and pass to ``submit``/``all_reduce``,
        which then deposit it without copying (it belongs to this object again from then)."""
        return self._server.buffer()

    def recycle(self, result: RoundResult) -> None:
        """Hand a result's buffer back for reuse once done with it (optional: saves an
        allocation per round; ``result.tensor`` must not be used afterwards)."""
        self._server.recycle(result)

    def all_reduce(self, tensor: torch.Tensor, timeout: float | None = None) -> RoundResult:
        """``submit(tensor).result(timeout)`` in one call: this thread drives the round from
        the start, so the progress thread is never woken to start it (the cheap path when
        nothing runs between submit and wait, as in DDP)."""
        return self._server.all_reduce(self._checked(tensor), timeout)

    def flush(self, timeout: float | None = None) -> list[RoundResult]:
        """Collective: run rounds until every rank's deposits are all in; return the results
        of the rounds this rank did not pair with a submit (possibly none), in order."""
        return self._server.flush(timeout)

    def close(self, flush: bool = True) -> None:
        """Collective: flush (unless ``flush=False``), stop the progress thread, release the
        group. Raises the progress thread's error, if it had one, after releasing."""
        self._server.close(flush)

    def claim(self, k: int, timeout: float | None = None) -> RoundResult:
        """The result of round ``k``, running or waiting for rounds until it is done (once)."""
        return self._server.claim(k, timeout)

    def __enter__(self) -> "PartialAllReduce":
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    @property
    def history(self):
        """The last rounds' ``RoundInfo``, oldest first (at most ``history`` of them)."""
        return self._server.history

    @property
    def last_round(self) -> RoundInfo | None:
        h = self._server.history
        return h[-1] if h else None

    @property
    def rounds_done(self) -> int:
        """How many rounds have completed on this rank."""
        return self._server.rounds_done

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() != self._n or tensor.dtype != self.dtype:
            raise ValueError(f"PartialAllReduce.submit: expected {self.dtype}[{self._n}], got "
                             f"{tensor.dtype}[{tensor.numel()}]")
        return tensor
