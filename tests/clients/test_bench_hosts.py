"""``python -m pycoll bench --hosts HxR --link RATE``: the bench over emulated hosts (issue 45).

The pure parts (layouts, link bounds) in process; then real runs as subprocesses: a tiny sweep
over 2 hosts x 2 ranks with shaped links, a run interrupted with SIGINT and one killed with
SIGKILL, each of which must leave no namespace behind (the killed one's are removed by the
next run), and the refusal without root. The runs need root and ``ip netns``; they skip
cleanly elsewhere. Nothing asserts on times.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pycoll.cli.bench import hosts
from pycoll.testing import netns

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
# A bench on torch 2.15 took over 60 s to build its hosts once in CI (its first import of
# torch's 5 GB of CUDA libraries, read cold): the waits allow for it.
START = 150
needs_netns = pytest.mark.skipif(bool(netns.unavailable()), reason=str(netns.unavailable()))


def test_layouts_parse_and_bad_ones_are_refused():
    assert hosts.parse_hosts("4x1") == (4, 1) and hosts.parse_hosts(" 2X2 ") == (2, 2)
    for bad in ("4", "0x1", "2x0", "x2", "2x2x2"):
        with pytest.raises(ValueError, match="host layout"):
            hosts.parse_hosts(bad)
    assert netns.rate_bytes_per_s("1gbit") == 125e6
    assert netns.rate_bytes_per_s("100mbit") == 12.5e6
    with pytest.raises(ValueError, match="link rate"):
        netns.rate_bytes_per_s("fast")


def test_link_bounds_are_what_a_hosts_link_must_carry():
    mib16, gbit = 16 << 20, 125e6
    # the figures: 4x1 at 1 Gbit/s, 16 MiB all_reduce: 2(n-1)/n * S / B = 201 ms
    assert hosts.bound_us("all_reduce", mib16, 4, 1, gbit) == pytest.approx(201_327, rel=1e-3)
    # 2x2: only the two hosts count, 134 ms
    assert hosts.bound_us("all_reduce", mib16, 2, 2, gbit) == pytest.approx(134_218, rel=1e-3)
    assert hosts.bound_fraction("all_gather", 4, 2) == 0.75
    assert hosts.bound_fraction("broadcast", 3, 1) == 1.0
    assert hosts.bound_fraction("sendrecv", 2, 2) is None      # ranks 0 and 1 share a host
    assert hosts.bound_fraction("all_reduce", 1, 4) is None    # one host: no link
    assert hosts.bound_fraction("barrier", 4, 1) is None


def test_placement_puts_consecutive_ranks_on_a_host():
    cfg = hosts.placement(["a", "b"], ["10.1.0.1", "10.1.0.2"], 2)
    assert cfg["netns"] == ["a", "a", "b", "b"]
    assert [e["PYCOLL_HOST_ID"] for e in cfg["env"]] == ["emulated-host-0"] * 2 + ["emulated-host-1"] * 2
    assert {e["PYCOLL_SOCKET_ADDR"] for e in cfg["env"][2:]} == {"10.1.0.2"}


def _bench(*args, log=None):
    """The bench as a subprocess; its output to ``log`` (a file: no pipe that could fill
    while nobody reads it), else to a pipe."""
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "pycoll", "bench", "--ref-seconds", "0",
                             "--no-progress", *args], cwd=REPO, text=True,
                            stdout=out, stderr=subprocess.STDOUT)


def _hosts_of(p, log) -> list[str]:
    """Wait until the bench ``p`` has built its hosts (the switch comes first, the hosts after
    it); their names."""
    deadline = time.monotonic() + START
    while len(_made_by(p.pid)) < 3 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    made = _made_by(p.pid)
    assert made, f"the bench built no hosts in {START} s (exit {p.poll()}): {open(log).read()[-3000:]}"
    return made


def _made_by(pid: int) -> list[str]:
    """The hosts and switch bench ``pid`` made (not its short-lived probe: ``unavailable()``)."""
    return [n for n in netns.ours() if n.startswith(f"{netns.PREFIX}{pid}") and not n.endswith("probe")]


def _ranks_of(p) -> list[str]:
    """The bench's children: its ranks and multiprocessing's resource tracker. The bench is
    stopped (SIGSTOP) first, so that none is started after the list is taken."""
    p.send_signal(signal.SIGSTOP)
    return subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()


def _semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}


def _stop(p) -> None:
    """Whatever happened in the test: the bench's ranks are killed, then the bench is told
    to stop (SIGTERM: it removes its hosts on the way out)."""
    if p.poll() is None:
        for c in _ranks_of(p):
            try:
                os.kill(int(c), signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.send_signal(signal.SIGCONT)
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


@needs_netns
def test_a_sweep_over_two_hosts_of_two_ranks_prints_the_bound_and_leaves_nothing(tmp_path):
    p = _bench("--hosts", "2x2", "--link", "1gbit", "-c", "all_reduce,all_gather,sendrecv",
               "-b", "8", "-e", "256K", "-f", "32", "--iters", "3", "--warmup", "1",
               "--json", str(tmp_path / "run.json"))
    try:
        out, _ = p.communicate(timeout=START + 60)
    finally:
        _stop(p)
    assert p.returncode == 0, out
    assert "# emulated hosts 2x2" in out and "shaped to 1gbit (125.0 MB/s)" in out, out
    assert "bound(us)" in out and "#wrong total: 0 OK" in out, out
    # 256 KiB all_reduce across 2 hosts: the link carries S each way, 2.1 ms at 125 MB/s
    row = next(line.split() for line in out.splitlines()
               if line.split()[:1] == ["262144"] and "2097.2" in line)
    assert row[2] == "2097.2", row
    assert not _made_by(p.pid), netns.ours()
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["meta"]["hosts"] == [2, 2] and doc["meta"]["link_Bps"] == 125e6
    assert doc["collectives"]["all_reduce"]["rows"][-1]["link_bound_us"] == pytest.approx(2097.152)
    if importlib.util.find_spec("matplotlib") is not None:   # the 'plot' extra
        from tools import plot_hosts
        assert plot_hosts.main([str(tmp_path / "run.json"), "-o", str(tmp_path / "h.png")]) == 0
        assert (tmp_path / "h.png").stat().st_size > 0


@needs_netns
def test_an_interrupted_bench_removes_its_hosts_and_its_ranks(tmp_path):
    log = tmp_path / "bench.log"
    p = _bench("--hosts", "2x1", "--link", "100mbit", "-c", "all_reduce", "-b", "16M", "-e", "16M",
               "--iters", "50", log=log)
    try:
        _hosts_of(p, log)
        time.sleep(3)                  # the ranks are up and moving 16 MiB at 12.5 MB/s
        children = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        _stop(p)
    out = log.read_text()
    assert not _made_by(p.pid), (netns.ours(), out)
    time.sleep(1)
    alive = [c for c in children if os.path.exists(f"/proc/{c}")
             and "zombie" not in open(f"/proc/{c}/status").read()]
    assert not alive, (alive, out)


@needs_netns
def test_the_namespaces_of_a_killed_bench_are_removed_by_the_next_one(tmp_path):
    log = tmp_path / "bench.log"
    sems = _semaphores()
    p = _bench("--hosts", "2x1", "-c", "barrier", "--iters", "1000", log=log)
    try:
        _hosts_of(p, log)
    except BaseException:
        _stop(p)
        raise
    children = _ranks_of(p)
    p.kill()
    for c in children:                 # the orphaned ranks: this test's to reap
        try:
            os.kill(int(c), signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)
    # A SIGKILL leaves the named semaphores of the bench's queues (its resource tracker, which
    # would unlink them, went with it): this test made them, this test removes them.
    for name in _semaphores() - sems:
        os.unlink(f"/dev/shm/{name}")
    assert _made_by(p.pid)             # SIGKILL: nothing could run
    with netns.EmulatedHosts(1):
        pass
    assert not _made_by(p.pid), netns.ours()


def test_without_root_the_bench_says_so_and_makes_nothing(monkeypatch, capsys):
    # Run as another user, the interpreter here cannot read its own torch (under /root): so
    # the user id is what changes, in process, and the refusal comes before any rank starts.
    from pycoll.cli.bench import launch

    before = netns.ours()
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    assert launch.main(["--hosts", "2x1", "-c", "barrier", "--ref-seconds", "0"]) == 2
    assert "--hosts: emulated hosts need root" in capsys.readouterr().err
    assert netns.ours() == before
    with pytest.raises(SystemExit):
        launch.main(["--link", "1gbit", "-c", "barrier"])          # --link without --hosts
    with pytest.raises(SystemExit):
        launch.main(["--hosts", "2x2", "--world-size", "3"])       # 2x2 places 4 ranks
