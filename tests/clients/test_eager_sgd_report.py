"""tools/eager_sgd.py's report: speed-ups are full sync's time to a target over the mode's,
as a ratio of medians over seeds, with the seed-by-seed spread beside it."""

from __future__ import annotations

import pytest

from tools.eager_sgd import summarise, table

pytestmark = pytest.mark.timeout(60)


def _run(mode, seed, t90, total):
    return {"mode": mode, "imbalance": True, "seed": seed, "world": 2, "rounds": None,
            "time_to": {"0.9": t90}, "total_time": total, "median_step_ms": 10.0, "final_acc": 0.95}


def test_speedups_are_ratios_of_medians_with_the_per_seed_spread():
    runs = [_run("full", 0, 2.0, 10.0), _run("full", 1, 3.0, 12.0), _run("full", 2, 4.0, 14.0),
            _run("majority", 0, 1.0, 8.0), _run("majority", 1, 3.0, 9.0), _run("majority", 2, None, 10.0)]
    rows = summarise(runs, {"target": 0.9})
    full, majority = rows
    assert full["time_to_s"] == {"0.9": 3.0} and majority["time_to_s"] == {"0.9": None}  # a seed never got there
    assert majority["seed_speedups_to"] == {"0.9": [1.0, 2.0]}     # seed 2 left out of the spread
    assert majority["time_ratio_total"] == pytest.approx(9.0 / 12.0)
    runs[-1]["time_to"]["0.9"] = 2.0
    majority = summarise(runs, {"target": 0.9})[1]
    assert majority["speedup_to"]["0.9"] == pytest.approx(3.0 / 2.0)
    assert majority["seed_speedups_to"]["0.9"] == [1.0, 2.0, 2.0]
    assert "| 1.50x (1.00-2.00) |" in table(summarise(runs, {"target": 0.9}))


def test_a_report_without_full_sync_has_no_speedups():
    runs = [_run("solo", 0, 1.0, 8.0), _run("majority", 0, 2.0, 9.0)]
    text = table(summarise(runs, {"target": 0.9}))
    assert text.count("| n/a |") >= 2 and "x" not in text.split("\n", 2)[2]
