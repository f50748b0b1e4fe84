"""The benchmark's reference figures (loopback TCP, memcpy), for tools/model_check.py.

They live in the package (``pycoll.cli.bench.ref``); this name stays for the experiment
scripts in tools/ that import ``tools.bench_ref``.
"""

from __future__ import annotations

from pycoll.cli.bench.ref import (
    all_reduce_bound,
    measure,
    memcpy,
    memcpy_per_rank,
    tcp_loopback,
)

__all__ = ["all_reduce_bound", "measure", "memcpy", "memcpy_per_rank", "tcp_loopback"]
