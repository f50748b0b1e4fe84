"""Developer tools for pycoll (benchmarks); not part of the installed package.

Importable as ``tools.*`` from the repository root, e.g. ``tools.bench_ddp.main(argv)``.
"""
