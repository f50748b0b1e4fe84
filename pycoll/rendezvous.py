"""What ranks exchange through the c10d Store at init: secrets, addresses, host identity.

The Store handed to the backend is the only side channel: no private server, no files.
Keys live under the group's prefix store, so groups and jobs cannot collide, and under a
generation prefix (``generation_store``: rank 0 opens it, the others join, rank 0 seals it),
so that a restart or a re-init on the same store never reads the keys of an earlier attempt.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time

from pycoll import settings

log = logging.getLogger("pycoll")


def generation_store(store, rank: int, size: int):
    """``store`` under a prefix of its own for this group's generation.

    A store outlives the processes that use it: torchrun's agent keeps one TCPStore across
    elastic restarts, and a job may destroy and re-create a group on one store. A rank
    reading an earlier generation's keys would dial dead addresses or wait for keys nobody
    writes. Nothing a worker is told names its attempt on every node alike (a node whose
    agent restarts its worker because another node left keeps its restart count), so the
    ranks agree on the generation through the store: rank 0 opens a fresh one, every other
    rank joins the one open, and rank 0 seals it once all have joined. A rank that finds
    the current generation sealed (complete, or an earlier attempt's) waits for the next;
    one whose leader died before sealing moves to the next as soon as it is opened.
    """
    import torch.distributed as dist

    deadline = time.monotonic() + store.timeout.total_seconds()
    if rank == 0:
        gen = store.add("pycoll/generations", 1)
        store.set("pycoll/current", str(gen))
        store.set(f"pycoll/g{gen}/leader", str(os.getpid()))    # after: a joiner woken by it reads gen
        for peer in range(1, size):
            _wait_key(store, f"pycoll/g{gen}/joined/{peer}", deadline,
                      f"rank 0 waited for rank {peer} to join generation {gen} of the "
                      f"group (pycoll init, store key pycoll/g{gen}/joined/{peer})")
        store.set(f"pycoll/g{gen}/sealed", "1")
    else:
        gen = _join(store, rank, deadline)
    return dist.PrefixStore(f"pycoll/g{gen}/", store)


def _join(store, rank: int, deadline: float) -> int:
    """Join the generation rank 0 has open; its number."""
    while True:
        gen = int(_read(store, "pycoll/current") or 0)
        if gen and not store.check([f"pycoll/g{gen}/sealed"]):
            if store.add(f"pycoll/g{gen}/joined/{rank}", 1) > 1:
                raise RuntimeError(
                    f"pycoll init: two processes joined generation {gen} of this group as rank "
                    f"{rank}: ranks of different attempts (or a duplicated RANK) share one store")
            while not _wait_for(store, f"pycoll/g{gen}/sealed", JOIN_SLICE_S):
                if store.check([f"pycoll/g{gen + 1}/leader"]):
                    break                   # our leader died unsealed; a newer one is open
                _check_deadline(deadline, rank, gen)
            else:
                return gen
            continue
        # None open, or only a sealed one (complete, or an earlier attempt's): the next.
        _wait_for(store, f"pycoll/g{gen + 1}/leader", JOIN_SLICE_S)
        _check_deadline(deadline, rank, gen)


JOIN_SLICE_S = 0.1


def _check_deadline(deadline: float, rank: int, gen: int) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(
            f"pycoll init: rank {rank} waited for rank 0 of this group to open a generation "
            f"(last seen: {gen or 'none'}; store key pycoll/current): is rank 0 alive and in "
            f"init_process_group on the same store?")


def _wait_for(store, key: str, seconds: float) -> bool:
    """Whether ``key`` appeared within ``seconds``; asks the watch (a shrink's) as it waits."""
    from datetime import timedelta

    slice_s = check_watch()
    if slice_s is not None:
        seconds = min(seconds, slice_s)
    try:
        store.wait([key], timedelta(seconds=seconds))
        return True
    except Exception as exc:  # noqa: BLE001 - torch's store errors have no common type
        if "timeout" not in str(exc).lower():
            raise
        return False


def _read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _wait_key(store, key: str, deadline: float, what: str) -> None:
    while not _wait_for(store, key, max(0.001, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pycoll init: {what}: is that rank alive and in "
                               f"init_process_group on the same store?")


def group_secret(store, rank: int) -> bytes:
    """The 32-byte secret of this group's connection handshakes (blocks until rank 0 drew it).

    Rank 0 draws a fresh value and shares it through the Store. With no key of the user's,
    that value is the secret: anyone who can read the Store (torch's TCPStore listens on
    every interface) could join. With ``PYCOLL_AUTH_KEY`` / ``PYCOLL_AUTH_KEY_FILE`` the
    secret is HMAC(key, value): the Store's copy alone proves nothing (docs/faults.md).
    """
    if rank == 0:
        value = secrets.token_bytes(32)
        store.set("pycoll/secret", value.hex())
    else:
        value = bytes.fromhex(get(store, "pycoll/secret"))
    key = auth_key()
    if key is None:
        _tell_no_key(rank)
        return value
    return hmac.new(key, b"pycoll-group-secret" + value, hashlib.sha256).digest()


def auth_key() -> bytes | None:
    """The user's key: ``PYCOLL_AUTH_KEY`` (its UTF-8 bytes) or the bytes of the file named
    by ``PYCOLL_AUTH_KEY_FILE``, which the launcher gives every rank; None if neither."""
    text, path = settings.raw("PYCOLL_AUTH_KEY"), settings.raw("PYCOLL_AUTH_KEY_FILE")
    if text and path:
        raise ValueError("set PYCOLL_AUTH_KEY or PYCOLL_AUTH_KEY_FILE, not both")
    if text:
        return text.encode()
    if not path:
        return None
    try:
        if os.stat(path).st_mode & 0o077:
            log.warning("pycoll: PYCOLL_AUTH_KEY_FILE=%s can be read by other users (chmod 600 it)", path)
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise ValueError(f"PYCOLL_AUTH_KEY_FILE={path}: {exc}") from None
    if not key:
        raise ValueError(f"PYCOLL_AUTH_KEY_FILE={path} is empty")
    return key


_told = False


def _tell_no_key(rank: int) -> None:
    """One line, once per job (rank 0's first group), that no key is set; the whole story
    at debug level (``PYCOLL_DEBUG``): every rank of every job printing five lines at every
    init drowned the users' own output, and gloo prints nothing."""
    global _told
    if _told:
        return
    _told = True
    if rank == 0:
        log.warning("pycoll: no PYCOLL_AUTH_KEY set: connections are as safe as the Store is "
                    "private (docs/faults.md, threat model)")
    log.debug("pycoll: no PYCOLL_AUTH_KEY: connections are authenticated with a secret kept in "
              "the c10d Store, so they are only as safe as the Store is unreachable to others "
              "(torch's TCPStore listens on every interface). Give every rank the same "
              "PYCOLL_AUTH_KEY or PYCOLL_AUTH_KEY_FILE.")


def local_address() -> str:
    """The address this rank listens on.

    PYCOLL_SOCKET_ADDR wins, then the address of PYCOLL_SOCKET_IFNAME, then the local
    address of the route to MASTER_ADDR (no packet is sent), then loopback.
    """
    addr = settings.get("PYCOLL_SOCKET_ADDR")
    if addr:
        return addr
    ifname = settings.get("PYCOLL_SOCKET_IFNAME")
    if ifname:
        return interface_address(ifname)
    master = os.environ.get("MASTER_ADDR")
    if master and master not in ("localhost", "127.0.0.1", "::1"):
        try:
            info = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
            s = socket.socket(info[0], socket.SOCK_DGRAM)
            try:
                s.connect(info[4])
                return s.getsockname()[0]
            finally:
                s.close()
        except OSError:
            pass
    return "127.0.0.1"


def host_identity(global_rank: int) -> str:
    """Which host this rank runs on: hostname + boot id.

    PYCOLL_HOST_ID overrides it, to emulate several hosts on one: either one name, or a
    comma-separated list of names indexed by global rank (``"a,a,b,b"``: 2 hosts x 2 ranks).
    """
    override = settings.get("PYCOLL_HOST_ID")
    if override:
        names = override.split(",")
        return names[global_rank % len(names)] if len(names) > 1 else override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def exchange_all(store, key: str, rank: int, world: int, value: str) -> list[str]:
    """Every rank publishes ``value``; returns all ranks' values in rank order."""
    store.set(f"{key}/{rank}", value)
    return [value if r == rank else get(store, f"{key}/{r}") for r in range(world)]


# -- a watched init ---------------------------------------------------------------------------
# A group built while another one still tells which peers are alive (a shrink: the old
# group's point-to-point connections) must not wait for a peer that dies meanwhile until the
# init deadline. The watch is per thread: a group's set-up runs on the thread that makes it.
_WATCH = threading.local()
WATCH_SLICE_S = 0.05


@contextlib.contextmanager
def watched(check):
    """Run a group's set-up with ``check()`` (raises when a needed peer is gone) consulted
    at every wait of the set-up, at least every ``WATCH_SLICE_S``."""
    saved = getattr(_WATCH, "check", None)
    _WATCH.check = check
    try:
        yield
    finally:
        _WATCH.check = saved


def check_watch() -> float | None:
    """Raise if the watch says a peer is gone; the longest a wait may block before asking
    again (None: no watch, block as long as needed)."""
    check = getattr(_WATCH, "check", None)
    if check is None:
        return None
    check()
    return WATCH_SLICE_S


def get(store, key: str, deadline: float | None = None) -> str:
    """``store.get(key)`` waiting until ``deadline`` (default: the store's own timeout), and
    asking the watch (if any) every ``WATCH_SLICE_S`` while the key is not there yet."""
    from datetime import timedelta

    if deadline is None:
        deadline = time.monotonic() + store.timeout.total_seconds()   # as store.get would wait
    while True:
        left = deadline - time.monotonic()
        slice_s = check_watch() or left
        try:
            store.wait([key], timedelta(seconds=max(0.001, min(left, slice_s))))
            return store.get(key).decode()
        except Exception as exc:  # noqa: BLE001 - torch's store errors have no common type
            if left <= slice_s or "timeout" not in str(exc).lower():
                raise


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface (PYCOLL_SOCKET_IFNAME)."""
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
    except OSError as exc:
        raise ValueError(f"PYCOLL_SOCKET_IFNAME={ifname}: no IPv4 address ({exc})") from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])

