"""Launcher for fault tests: fresh rank processes that may die, with every process reaped.

``pycoll/testing/ranks.py``'s pool treats a dead rank as a failed test (and rebuilds the pool);
fault tests kill ranks on purpose. ``launch`` forks fresh ranks from the same forkserver
(torch preloaded, so a rank starts in ~0.1 s), gives each a pycoll group over a fresh
store, records when each process died (``died_at``, from its sentinel) and what each
survivor reported, and in every case kills and reaps every process before returning.
Each rank may run in a network namespace (``netns``) with its own listen address.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pycoll.testing.fresh import explain, launch

# -- the launcher's own checks ---------------------------------------------------------------

def _sleep_forever(rank, world):
    if rank == 1:
        time.sleep(3600)
    return rank


def _die(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.timeout(60)
def test_launcher_reaps_hung_and_dead_ranks():
    out = launch(_sleep_forever, 2, timeout=8)
    assert out[0]["status"] == "ok" and out[1]["status"] == "hung", explain(out)
    out = launch(_die, 2, timeout=20)
    assert out[1]["status"] == "dead" and out[1]["exitcode"] == -signal.SIGKILL, explain(out)
    assert out[0]["status"] == "ok", explain(out)
