"""Rank functions and checks of the fault tests, shared with the network-namespace tests.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pycoll.testing.fresh import BASE, explain, fd_count, pycoll_threads

TCP = {"PYCOLL_TRANSPORT": "tcp"}


def _finish(info: dict, destroy: bool = True) -> dict:
    """After an error: destroy the group, then measure what it left behind."""
    t0 = time.time()
    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    info["destroy_s"] = time.time() - t0
    if BASE:
        info["fds_left"] = fd_count() - BASE["fds"]
    info["threads"] = pycoll_threads()
    return info


def _error_info(exc: BaseException) -> dict:
    return {"err": type(exc).__name__, "msg": str(exc), "t_err": time.time()}


def _until_error(rank, world, numel, seconds):
    """all_reduce in a loop until it fails; report the failure and the cleanup."""
    t = torch.empty(numel)
    end, n = time.time() + seconds, 0
    try:
        while time.time() < end:
            t.fill_(rank + 1)
            dist.all_reduce(t)
            assert t[0].item() == world * (world + 1) / 2 and t[-1].item() == t[0].item()
            n += 1
    except Exception as exc:  # noqa: BLE001
        return _finish({**_error_info(exc), "n": n})
    return {"err": None, "n": n}


def _check_survivors(out, victim, t_dead, limit=2.0, fd_slack=0):
    rows = []
    for r, o in enumerate(out):
        if r == victim:
            assert o["status"] == "dead" and o["exitcode"] == -9, explain(out)
            continue
        assert o["status"] == "ok", explain(out)
        info = o["value"]
        assert info["err"] is not None, f"rank {r} never saw rank {victim} die: {info}"
        assert info["err"] == "PeerClosedError", info
        assert f"rank {victim}" in info["msg"] and ("died" in info["msg"] or "closed" in info["msg"]), info
        delay = info["t_err"] - t_dead
        assert delay < limit, f"rank {r} raised {delay:.2f} s after rank {victim} died: {info['msg']}"
        assert info["destroy_s"] < 2.0 and info["fds_left"] <= fd_slack and info["threads"] == [], info
        rows.append((r, round(max(delay, 0.0), 3), info["msg"]))
    return rows


def _mismatch(rank, world, case):
    odd = rank == world - 1
    t = torch.ones(10)
    try:
        if case == "op":
            dist.broadcast(t, 0) if odd else dist.all_reduce(t)
        elif case == "size":
            dist.all_reduce(torch.ones(11) if odd else t)
        elif case == "dtype":
            dist.all_reduce(torch.ones(10, dtype=torch.int64) if odd else t)
        elif case == "redop":
            dist.all_reduce(t, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
        elif case == "root":
            dist.broadcast(t, 1 if odd else 0)
            dist.barrier()
        dist.barrier()
    except Exception as exc:  # noqa: BLE001
        return _finish(_error_info(exc), destroy=False)
    return {"err": None}
