"""What a rank says when a peer's timeout reaches it (``pycoll.transport.tcp.failure``).

A relayed timeout that blames this rank while it has spent most of its step waiting for
another peer is retold as a wait for that peer: the chain of waits leads there (a link down
on host 2: rank 1 gives up on rank 0, which waits for rank 2). A rank that came late, or
whose only wait is on the rank that timed out, relays as before.
"""

from __future__ import annotations

from pycoll.errors import CommTimeoutError, PeerClosedError
from pycoll.transport.base import InFrame
from pycoll.transport.tcp.conn import RecvState
from pycoll.transport.tcp.failure import stuck_elsewhere
from pycoll.wire import DATA, Header, Signature

SIG = Signature("all_reduce", 5, "float32", 1000)


def _waiting_for(*peers):
    recvs = {}
    for p in peers:
        st = RecvState()
        st.frames.append(InFrame(p, Header(DATA, SIG, 0, 0, 4000), memoryview(bytearray(4000))))
        st.total = 4000
        recvs[p] = st
    return recvs


def _relayed(sender=1, reason="all_reduce seq 5: rank 1 timed out waiting for rank 0: ..."):
    exc = CommTimeoutError(f"all_reduce seq 5: rank 0 stopped because rank {sender} aborted: {reason}",
                           op="all_reduce", seq=5, rank=0, peer=sender)
    exc.origin, exc.root_cause = sender, reason
    return exc


def _name(r):
    return r


def test_a_rank_that_waited_its_step_out_on_another_peer_names_that_peer():
    out = stuck_elsewhere(_relayed(), _waiting_for(2), "all_reduce seq 5", 0, _name, 3.9, 4.0)
    assert isinstance(out, CommTimeoutError) and out.peer == 2 and out.origin == 2
    text = str(out)
    assert text.startswith("all_reduce seq 5: rank 0 had waited 3.9 s for rank 2 when rank 1 timed out")
    assert "received 0 of 4000 bytes from rank 2" in text
    assert "rank 1's reason: all_reduce seq 5: rank 1 timed out waiting for rank 0" in text


def test_a_late_rank_relays_the_timeout_that_blames_it():
    assert stuck_elsewhere(_relayed(), _waiting_for(2), "all_reduce seq 5", 0, _name, 0.2, 4.0) is None


def test_a_rank_waiting_only_on_the_sender_relays():
    assert stuck_elsewhere(_relayed(), _waiting_for(1), "all_reduce seq 5", 0, _name, 3.9, 4.0) is None


def test_other_failures_are_relayed_as_they_are():
    died = PeerClosedError("all_reduce seq 5: rank 1 died", rank=0, peer=1)
    died.root_cause = "rank 1 died"
    assert stuck_elsewhere(died, _waiting_for(2), "all_reduce seq 5", 0, _name, 3.9, 4.0) is None
    own = CommTimeoutError("all_reduce seq 5: rank 0 timed out waiting for rank 2", rank=0, peer=2)
    assert stuck_elsewhere(own, _waiting_for(2), "all_reduce seq 5", 0, _name, 3.9, 4.0) is None
