"""Building the TCP full mesh: listen, publish the address in the Store, connect, authenticate.

Rank r connects to every lower rank and accepts every higher rank, once per channel
(collectives and point-to-point traffic use separate sockets, so a large isend can never
stall a collective). Each connection runs the mutual HMAC handshake of ``handshake.py``.

All of it runs in one poll loop: this rank's outgoing connections and every accepted one
progress at once, each with its own deadline (an accepted connection gets
``HANDSHAKE_TIMEOUT``, everything ends by the init deadline), so strangers on the port (a
scanner, garbage, a client sending a byte a second, many silent connections) are dropped
when their time is up and never delay the real ranks' handshakes. At most
``MAX_STRANGERS`` unauthenticated connections are kept; past that the oldest is dropped.
The listening socket is bound to the chosen address only and closed once the mesh is complete.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import time
from collections import OrderedDict

from pycoll import rendezvous
from pycoll.errors import AuthenticationError, CommTimeoutError, PeerClosedError
from pycoll.transport.tcp.handshake import MAGIC, Handshake  # noqa: F401  (MAGIC: tests speak the handshake)

log = logging.getLogger("pycoll")

HANDSHAKE_TIMEOUT = 5.0
MAX_STRANGERS = 64
_POLL_SLICE_S = 1.0


class _Pending:
    """A connection whose handshake has not finished."""

    __slots__ = ("sock", "hs", "deadline", "label", "connecting")

    def __init__(self, sock, hs, deadline, label, connecting=False):
        self.sock, self.hs, self.deadline, self.label, self.connecting = sock, hs, deadline, label, connecting


def build_mesh(store, rank: int, world: int, timeout: float, channels: int = 2
               ) -> list[dict[int, socket.socket]]:
    """Connect this rank to every other rank, ``channels`` sockets per pair.

    Returns one ``{peer: socket}`` dict per channel (blocking sockets, authenticated).
    """
    deadline = time.monotonic() + timeout
    mesh: list[dict[int, socket.socket]] = [{} for _ in range(channels)]
    if world == 1:
        return mesh
    secret = rendezvous.group_secret(store, rank)
    host = rendezvous.local_address()
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    pending: dict[int, _Pending] = {}
    try:
        listener.bind((host, 0))
        listener.listen(max(16, 2 * world * channels))
        listener.setblocking(False)
        store.set(f"pycoll/addr/{rank}", f"{host}|{listener.getsockname()[1]}")
        for peer in range(rank):
            addr = _peer_address(store, rank, peer, deadline)
            for ch in range(channels):
                p = _connect(addr, Handshake(secret, rank, world, channels, peer, ch), deadline,
                             f"rank {peer} at {addr[0]}:{addr[1]} (channel {ch})")
                pending[p.sock.fileno()] = p
        _serve(listener, pending, mesh, secret, rank, world, channels, deadline)
    except BaseException:
        for d in mesh:
            for s in d.values():
                s.close()
        raise
    finally:
        listener.close()
        for p in pending.values():
            p.sock.close()
    for d in mesh:
        for s in d.values():
            s.setblocking(True)
    return mesh


def _peer_address(store, rank: int, peer: int, deadline: float) -> tuple[str, int]:

    try:
        host, port = rendezvous.get(store, f"pycoll/addr/{peer}", deadline).split("|")
    except PeerClosedError:
        raise   # the watch: a peer died meanwhile
    except Exception as exc:  # noqa: BLE001 - torch raises its own store errors
        raise CommTimeoutError(f"init (address exchange): rank {rank} did not get rank {peer}'s "
                               f"address from the store: {exc}", op="init", rank=rank, peer=peer) from None
    return host, int(port)


def _connect(addr, hs: Handshake, deadline: float, label: str) -> _Pending:
    sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    code = sock.connect_ex(addr)
    if code not in (0, errno.EINPROGRESS):
        sock.close()
        raise PeerClosedError(f"init (connect): rank {hs.rank} cannot reach {label}: {errno.errorcode.get(code, code)}"
                              f" (is it alive?)", op="init", rank=hs.rank, peer=hs.peer)
    return _Pending(sock, hs, deadline, label, connecting=code != 0)


def _serve(listener, pending: dict[int, _Pending], mesh, secret, rank, world, channels, deadline) -> None:
    """Run every handshake to its end; return when the mesh is complete."""
    want = (world - 1) * channels
    strangers: OrderedDict[int, None] = OrderedDict()   # accepted, unauthenticated, oldest first
    refused: dict[int, str] = {}                        # rank claimed -> why its proof failed
    while sum(len(d) for d in mesh) < want:
        now = time.monotonic()
        if now >= deadline:
            raise _missing(mesh, rank, world, channels, pending, refused)
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        for fd, p in pending.items():
            poller.register(fd, select.POLLIN | (select.POLLOUT if p.connecting or p.hs.outgoing else 0))
        first = min([deadline] + [p.deadline for p in pending.values()])
        slice_s = rendezvous.check_watch() or _POLL_SLICE_S
        for fd, ev in poller.poll(max(0.0, min(first - now, slice_s)) * 1000):
            if fd == listener.fileno():
                _accept(listener, pending, strangers, secret, rank, world, channels, deadline)
                continue
            p = pending.get(fd)
            if p is None:
                continue
            try:
                _progress(p, ev)
            except (AuthenticationError, OSError, EOFError) as exc:
                del pending[fd]
                strangers.pop(fd, None)
                p.sock.close()
                if p.hs.client:
                    raise _client_error(p, exc) from None
                if p.hs.peer is not None:
                    refused[p.hs.peer] = str(exc)
                log.warning("pycoll rank %d: rejected connection from %s: %s", rank, p.label, exc)
                continue
            if p.hs.done:
                del pending[fd]
                strangers.pop(fd, None)
                peer, ch = p.hs.peer, p.hs.channel
                if peer in mesh[ch]:
                    log.warning("pycoll rank %d: rejected a duplicate connection from rank %d", rank, peer)
                    p.sock.close()
                else:
                    mesh[ch][peer] = p.sock
        now = time.monotonic()
        for fd, p in list(pending.items()):
            if p.deadline <= now and not p.hs.client:
                log.warning("pycoll rank %d: dropped connection from %s: no handshake within %.1f s",
                            rank, p.label, HANDSHAKE_TIMEOUT)
                del pending[fd]
                strangers.pop(fd, None)
                p.sock.close()


def _accept(listener, pending, strangers, secret, rank, world, channels, deadline) -> None:
    while True:
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        fd = sock.fileno()
        pending[fd] = _Pending(sock, Handshake(secret, rank, world, channels),
                               min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT), f"{addr[0]}:{addr[1]}")
        strangers[fd] = None
        if len(strangers) > MAX_STRANGERS:
            old, _ = strangers.popitem(last=False)
            p = pending.pop(old)
            log.warning("pycoll rank %d: dropped connection from %s: more than %d connections "
                        "waiting to authenticate", rank, p.label, MAX_STRANGERS)
            p.sock.close()


def _progress(p: _Pending, ev: int) -> None:
    sock, hs = p.sock, p.hs
    if p.connecting:
        if not ev & (select.POLLOUT | select.POLLERR | select.POLLHUP):
            return
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise ConnectionError(errno.errorcode.get(code, str(code)))
        p.connecting = False
    want = hs.wanted()
    if want and (ev & select.POLLIN or ev & (select.POLLERR | select.POLLHUP)):
        try:
            data = sock.recv(want)
        except BlockingIOError:
            data = None
        if data == b"":
            raise EOFError("connection closed during the handshake")
        if data:
            hs.receive(data)
    if hs.outgoing:
        try:
            n = sock.send(hs.outgoing)
        except BlockingIOError:
            n = 0
        del hs.outgoing[:n]


def _client_error(p: _Pending, exc: BaseException):
    hs = p.hs
    if isinstance(exc, AuthenticationError):
        return AuthenticationError(f"init (handshake): rank {hs.rank} and {p.label}: {exc} (do all ranks "
                                   f"share one PYCOLL_AUTH_KEY?)")
    return PeerClosedError(f"init (handshake): rank {hs.rank} lost its connection to {p.label}: "
                           f"{type(exc).__name__}: {exc}", op="init", rank=hs.rank, peer=hs.peer)


def _missing(mesh, rank, world, channels, pending, refused) -> CommTimeoutError:
    missing = sorted({p for p in range(world) if p != rank for ch in range(channels) if p not in mesh[ch]})
    outgoing = sorted({p.hs.peer for p in pending.values() if p.hs.client})
    what = (f"handshakes with ranks {outgoing} did not finish" if outgoing
            else f"ranks {missing} did not connect")
    claims = sorted(set(refused) & set(missing))
    if claims:
        what += (f"; connections claiming ranks {claims} failed authentication ({refused[claims[0]]}): "
                 f"do all ranks share one PYCOLL_AUTH_KEY?")
    return CommTimeoutError(f"init (tcp mesh): rank {rank} timed out: {what}", op="init", rank=rank,
                            peer=missing[0] if missing else -1)
