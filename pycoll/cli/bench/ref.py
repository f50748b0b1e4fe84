"""Physical reference figures measured in the same run: loopback TCP and memcpy bandwidth.

They are printed beside the tables so a reader sees the bound a backend works against on this
machine at this moment (DESIGN.md: report the physical limit beside the ratio). Each figure takes
about ``seconds``; they run in the launcher before the ranks start, so nothing competes with them.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import torch

_CHUNK = 4 << 20  # big enough that per-call Python overhead is noise


def _pump_send(sock: socket.socket, stop: float) -> None:
    data = memoryview(bytearray(_CHUNK))
    try:
        while time.perf_counter() < stop:
            sock.sendall(data)
    finally:
        sock.shutdown(socket.SHUT_WR)  # EOF tells the reader we are done


def _pump_recv(sock: socket.socket, result: list) -> None:
    buf = memoryview(bytearray(_CHUNK))
    total, t0 = 0, time.perf_counter()
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            break
        total += n
    result.append(total / (time.perf_counter() - t0))


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    # Port 0: the OS picks a free port, so concurrent runs never collide.
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def tcp_loopback(seconds: float, both_ways: bool) -> float:
    """Bytes/s per direction over one loopback TCP connection (socket calls free the GIL)."""
    a, b = _connected_pair()
    stop = time.perf_counter() + seconds
    rates: list[float] = []
    pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
    threads = []
    for src, dst in pairs:
        threads.append(threading.Thread(target=_pump_send, args=(src, stop), daemon=True))
        threads.append(threading.Thread(target=_pump_recv, args=(dst, rates), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 10)
    a.close()
    b.close()
    return sum(rates) / max(1, len(rates))


def memcpy(seconds: float, nbytes: int = 64 << 20) -> float:
    """Bytes/s of torch copy_ between two large, page-aligned buffers (counted once), on
    torch's intra-op threads: the machine's copy rate from one process."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not memory bandwidth
    n, t0 = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n * nbytes / elapsed


def _copy_rate(seconds: float, nbytes: int, start, rates) -> None:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(dst, src)
        n += 1
    rates.put(n * nbytes / (time.perf_counter() - t0))


def memcpy_per_rank(seconds: float, procs: int, nbytes: int = 64 << 20) -> float:
    """Bytes/s that each of ``procs`` single-threaded processes copies while all copy at once:
    what one rank of a one-host collective can move (the ranks run on one thread each, as
    under torchrun, and all at the same time)."""
    ctx = mp.get_context("fork")    # the children run numpy only: no torch thread pool to inherit
    start, rates = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_copy_rate, args=(seconds, nbytes, start, rates)) for _ in range(procs)]
    for w in workers:
        w.start()
    got = [rates.get(timeout=seconds + 60) for _ in workers]
    for w in workers:
        w.join()
    return min(got)


def all_reduce_bound(per_rank_copy: float, world: int) -> float:
    """busbw bound of a one-host all_reduce from the per-rank copy rate (docs/performance.md).

    Whatever the algorithm, each rank reads its whole input (n bytes) and writes its whole
    output (n bytes) once; for a message far larger than the caches that is memory traffic,
    one copy of n bytes, while staging and peers' data can stay in cache. So algbw <= the
    copy rate each rank gets while all copy at once, and busbw = algbw 2(P-1)/P.
    """
    if world < 2:
        return float("inf")
    return per_rank_copy * 2 * (world - 1) / world


def measure(seconds: float, world: int = 2) -> dict:
    """All reference figures in GB/s (1e9 bytes/s, as nccl-tests). Empty when seconds <= 0."""
    if seconds <= 0:
        return {}
    per_rank = memcpy_per_rank(seconds, world) / 1e9
    return {
        "tcp_loopback_one_way_GBps": tcp_loopback(seconds, both_ways=False) / 1e9,
        "tcp_loopback_each_way_bidir_GBps": tcp_loopback(seconds, both_ways=True) / 1e9,
        "memcpy_GBps": memcpy(seconds) / 1e9,
        "memcpy_per_rank_GBps": per_rank,
        "all_reduce_shm_bound_busbw_GBps": all_reduce_bound(per_rank, world),
        "seconds_each": seconds,
    }
