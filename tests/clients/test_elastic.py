"""Restarts and re-inits on a store that outlives the processes: torchrun's elastic restarts
(one host, and two "nodes" on one host with c10d rendezvous, whose restart counts differ)
and a group destroyed and made again on one store (``rendezvous.generation_store``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


def _reinit_on_one_store(rank, world):
    store = rank_store()
    sums = []
    for i in range(3):
        dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=30))
        t = torch.full((4,), float(rank + i))
        dist.all_reduce(t)
        sums.append(t[0].item())
        dist.destroy_process_group()
    return sums


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reinit_on_one_store_reads_no_old_keys(transport):
    res = run_ranks(_reinit_on_one_store, 2, timeout=90, env={"PYCOLL_TRANSPORT": transport})
    assert res == [[1.0, 3.0, 5.0]] * 2


# The job of both tests. Rank 1 exits once (a marker file says it did). On one host torchrun
# restarts both workers and counts a restart. On two nodes, rank 1's agent restarts it and counts a
# restart; the other node's agent restarts its healthy worker because a node is waiting and
# counts none: the two workers of the next attempt have different TORCHELASTIC_RESTART_COUNT.
# With a slow exit the survivor lingers after its error, so its agent always sees the waiting
# node first (the case that hung every time when the generation was the restart count).
TRAIN_SCRIPT = textwrap.dedent('''
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import pycoll
    ck, marker, slow = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("pycoll", timeout=timedelta(seconds=30))
    rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    w, start = torch.zeros(4), 0
    if os.path.exists(ck):
        state = torch.load(ck)
        w, start = state["w"], state["step"]
    try:
        for step in range(start, 8):
            g = torch.ones(4) * (rank + 1)
            dist.all_reduce(g)
            w += g
            if rank == 0:
                torch.save({"w": w, "step": step + 1}, ck + ".tmp")
                os.replace(ck + ".tmp", ck)
            dist.barrier()
            if step == 3 and rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(3)
    except Exception:
        time.sleep(slow)
        raise
    print(f"done rank={rank} attempt={attempt} w={w[0].item()}", flush=True)
    dist.destroy_process_group()
''')


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYCOLL_", "MASTER_", "RANK", "WORLD"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _rendezvous_store():
    """A Store on a port the OS picks, for torchrun's c10d rendezvous: its agents find a
    server at the endpoint and join it as clients (no port chosen in advance)."""
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=120))


def test_torchrun_elastic_restart_resumes_on_the_first_restart(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    for run in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
             "--standalone", str(script), str(tmp_path / f"ck{run}"), str(tmp_path / f"marker{run}"), "0"],
            capture_output=True, text=True, timeout=120, env=_env())
        done = sorted(re.findall(r"done rank=(\d) attempt=(\d) w=([\d.]+)", proc.stdout))
        assert proc.returncode == 0 and done == [("0", "1", "24.0"), ("1", "1", "24.0")], \
            (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])




@pytest.mark.parametrize("slow_exit", [0.0, 3.0])
def test_two_node_restart_with_different_restart_counts_finishes(tmp_path, slow_exit):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    rdzv = _rendezvous_store()
    port = rdzv.port
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(n), "--max-restarts", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", str(script),
         str(tmp_path / "ck"), str(tmp_path / "marker"), str(slow_exit)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()) for n in range(2)]
    try:
        out = "".join(node.communicate(timeout=180)[0] for node in nodes)
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    done = sorted(re.findall(r"done rank=(\d) attempt=(\d) w=([\d.]+)", out))
    assert [node.returncode for node in nodes] == [0, 0] and [d[2] for d in done] == ["24.0", "24.0"], \
        out[-4000:]
    assert (tmp_path / "marker").exists()      # the restart happened
