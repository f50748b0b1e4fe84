"""Across "hosts": ranks in separate network namespaces joined by veth pairs and a bridge.

Each rank runs in a namespace of its own with its own address (10.231.0.x), traffic
shaped with ``tc`` (netem delay and loss where the kernel has it, else a tbf rate limit,
which also adds queueing delay); rank 0 hosts the store, as torchrun's would. The dead-peer,
mismatch and a short soak run there. Needs root and ``ip netns``; skipped elsewhere. The
namespaces are deleted in a finally (with their veths), even when a test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.support.faults import TCP, _check_survivors, _mismatch, _until_error
from pycoll.testing.fresh import explain, launch
from tests.support.soak import _soak

pytestmark = pytest.mark.timeout(60)
WORLD = 3


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _available() -> str | None:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return "needs root, ip and tc"
    probe = f"pcprobe{os.getpid() % 100000}"
    if _ip("netns", "add", probe, check=False).returncode:
        return "ip netns add is not permitted here"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def hosts():
    why = _available()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 10000}"
    sw, names = f"pc{tag}sw", [f"pc{tag}r{i}" for i in range(WORLD)]
    shaping = []
    try:
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            _ip("link", "add", f"pc{tag}s{i}", "netns", sw, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", f"pc{tag}s{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"10.231.0.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"]
            if subprocess.run(tc + ["netem", "delay", "2ms", "1ms", "loss", "0.5%"],
                              capture_output=True, timeout=10).returncode == 0:
                shaping.append("netem delay 2ms±1ms loss 0.5%")
            else:
                subprocess.run(tc + ["tbf", "rate", "400mbit", "burst", "256kb", "latency", "20ms"],
                               capture_output=True, timeout=10, check=True)
                shaping.append("tbf 400mbit (no netem in this kernel)")
        print(f"\nnamespaces {names} on bridge in {sw}: {shaping[0]}")
        yield names
    finally:
        for ns in names + [sw]:
            _ip("netns", "del", ns, check=False)
        left = _ip("netns", "list", check=False).stdout
        assert f"pc{tag}" not in left, left


def _env(extra=None):
    env = {**TCP, **(extra or {})}
    for i in range(WORLD):
        env[f"rank{i}"] = {"PYCOLL_SOCKET_ADDR": f"10.231.0.{i + 1}"}
    return env


def _run(fn, hosts, *args, env=None, **kw):
    return launch(fn, WORLD, *args, env=_env(env), netns=hosts, store_host="10.231.0.1", **kw)


def test_netns_dead_peer(hosts):
    env = {"PYCOLL_ALGO": "all_reduce=ring", "PYCOLL_FAULT": "rank=1:op=all_reduce:seq=3:kill_at_step=2"}
    out = _run(_until_error, hosts, 1 << 18, 20.0, env=env, timeout=40)
    # rank 0's store server holds the other ranks' store connections: not pycoll's fds
    rows = _check_survivors(out, 1, out[1]["died_at"], fd_slack=WORLD)
    print(*rows, sep="\n  ")


def test_netns_mismatch(hosts):
    out = _run(_mismatch, hosts, "size", timeout=40)
    for r, o in enumerate(out):
        assert o["status"] == "ok" and o["value"]["err"] == "MismatchError", explain(out)
        assert "numel=10" in o["value"]["msg"] and "numel=11" in o["value"]["msg"], o["value"]


def test_netns_short_soak(hosts):
    t0 = time.time()
    out = _run(_soak, hosts, 200, 2, timeout=50)
    assert all(o["status"] == "ok" for o in out), explain(out)
    print(f"200 random ops across namespaces in {time.time() - t0:.1f} s")
