"""Physical reference figures measured in the same run: loopback TCP and memcpy bandwidth.

They are printed beside the tables so a reader sees the bound a backend works against on this
machine at this moment (DESIGN.md: report the physical limit beside the ratio). Each figure takes
about ``seconds``; they run in the launcher before the ranks start, so nothing competes with them.
"""

from __future__ import annotations

import socket
import threading
import time

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
    """Bytes/s of torch copy_ between two large, page-aligned buffers (counted once)."""
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


def measure(seconds: float) -> dict:
    """All reference figures in GB/s (1e9 bytes/s, as nccl-tests). Empty when seconds <= 0."""
    if seconds <= 0:
        return {}
    return {
        "tcp_loopback_one_way_GBps": tcp_loopback(seconds, both_ways=False) / 1e9,
        "tcp_loopback_each_way_bidir_GBps": tcp_loopback(seconds, both_ways=True) / 1e9,
        "memcpy_GBps": memcpy(seconds) / 1e9,
        "seconds_each": seconds,
    }
