"""``python -m pycoll bench``: the backend-comparison benchmark of the source checkout.

The benchmark itself lives in ``tools/bench.py`` next to the ``pycoll`` package (it is a
developer tool, not part of the installed package). This shim finds that checkout from
``pycoll``'s own location, so the command works from any directory, and says clearly what
to do when pycoll was installed without its checkout.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def load_tools_bench():
    """``tools.bench`` of the checkout this pycoll comes from; RuntimeError if there is none."""
    script = CHECKOUT / "tools" / "bench.py"
    if not script.is_file():
        raise RuntimeError(
            f"'pycoll bench' runs tools/bench.py from a source checkout of pycoll, but pycoll "
            f"is imported from {CHECKOUT / 'pycoll'} with no tools/ beside it. Clone the "
            f"repository and run it there: pip install -e . && python -m pycoll bench --help")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    module = importlib.import_module("tools.bench")
    found = Path(module.__file__).resolve()
    if found != script:  # another package named `tools` shadows ours
        raise RuntimeError(f"'pycoll bench' expected {script} but `import tools.bench` found "
                           f"{found}; run it from the checkout ({CHECKOUT})")
    return module


def main(argv: list[str] | None = None) -> int:
    try:
        bench = load_tools_bench()
    except RuntimeError as e:
        print(f"pycoll bench: {e}", file=sys.stderr)
        return 2
    return bench.main(list(sys.argv[1:] if argv is None else argv))
