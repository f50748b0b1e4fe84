"""Across "hosts": ranks in separate network namespaces joined by veth pairs and a bridge.

Each rank runs in a namespace of its own with its own address (10.231.0.x), its link shaped
both ways with ``tc``'s tbf (``pycoll.testing.netns.EmulatedHosts``; a rate limit also adds
queueing delay); rank 0 hosts the store, as torchrun's would. The dead-peer, mismatch and a
short soak run there. Needs root and ``ip netns``; skipped elsewhere. The namespaces are
deleted when the module's tests end, even when one fails.
"""

from __future__ import annotations

import time

import pytest

from tests.support.faults import TCP, _check_survivors, _mismatch, _until_error
from pycoll.testing.fresh import explain, launch
from pycoll.testing.netns import EmulatedHosts, ours, unavailable
from tests.support.soak import _soak

pytestmark = pytest.mark.timeout(60)
WORLD = 3


@pytest.fixture(scope="module")
def hosts():
    why = unavailable()
    if why:
        pytest.skip(why)
    with EmulatedHosts(WORLD, rate="400mbit") as made:
        print(f"\n{made.describe()}")
        yield made.names
    left = ours()
    assert not any(n in left for n in made.names), left


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
