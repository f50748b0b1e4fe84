"""One rank of the MPI column (mpi4py buffer methods), started by the launcher under mpirun.

The same collective table and sweep loop as the torch ranks, on numpy views of the same kind of
tensors, so the figures merge into the same tables. MPI cannot join the torch processes, so its
sweep runs after theirs rather than interleaved with them (the launcher says so).

    mpirun -n N python -m pycoll.cli.bench.mpi --config C --out-dir D
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from pycoll.cli.bench.backends import MpiApi
from pycoll.cli.bench.harness import Progress, run_sweep, sweep_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()

    def agree(flags: list) -> list:
        mine = np.array([int(bool(f)) for f in flags], dtype=np.int32)
        out = np.empty_like(mine)
        comm.Allreduce(mine, out, op=MPI.MIN)
        return [bool(v) for v in out]

    progress = Progress(len(sweep_plan(cfg, world)), "mpi",
                        enabled=cfg["progress"] and rank == 0)
    records = run_sweep(cfg, rank, world, {"mpi": MpiApi(comm, cfg["op"])}, agree, progress)
    version = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()  # C string
    info = {"mpi": f"{version}; mpi4py {__import__('mpi4py').__version__}"}
    with open(os.path.join(a.out_dir, f"mpi{rank}.json"), "w") as f:
        json.dump({"rank": rank, "notes": {}, "info": info, "backends": ["mpi"],
                   "records": records}, f)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
