"""Across "hosts": ranks in separate network namespaces joined by veth pairs and a bridge.

Each rank runs in a namespace of its own with its own address (10.231.0.x), its link shaped
both ways with ``tc``'s tbf (``pycoll.testing.netns.EmulatedHosts``; a rate limit also adds
queueing delay); rank 0 hosts the store, as torchrun's would. The dead-peer, mismatch and a
short soak run there. Needs root and ``ip netns``; skipped elsewhere. The namespaces are
deleted when the module's tests end, even when one fails.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.faults import TCP, _check_survivors, _error_info, _finish, _mismatch, _until_error
from pycoll.testing.fresh import explain, launch
from pycoll.testing.netns import EmulatedHosts, ours, unavailable
from tests.support.soak import _soak

pytestmark = pytest.mark.timeout(60)
WORLD = 3


@pytest.fixture(scope="module")
def made():
    why = unavailable()
    if why:
        pytest.skip(why)
    with EmulatedHosts(WORLD, rate="400mbit") as em:
        print(f"\n{em.describe()}")
        yield em
    left = ours()
    assert not any(n in left for n in em.names), left


@pytest.fixture
def hosts(made):
    return made.names


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


def _ops_until_error(rank, world, numel, ops, marker):
    """``ops`` all_reduces (the same count on every rank: a time limit would leave one rank
    in an op the others never join) or until an error; rank 0 drops ``marker`` after its
    fifth op (the cue)."""
    t = torch.empty(numel)
    n = 0
    try:
        for _ in range(ops):
            t.fill_(rank + 1)
            dist.all_reduce(t)
            n += 1
            if rank == 0 and n == 5:
                open(marker, "w").close()
    except Exception as exc:  # noqa: BLE001
        return _finish({**_error_info(exc), "n": n})
    return {"err": None, "n": n}


def _when(marker, action, log):
    deadline = time.time() + 40
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.01)
    log.append(time.time())
    action()


def test_a_link_pulled_mid_operation_fails_every_rank_naming_a_peer_within_the_timeout(made, tmp_path):
    # Host 2's cable is pulled while 4 MiB all_reduces run: no RST, no EOF, nothing arrives.
    # Every rank must fail within its timeout (4 s) with an error that names a peer, rank 2
    # named by the ranks that still reach each other; and leave nothing behind.
    marker, log = str(tmp_path / "cue"), []
    pull = threading.Thread(target=_when, args=(marker, lambda: made.link_down(2), log), daemon=True)
    pull.start()
    try:
        out = _run(_ops_until_error, made.names, 1 << 20, 100_000, marker, group_timeout=4.0, timeout=50)
    finally:
        pull.join(5)
        made.link_up(2)
    assert log, "rank 0 never gave the cue"
    # Ranks 0 and 1 time out together; whichever's ABORT lands first, the rank stuck on
    # rank 2 (rank 0 in a ring of 3) says so, and so does the other when it relays that.
    assert any("rank 2" in out[r]["value"]["msg"] for r in (0, 1)), explain(out)
    for r, o in enumerate(out):
        assert o["status"] == "ok", explain(out)
        info = o["value"]
        assert info["err"] is not None and info["n"] >= 5, (r, info)
        delay = info["t_err"] - log[0]
        assert delay < 4.0 + 3.0, f"rank {r} failed {delay:.1f} s after the link went down: {info}"
        assert re.search(r"rank [0-9]", info["msg"]), info
        assert info["msg"].count("Timed out waiting") <= 1, info   # a relayed timeout: said once
        # (rank 0 hosts the Store: its server holds the other ranks' connections)
        assert info["destroy_s"] < 5.0 and info["threads"] == [] and info["fds_left"] <= WORLD, info
        print(f"rank {r}: {info['err']} after {delay:.2f} s: {info['msg'][:160]}")
