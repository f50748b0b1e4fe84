"""``python tools/bench.py ...``: the same benchmark as ``python -m pycoll bench ...``.

The benchmark ships in the package (``pycoll.cli.bench``, docs/bench.md); this script stays so
the commands recorded in docs/performance.md and docs/algorithms.md, and tools/model_check.py,
run unchanged from a checkout, with or without pycoll installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import pycoll from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycoll.cli.bench.launch import build_parser, main, parse_size, size_sweep  # noqa: E402

__all__ = ["build_parser", "main", "parse_size", "size_sweep"]

if __name__ == "__main__":
    sys.exit(main())
