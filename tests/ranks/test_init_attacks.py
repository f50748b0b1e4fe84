"""Strangers at init: they cannot stall it, and with a key of the user's they cannot join.

Two ranks build their TCP mesh (``build_mesh``, real sockets, a real TCPStore) while
strangers sit on rank 0's listening port: a client sending one byte a second (slowloris),
eight connections that send nothing. The real handshakes must finish at once, not after
the strangers' time is up. With ``PYCOLL_AUTH_KEY`` a stranger who read the Store's copy
of the group secret runs pycoll's own handshake and is rejected; ranks with different keys
fail with an error that says so.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.errors import AuthenticationError
from pycoll.transport.tcp.handshake import Handshake
from pycoll.transport.tcp.mesh import HANDSHAKE_TIMEOUT, build_mesh
from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = pytest.mark.timeout(90)


def _store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _rank_thread(store, r, results, timeout=30.0):
    def body():
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            results[r] = build_mesh(client, r, 2, timeout, channels=2)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            results[r] = exc
        results[f"t{r}"] = time.monotonic()
    t = threading.Thread(target=body)
    t.start()
    return t


def _close_all(results):
    for r in (0, 1):
        if isinstance(results.get(r), list):
            for d in results[r]:
                for s in d.values():
                    s.close()


def test_slowloris_and_silent_connections_do_not_stall_init():
    store = _store()
    results: dict = {}
    t0 = _rank_thread(store, 0, results)
    host, port = store.get("pycoll/addr/0").decode().split("|")
    silent = [socket.create_connection((host, int(port))) for _ in range(8)]
    slow = socket.create_connection((host, int(port)))
    stop = threading.Event()

    def drip():   # one byte a second: a handshake that never ends unless it is cut off
        while not stop.wait(1.0):
            try:
                slow.send(b"\x10")
            except OSError:
                return
    dripper = threading.Thread(target=drip)
    dripper.start()
    time.sleep(0.3)
    start = time.monotonic()
    t1 = _rank_thread(store, 1, results)
    t0.join(30)
    t1.join(30)
    try:
        assert isinstance(results[0], list) and isinstance(results[1], list), results
        took = max(results["t0"], results["t1"]) - start
        assert took < HANDSHAKE_TIMEOUT / 2, f"init took {took:.2f} s behind the strangers"
        # The strangers are cut off at their own deadline, not kept for ever.
        slow.settimeout(HANDSHAKE_TIMEOUT + 3)
        cut = time.monotonic()
        try:
            while slow.recv(64):
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - cut < HANDSHAKE_TIMEOUT + 2
        print(f"\n  init with 9 strangers on the port: {took * 1000:.0f} ms")
    finally:
        stop.set()
        dripper.join(5)
        for s in silent + [slow]:
            s.close()
        _close_all(results)


def test_a_stranger_with_the_stores_secret_cannot_join_when_a_key_is_set(monkeypatch):
    monkeypatch.setenv("PYCOLL_AUTH_KEY", "correct horse battery staple")
    store = _store()
    results: dict = {}
    t0 = _rank_thread(store, 0, results)
    host, port = store.get("pycoll/addr/0").decode().split("|")
    leaked = bytes.fromhex(store.get("pycoll/secret").decode())
    # The stranger speaks pycoll's handshake with what the Store holds, as rank 1.
    hs = Handshake(leaked, 1, 2, 2, peer=0, channel=0)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(hs.outgoing)
    try:
        with pytest.raises(AuthenticationError, match="failed to authenticate"):
            while not hs.done:
                data = s.recv(4096)
                if not data:
                    raise AssertionError("rank 0 hung up before its challenge")
                hs.receive(data)
    finally:
        s.close()
    t1 = _rank_thread(store, 1, results)     # the real rank 1 still joins
    t0.join(30)
    t1.join(30)
    try:
        assert isinstance(results[0], list) and isinstance(results[1], list), results
    finally:
        _close_all(results)


def _keyed(rank, world, keys):
    os.environ["PYCOLL_AUTH_KEY"] = keys[rank]
    try:
        dist.init_process_group("pycoll", rank=rank, world_size=world, store=rank_store(),
                                timeout=timedelta(seconds=5))
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        del os.environ["PYCOLL_AUTH_KEY"]
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


def test_ranks_sharing_a_key_work_and_different_keys_are_named():
    assert run_ranks(_keyed, 2, ["k1", "k1"], timeout=60) == [[2.0] * 3] * 2
    res = run_ranks(_keyed, 2, ["k1", "k2"], timeout=60)
    assert "PYCOLL_AUTH_KEY" in res[1], res
    assert "failed authentication" in res[0] and "PYCOLL_AUTH_KEY" in res[0], res


def test_the_handshake_never_reads_past_its_last_message():
    """What follows the handshake on a socket is the peer's first data frame."""
    from pycoll.transport.tcp.handshake import encode

    secret = b"s" * 32
    client = Handshake(secret, 1, 2, 2, peer=0, channel=0)
    server = Handshake(secret, 0, 2, 2)
    wire_c, wire_s = bytearray(client.outgoing), bytearray()
    client.outgoing.clear()
    while not (client.done and server.done):
        while wire_c and server.wanted():
            n = server.wanted()
            server.receive(bytes(wire_c[:n]))
            del wire_c[:n]
        wire_s += server.outgoing
        server.outgoing.clear()
        if server.done:
            wire_s += b"DATA FRAME AFTER THE HANDSHAKE"
        while wire_s and client.wanted():
            n = client.wanted()
            client.receive(bytes(wire_s[:n]))
            del wire_s[:n]
        wire_c += client.outgoing
        client.outgoing.clear()
    assert bytes(wire_s) == b"DATA FRAME AFTER THE HANDSHAKE"
    assert client.wanted() == 0 and server.wanted() == 0
    assert (server.peer, server.channel) == (1, 0)
    assert encode(["x"])[:4] == (len(encode(["x"])) - 4).to_bytes(4, "little")


def test_a_missing_key_is_one_line_from_rank_0_once_and_the_whole_story_at_debug(caplog, monkeypatch):
    import logging

    from pycoll import rendezvous

    for rank, lines in ((1, 0), (0, 1)):
        monkeypatch.setattr(rendezvous, "_told", False)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="pycoll"):
            rendezvous._tell_no_key(rank)
            rendezvous._tell_no_key(rank)          # a second group in the same process
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == lines and all("\n" not in r.getMessage() for r in warned), warned
        assert sum("PYCOLL_AUTH_KEY_FILE" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.DEBUG) == 1
