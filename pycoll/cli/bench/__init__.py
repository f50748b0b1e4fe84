"""``python -m pycoll bench``: the backend-comparison benchmark, in the shape of nccl-tests.

It ships with the package, so it runs wherever pycoll is installed (a wheel as well as a
checkout). The modules, top to bottom:

- ``launch``: the command line and the launcher (reference figures, rank processes, merge);
  ``main(argv) -> exit code`` is the entry point.
- ``worker`` / ``mpi``: one rank of the torch.distributed side / of the MPI column.
- ``harness``: the backend-neutral per-rank sweep (interleaving, timing, checking).
- ``collectives``: the table, one small entry per collective; ``backends``: the verbs it calls.
- ``report``: merge the ranks, print tables, JSON, plot; ``ref``: loopback TCP / memcpy figures.

See docs/bench.md.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: ``sys.argv[1:]``); 0, or 1 when any result
    was wrong, or 2 when the ranks failed."""
    # Imported here, not at the top: the rank processes import this package too and need
    # none of the launcher.
    from pycoll.cli.bench.launch import main as launch_main
    return launch_main(argv)
