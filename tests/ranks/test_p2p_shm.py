"""Point-to-point between ranks of one host goes through shared memory (``pycoll.shm.links``),
never a socket: equal to gloo on the same calls, c10d's ordering, and its faults.

The first test fails on a tree whose one-host point-to-point goes over TCP: it reads the
kernel's byte counts of the point-to-point sockets (TCP_INFO) around a run of messages.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import memfd_fds, run_ranks

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
BIG = 9 << 20   # bytes: more than a ring (4 MiB for two ranks), so it streams through in pieces


def _engine():
    return dist.distributed_c10d._get_default_group().communicator.p2p


def _socket_bytes() -> int:
    """Bytes this rank sent on its point-to-point sockets, as the kernel counts them
    (TCP_INFO's tcpi_bytes_sent; its bytes_received was seen to count a stray byte now and
    then that no peer's bytes_sent had)."""
    total = 0
    for conn in _engine().conns.values():
        info = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        total += struct.unpack_from("<Q", info, 200)[0]
    return total


def _traffic(rank, world):
    dist.barrier()
    time.sleep(0.2)   # what init sent has arrived
    before = _socket_bytes()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    for n in (0, 1, 4096, BIG):
        out = torch.full((n,), float(rank), dtype=torch.float32)
        got = torch.empty(n)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prev)])
        for r in reqs:
            r.wait()
        assert bool((got == prev).all())
    if rank == 0:
        dist.send(torch.ones(3), 1, tag=5)
    elif rank == 1:
        t = torch.zeros(3)
        dist.recv(t, 0, tag=5)
        assert t.sum().item() == 3
    return _socket_bytes() - before


def test_one_host_point_to_point_moves_no_byte_over_a_socket():
    moved = run_ranks(_traffic, 3, backend="pycoll")
    assert moved == [0, 0, 0], f"bytes over the point-to-point sockets, by rank: {moved}"


def _every_dtype(rank, world):
    g = torch.Generator().manual_seed(7)
    got = []
    for i, dt in enumerate(DTYPES):
        for n in (0, 1, 1000, 777_777):
            src = (torch.randn(n, generator=g, dtype=torch.float64) * 50)
            src = src.to(dt) if not dt.is_complex else torch.complex(src, -src).to(dt)
            if rank == 0:
                dist.send(src, 1, tag=i)
            else:
                t = torch.empty(n, dtype=dt)
                dist.recv(t, 0, tag=i)
                got.append(bool(torch.equal(t, src)))
    return got


def test_every_dtype_and_size_arrives_whole():
    res = run_ranks(_every_dtype, 2, backend="pycoll")
    assert res[1] == [True] * (len(DTYPES) * 4)


def _tags_and_order(rank, world):
    """Messages match per (peer, tag) in posting order, whatever the order of the receives,
    and large ones are kept as unexpected while a later tag is asked for first."""
    sizes = {1: [5, BIG // 4, 3], 2: [BIG // 4, 7], 3: [0]}
    if rank == 0:
        works = [dist.isend(torch.full((n,), float(10 * tag + k)), 1, tag=tag)
                 for k in range(3) for tag in (1, 2, 3) if k < len(sizes[tag]) for n in [sizes[tag][k]]]
        for w in works:
            w.wait()
        return None
    seen = []
    for tag in (3, 2, 1):   # the reverse of the posting order of the first messages
        for k, n in enumerate(sizes[tag]):
            t = torch.empty(n)
            dist.recv(t, 0, tag=tag)
            seen.append((tag, k, sorted(set(t.tolist()))))
    return seen


def test_tags_match_in_posting_order_and_a_later_tag_may_be_received_first():
    res = run_ranks(_tags_and_order, 2, backend="pycoll")
    want = [(tag, k, [] if n == 0 else [float(10 * tag + k)])
            for tag, ns in ((3, [0]), (2, [BIG // 4, 7]), (1, [5, BIG // 4, 3])) for k, n in enumerate(ns)]
    assert res[1] == want


def _patterns(rank, world):
    """Any-source receives, symmetric large sends, rings, objects: the same on every backend."""
    out = {}
    if rank == 0:
        srcs = []
        for _ in range(world - 1):
            t = torch.empty(4, dtype=torch.int64)
            srcs.append(dist.recv(t))                     # from any source
            assert t.tolist() == [srcs[-1]] * 4
        out["any"] = sorted(srcs)
    else:
        dist.send(torch.full((4,), rank, dtype=torch.int64), 0)
    # both directions of a pair at once, each larger than the ring, sends posted first
    peer = rank ^ 1
    if peer < world:
        mine, theirs = torch.full((BIG // 8,), float(rank), dtype=torch.float64), torch.empty(BIG // 8, dtype=torch.float64)
        s = dist.isend(mine, peer, tag=9)
        dist.recv(theirs, peer, tag=9)
        s.wait()
        out["pair"] = bool((theirs == peer).all())
    objs = [{"rank": rank, "blob": b"x" * 5000}] if rank == 0 else [None]
    if rank == 0:
        for dst in range(1, world):
            dist.send_object_list(objs, dst)
    else:
        dist.recv_object_list(objs, 0)
    out["obj"] = objs[0]["rank"], len(objs[0]["blob"])
    # p2p and collectives interleaved on one group, and a subgroup's p2p beside them
    big = dist.isend(torch.full((BIG // 4,), 1.0), (rank + 1) % world, tag=4)
    t = torch.ones(10)
    dist.all_reduce(t)
    got = torch.empty(BIG // 4)
    dist.recv(got, (rank - 1) % world, tag=4)
    big.wait()
    out["mixed"] = t[0].item(), got.sum().item()
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        x = torch.full((3,), float(rank))
        if rank == 1:
            dist.send(x, 2, group=sub)
        else:
            dist.recv(x, 1, group=sub)
        out["sub"] = x.tolist()
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_patterns_equal_glooss(world):
    ours = run_ranks(_patterns, world, backend="pycoll")
    gloo = run_ranks(_patterns, world, backend="gloo")
    assert ours == gloo


def _unanswered(rank, world):
    pg = dist.new_group(timeout=timedelta(seconds=1.5))
    result = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(10), 1, tag=7, group=pg)
            result = "no error", "", 0.0
        except Exception as exc:  # noqa: BLE001 - the error is the result
            result = type(exc).__name__, str(exc), time.monotonic() - t0
    dist.barrier()   # rank 1 stays until then: a peer that left is another error
    return result


def test_a_receive_nobody_sends_to_times_out_naming_op_tag_peer_and_bytes():
    kind, text, seconds = run_ranks(_unanswered, 2, backend="pycoll")[0]
    assert "recv from rank 1" in text and "tag 7" in text and "40 bytes" in text, (kind, text)
    assert 1.0 < seconds < 10, seconds


def _killed_mid_message(rank, world):
    dist.barrier()
    if rank == 0:
        dist.isend(torch.ones(16 << 20), 1)    # 64 MiB: returns once the ring's 4 MiB are written
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(16 << 20), 0)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", 0.0


def test_a_peer_killed_mid_message_fails_the_receiver_at_once():
    res = run_ranks(_killed_mid_message, 2, backend="pycoll", may_die=(0,))
    kind, text, seconds = res[1]
    assert "rank 0" in text and kind != "no error", (kind, text)
    assert seconds < 5, seconds             # the group timeout is 60 s


def _malformed(rank, world):
    eng = _engine()
    dist.barrier()
    if rank == 0:
        class Garbage:   # what no pycoll rank writes: a header with a wrong magic
            header, buf, off = struct.pack("<IiqqQ", 0xBAD, 8, 0, 4, 16), memoryview(b""), 0
        with eng._lock:
            eng.local.links.write(1, Garbage)
        time.sleep(1.0)
        try:
            dist.send(torch.ones(4), 1)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return type(exc).__name__, str(exc)
        return "no error", ""
    try:
        dist.recv(torch.empty(4), 0)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_a_malformed_header_fails_the_pair_on_both_sides_never_a_wrong_tensor():
    res = run_ranks(_malformed, 2, backend="pycoll")
    assert res[1][0] != "no error" and "malformed point-to-point header from rank 0" in res[1][1], res
    assert "malformed" in res[0][1] and "rank 1" in res[0][1], res


def _destroy_in_flight(rank, world):
    pg = dist.new_group()
    if rank == 0:
        dist.isend(torch.ones(BIG), 1, group=pg)      # never received
    else:
        dist.irecv(torch.empty(5), 0, tag=3, group=pg)  # never sent
    dist.destroy_process_group(pg)
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.send(t, 1 - rank) if rank == 0 else dist.recv(t, 0)
    return t.tolist()


def test_a_destroy_with_messages_in_flight_frees_everything():
    # run_ranks fails a run whose ranks still map pycoll shared memory of a destroyed group
    assert run_ranks(_destroy_in_flight, 2, backend="pycoll") == [[2.0, 2.0], [2.0, 2.0]]


def _two_hosts(rank, world):
    """Pretend hosts a,a,b,b: a rank's messages to its own host's rank move no byte over a
    socket, those to the other host's go over TCP; both arrive whole."""
    dist.barrier()
    time.sleep(0.2)
    eng = _engine()
    before = {p: c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256) for p, c in eng.conns.items()}
    out = []
    for peer in range(world):
        if peer == rank:
            continue
        mine, theirs = torch.full((BIG // 4,), float(rank)), torch.empty(BIG // 4)
        lo, hi = min(rank, peer), max(rank, peer)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, tag=lo * 10 + hi),
                                       dist.P2POp(dist.irecv, theirs, peer, tag=lo * 10 + hi)])
        for r in reqs:
            r.wait()
        out.append(bool((theirs == peer).all()))
    sent = {p: struct.unpack_from("<Q", eng.conns[p].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 200)[0]
            - struct.unpack_from("<Q", before[p], 200)[0] for p in eng.conns}
    return out, sorted(p for p, n in sent.items() if n > 0)


def test_in_a_hierarchical_group_shared_memory_within_a_host_tcp_between_hosts():
    res = run_ranks(_two_hosts, 4, backend="pycoll", env={"PYCOLL_HOST_ID": "a,a,b,b"})
    assert [ok for ok, _ in res] == [[True] * 3] * 4
    assert [over_tcp for _, over_tcp in res] == [[2, 3], [2, 3], [0, 1], [0, 1]]


def _shrink_in_flight(rank, world):
    """Messages in flight when a rank dies and the survivors shrink: the new group's
    point-to-point works, and of the old group's rings nothing stays mapped or open."""
    import gc

    dist.barrier()
    if rank == 2:
        os._exit(1)
    pending = [dist.isend(torch.ones(BIG), 1) if rank == 0 else dist.irecv(torch.empty(5), 2, tag=3)]
    err = None
    for _ in range(200):
        try:
            dist.all_reduce(torch.ones(8))
        except Exception as exc:  # noqa: BLE001 - the error is what the test reads
            err = type(exc).__name__
            break
        time.sleep(0.01)
    dist.shrink_group([2])
    del pending
    t = torch.full((4,), float(rank))
    dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    gc.collect()
    return err, t.tolist(), len(memfd_fds("pycoll-p2p"))


def test_a_shrink_with_messages_in_flight_leaves_no_ring_of_the_old_group():
    res = run_ranks(_shrink_in_flight, 3, backend="pycoll", timeout=90, may_die=(2,))
    assert res[2] == "died"
    for err, got, rings in res[:2]:
        assert err is not None and got == [0.0] * 4 and rings == 1, res
