"""Command line: ``python -m pycoll {demo,bench,draw,trace,doctor,cuda-bench}``."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("pycoll.cli.demo", "pycoll vs gloo: every collective checked and timed, then DDP trains a model on each"),
    "bench": ("pycoll.cli.bench", "pycoll vs gloo (vs MPI) benchmark, nccl-tests style"),
    "draw": ("pycoll.cli.draw", "draw an algorithm's schedule step by step (picture or --text)"),
    "trace": ("pycoll.cli.trace_view", "merge PYCOLL_TRACE=DIR rank files into a Chrome trace (+ --png timeline)"),
    "doctor": ("pycoll.cli.doctor", "what this machine offers and which paths pycoll will use"),
    "cuda-bench": ("pycoll.cli.cuda_bench", "CUDA tensors: pycoll's paths (nccl, ipc, staging) vs nccl"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m pycoll COMMAND [options]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
