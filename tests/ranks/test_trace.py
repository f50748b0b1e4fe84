"""PYCOLL_TRACE (rank files, Chrome trace merge, picture), PYCOLL_DEBUG logging, hang dumps."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.cli import trace_view
from pycoll.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(60)


class _Capture(logging.Handler):
    """Collects the "pycoll" logger's messages inside a rank."""

    def __init__(self) -> None:
        super().__init__(level=1)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def __enter__(self):
        logging.getLogger("pycoll").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("pycoll").removeHandler(self)


# -- trace of a DDP step -------------------------------------------------------------------------------

def _ddp_step(rank, world):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    pg = dist.distributed_c10d._get_default_group()
    assert pg.communicator.observers.after_op is not None and pg.communicator.executor.on_step is not None
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    import pycoll.observe.trace

    return pycoll.observe.trace.flush()  # on demand; destroy flushes the rest


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_ddp_step_trace_is_valid_chrome_json(tmp_path, mode):
    d = tmp_path / "trace"
    paths = run_ranks(_ddp_step, 2, backend="pycoll", timeout=40,
                      env={"PYCOLL_TRACE": str(d), "PYCOLL_TRANSPORT": mode})
    assert sorted(os.path.basename(p) for p in paths) == ["rank0.jsonl", "rank1.jsonl"]
    out = tmp_path / "trace.json"
    png = tmp_path / "timeline.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        png = None
    argv = [str(d), "-o", str(out)] + (["--png", str(png)] if png else [])
    assert trace_view.main(argv) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} <= {"X", "M"}
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys(), e
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    assert {e["pid"] for e in xs} == {0, 1}
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    tracks: dict = {}
    for e in xs:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e["ts"])
    assert all(ts == sorted(ts) for ts in tracks.values())
    ops = {e["args"]["op"] for e in xs if e["cat"] == "collective"}
    assert {"broadcast", "all_reduce"} <= ops, ops  # DDP's parameter broadcast, gradient buckets
    if mode == "tcp":
        steps = [e for e in xs if e["cat"] == "step" and e["args"]["sent"] + e["args"]["recv"] > 0]
        assert steps and all(e["args"]["peer"] == 1 - e["pid"] and e["args"]["bytes"] > 0 for e in steps)
    else:
        barriers = [e for e in xs if e["name"].startswith("barrier")]
        staged = [e for e in xs if e["name"] == "stage/reduce"]
        assert barriers and staged and all(e["args"]["bytes"] is not None for e in staged)
    # every step lies inside its collective, on one clock per rank
    for pid in (0, 1):
        coll = {(e["args"]["op"], e["args"]["seq"]): e for e in xs if e["pid"] == pid and e["cat"] == "collective"}
        for e in xs:
            if e["pid"] == pid and e["cat"] != "collective":
                c = coll[(e["args"]["op"], e["args"]["seq"])]
                assert c["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 1
    if png:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- tracing off, clock estimate, debug logging -------------------------------------------------------

def _hooks_off(rank, world):
    comm = dist.distributed_c10d._get_default_group().communicator
    dist.all_reduce(torch.ones(4))
    return [comm.observers.after_op, comm.executor.on_step, len(comm.arrivals)]


def test_tracing_off_installs_no_hook():
    for res in run_ranks(_hooks_off, 2, backend="pycoll", timeout=30, env={"PYCOLL_TRANSPORT": "tcp"}):
        assert res == [None, None, 1]


def _clock(rank, world):
    from pycoll.observe.clock import offset_of

    return offset_of(dist.distributed_c10d._get_default_group().communicator)   # measured at init


def test_clock_offset_estimate_within_its_bound(tmp_path):
    # One kernel: the true offset is 0, so the ping-pong estimate must lie within its bound.
    env = {"PYCOLL_TRACE": str(tmp_path), "PYCOLL_CLOCK_SYNC": "measure", "PYCOLL_TRANSPORT": "tcp"}
    (o0, e0, _), (o1, e1, method) = run_ranks(_clock, 2, backend="pycoll", timeout=30, env=env)
    assert (o0, e0) == (0.0, 0.0)
    assert "ping-pong" in method and 0 < e1 < 0.05 and abs(o1) <= e1, (o1, e1)


def _debug(rank, world):
    with _Capture() as cap:
        t = torch.ones(1 << 10)
        for _ in range(3):
            dist.all_reduce(t)
        dist.broadcast(t, 0)
    return cap.lines


def test_debug_info_logs_algorithm_once_and_trace_logs_steps():
    info = run_ranks(_debug, 2, backend="pycoll", timeout=30, env={"PYCOLL_DEBUG": "INFO", "PYCOLL_TRANSPORT": "tcp"})
    algo = [x for x in info[0] if "all_reduce uses algorithm" in x]
    assert len(algo) == 1 and algo[0].startswith("INFO"), info[0]
    assert any("broadcast uses algorithm binomial" in x for x in info[0]), info[0]
    assert not any(x.startswith("TRACE") for x in info[0])
    tr = run_ranks(_debug, 2, backend="pycoll", timeout=30, env={"PYCOLL_DEBUG": "TRACE", "PYCOLL_TRANSPORT": "shm"})
    steps = [x for x in tr[1] if x.startswith("TRACE") and "barrier wait" in x]
    ops = [x for x in tr[1] if x.startswith("TRACE") and x.endswith(" us") and "(shm)" in x]
    assert len(steps) >= 4 and len(ops) == 4, tr[1]


# -- hang dumps -----------------------------------------------------------------------------------------

def _sigusr1(rank, world):
    with _Capture() as cap:
        t = torch.ones(1 << 18)
        dist.all_reduce(t)
        if rank == 0:  # rank 0 waits in all_reduce seq 1 while rank 1 sleeps; dump meanwhile
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        else:
            time.sleep(0.8)
        dist.all_reduce(t)
    return cap.lines


@pytest.mark.parametrize("mode,text", [
    ("tcp", r"in all_reduce seq 1 \(tcp\).*step 1 of \d+ .*waiting for rank 1: received 0 of \d+ bytes"),
    ("shm", r"in all_reduce seq 1 \(shm\).*round 1 of 1.*waiting for rank 1 \(at sync \d+\)"),
])
def test_sigusr1_dumps_what_each_rank_waits_for(mode, text):
    import re

    lines = run_ranks(_sigusr1, 2, backend="pycoll", timeout=30, env={"PYCOLL_TRANSPORT": mode})[0]
    dumps = [x for x in lines if "SIGUSR1" in x]
    assert len(dumps) == 1 and dumps[0].startswith("WARNING"), lines
    assert re.search(text, dumps[0]), dumps[0]


def _late(rank, world):
    with _Capture() as cap:
        t = torch.ones(1 << 16)
        dist.all_reduce(t)
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=0.4)
        try:
            dist.distributed_c10d._get_default_group().allreduce([t], opts).wait()
        except Exception:  # noqa: BLE001
            pass
    return cap.lines


def test_timeout_logs_pending_state():
    # Rank 1 arrives 1.2 s late at seq 1; rank 0's 0.4 s deadline fires first.
    env = {"PYCOLL_TRANSPORT": "tcp", "PYCOLL_FAULT": "rank=1:seq=1:delay=1.2"}
    lines = run_ranks(_late, 2, backend="pycoll", timeout=30, env=env)[0]
    pending = [x for x in lines if "pending at failure (CommTimeoutError)" in x]
    assert len(pending) == 1 and pending[0].startswith("ERROR"), lines
    assert "in all_reduce seq 1 (tcp)" in pending[0] and "from rank 1" in pending[0], pending[0]
