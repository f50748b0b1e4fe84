"""Tuner rule table, PYCOLL_ALGO parsing, transport choice, and per-group overrides."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycoll
from pycoll.core.setup import choose_mode
from pycoll.core.tuner import RULES, Tuner, parse_overrides
from tests.harness import run_ranks


def test_parse_overrides():
    assert parse_overrides("all_reduce=ring, broadcast=binomial") == {"all_reduce": "ring", "broadcast": "binomial"}
    ring = parse_overrides("ring")
    assert ring["all_reduce"] == ring["all_gather"] == ring["reduce_scatter"] == "ring"
    with pytest.raises(ValueError, match="valid"):
        parse_overrides("all_reduce=nope")
    with pytest.raises(ValueError, match="no collective"):
        parse_overrides("nope")


def test_rules_pick_latency_then_bandwidth_algorithms():
    t = Tuner(4)
    assert t.choose("all_reduce", 8) == "recursive_doubling"
    assert t.choose("all_reduce", 64 << 20) == "ring"
    assert t.choose("broadcast", 8) == "binomial" and t.choose("broadcast", 64 << 20) == "scatter_allgather"
    assert Tuner(2).choose("broadcast", 64 << 20) == "binomial"
    for coll, rules in RULES.items():
        assert rules[-1][0] == float("inf"), coll


def test_transport_choice():
    assert choose_mode("auto", ["a"]) == "tcp"
    assert choose_mode("auto", ["a", "a"]) == "shm"
    assert choose_mode("auto", ["a", "a", "b", "b"]) == "hierarchical"
    assert choose_mode("auto", ["a", "b"]) == "tcp"
    assert choose_mode("TCP", ["a", "a"]) == "tcp"
    with pytest.raises(ValueError, match="one host"):
        choose_mode("shm", ["a", "b"])
    with pytest.raises(ValueError, match="choose one of"):
        choose_mode("carrier-pigeon", ["a"])


def _per_group(rank, world):
    sub = dist.new_group([0, 1, 2])
    pycoll.set_algorithm("all_reduce", "tree", group=sub)
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t, group=sub)
    default_algo = dist.distributed_c10d._get_default_group().communicator.tuner.choose("all_reduce", 8000)
    return sub.communicator.tuner.choose("all_reduce", 8000), default_algo, bool(
        (t == torch.arange(1000, dtype=torch.float64) * 6).all())


def test_set_algorithm_per_group():
    res = run_ranks(_per_group, 3, backend="pycoll", env={"PYCOLL_TRANSPORT": "tcp"})
    assert all(r == ("tree", "recursive_doubling", True) for r in res), res
