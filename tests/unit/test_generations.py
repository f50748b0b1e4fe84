"""How the ranks of a group agree on their generation of keys in a store that outlives them
(``rendezvous.generation_store``): each rank a thread here, on a real TCPStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pycoll import rendezvous


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    yield store


def _client(server, timeout=10.0):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=timeout))


def _generations(server, size, ranks=None, timeout=10.0):
    """Every rank's generation prefix (or the exception it raised), ranks as threads."""
    ranks = range(size) if ranks is None else ranks
    out = {}

    def one(rank):
        try:
            out[rank] = _prefix_of(rendezvous.generation_store(_client(server, timeout), rank, size))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return [out[r] for r in ranks]


def _prefix_of(store) -> str:
    store.set("probe", "1")            # where the key lands tells the prefix
    return "g"


def test_the_ranks_of_each_init_share_a_fresh_generation(server):
    for _ in range(3):
        for size in (1, 2, 5):
            assert _generations(server, size) == ["g"] * size
    # 9 inits on one store: 9 generations, each sealed, each joined by all its ranks.
    assert int(server.get("pycoll/current")) == 9
    for g in range(1, 10):
        assert server.check([f"pycoll/g{g}/sealed", f"pycoll/g{g}//probe"])   # PrefixStore adds a "/"
    assert server.check([f"pycoll/g9/joined/{r}" for r in range(1, 5)])


def _joiner(server) -> threading.Thread:
    """Rank 1 of 2 making its group, on a thread of its own."""
    t = threading.Thread(target=rendezvous.generation_store, args=(_client(server), 1, 2))
    t.start()
    return t


def test_a_joiner_that_comes_first_waits_for_rank_0_and_ignores_a_sealed_generation(server):
    _generations(server, 2)                           # an earlier attempt: generation 1, sealed
    t = _joiner(server)
    time.sleep(0.3)                                   # the joiner is waiting, not joined to 1
    assert t.is_alive() and server.add("pycoll/g1/joined/1", 0) == 1   # only generation 1's own join
    rendezvous.generation_store(_client(server), 0, 2)
    t.join(10)
    assert not t.is_alive() and server.check(["pycoll/g2/sealed", "pycoll/g2/joined/1"])


def test_a_joiner_of_a_generation_whose_leader_died_moves_to_the_next(server):
    # An earlier attempt's rank 0 opened generation 1 and died before its peers joined.
    server.add("pycoll/generations", 1)
    server.set("pycoll/current", "1")
    server.set("pycoll/g1/leader", "dead")
    t = _joiner(server)
    server.wait(["pycoll/g1/joined/1"])               # it joined the dead one...
    assert t.is_alive()                               # ...and waits for its seal
    rendezvous.generation_store(_client(server), 0, 2)              # the new attempt's rank 0
    t.join(10)
    assert not t.is_alive() and server.check(["pycoll/g2/sealed", "pycoll/g2/joined/1"])


def test_two_processes_joining_as_one_rank_get_a_clear_error(server):
    server.add("pycoll/generations", 1)
    server.set("pycoll/current", "1")
    server.set("pycoll/g1/leader", "x")
    server.add("pycoll/g1/joined/1", 1)               # another process already joined as rank 1
    with pytest.raises(RuntimeError, match="two processes joined generation 1 .* as rank 1"):
        rendezvous.generation_store(_client(server), 1, 2)


def test_a_missing_rank_0_or_joiner_is_a_timeout_naming_the_wait(server):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 waited for rank 0 of this group to open a generation"):
        rendezvous.generation_store(_client(server, timeout=0.5), 1, 2)
    with pytest.raises(TimeoutError, match="rank 0 waited for rank 1 to join generation 1"):
        rendezvous.generation_store(_client(server, timeout=0.5), 0, 2)
    assert time.monotonic() - t0 < 10
