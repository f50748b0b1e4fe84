"""The model of the eager-SGD experiment (tools/eager_sgd_model.py): its rules reduce to
full sync where they must, and partial modes never take longer than full sync."""

from __future__ import annotations

import random

import pytest

from tools.eager_sgd_model import main, simulate, stragglers

pytestmark = pytest.mark.timeout(60)


def test_stragglers_replay_the_experiment_sequence():
    seq = stragglers(4, 1, 300, 40.0, 80.0)
    assert seq == stragglers(4, 1, 300, 40.0, 80.0) != stragglers(4, 2, 300, 40.0, 80.0)
    late = [[r for r, ms in enumerate(step) if ms] for step in seq]
    assert all(len(who) == 1 for who in late) and {w[0] for w in late} == {0, 1, 2, 3}
    assert all(40.0 <= max(step) <= 80.0 for step in seq)


def test_stragglers_with_a_probability_delay_each_rank_independently():
    seq = stragglers(4, 0, 2000, 40.0, 80.0, prob=0.25)
    per_step = [sum(1 for ms in step if ms) for step in seq]
    assert set(per_step) >= {0, 1, 2} and 0.2 < sum(per_step) / (4 * len(seq)) < 0.3
    assert all(ms == 0.0 or 40.0 <= ms <= 80.0 for step in seq for ms in step)


def test_full_sync_waits_for_the_straggler_every_step():
    seq = [[10.0, 0.0], [0.0, 20.0], [5.0, 3.0]]
    assert simulate("full", seq, 2, compute=1.0, overhead=0.5) == pytest.approx([11.5, 33.0, 39.5])


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_partial_modes_are_full_sync_where_nothing_can_be_skipped(mode):
    seq = stragglers(3, 0, 120, 40.0, 80.0)
    full = simulate("full", seq, 3)
    assert simulate(mode, seq, 3, max_staleness=0) == pytest.approx(full)      # K = 0: synchronous
    alone = [[max(step)] for step in seq]
    assert simulate(mode, alone, 1) == pytest.approx(simulate("full", alone, 1))
    balanced = [[0.0] * 3] * 50
    assert simulate(mode, balanced, 3) == pytest.approx(simulate("full", balanced, 3))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("grace", [0.0, 2.0, 10.0])
@pytest.mark.parametrize("prob", [None, 0.3])
def test_partial_modes_never_take_longer_and_solo_is_fastest(world, grace, prob):
    for seed in range(3):
        seq = stragglers(world, seed, 200, 40.0, 80.0, prob)
        full = simulate("full", seq, world)
        solo = simulate("solo", seq, world, grace=grace)
        majority = simulate("majority", seq, world, grace=grace)
        assert all(m <= f + 1e-9 for m, f in zip(majority, full))
        assert solo[-1] < majority[-1] < full[-1]


def test_cli_prints_a_line_per_world_mode_and_grace(capsys):
    main(["--worlds", "2", "--seeds", "1", "--steps", "60", "--at", "30", "60", "--grace", "0", "10"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 4 and all(line.count("x") >= 2 for line in lines[1:])


def test_majority_at_two_ranks_converges_to_the_closed_form_ceiling():
    """docs/partial.md derives it: one rank late by d every step, nothing else costing time,
    full sync over majority tends to 3 - sqrt(3). Solo, by contrast, is near 2 (each rank is
    late half the steps and nobody waits for it)."""
    rng = random.Random(5)
    seq = [[0.0, 0.0] for _ in range(20000)]
    for step in seq:
        step[rng.randrange(2)] = 60.0
    free = dict(compute=0.0, grace=0.0, overhead=0.0, max_staleness=10**9)
    full = simulate("full", seq, 2, **free)[-1]
    assert full / simulate("majority", seq, 2, **free)[-1] == pytest.approx(3 - 3 ** 0.5, rel=0.015)
    assert full / simulate("solo", seq, 2, **free)[-1] == pytest.approx(2.0, rel=0.05)
