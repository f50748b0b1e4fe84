"""Emulated hosts on one machine: a network namespace per host, joined through a bridge.

``EmulatedHosts(4, rate="1gbit")`` builds what issue 45 measured with by hand: a "switch"
namespace holding a bridge, and per host a namespace with its own address (10.<net>.0.<h+1>)
on an ``eth0`` that is one end of a veth pair, the other end on the bridge. With a ``rate``,
both directions of every host's link are shaped with ``tc ... tbf`` (this kernel has tbf and
htb, not netem): the host's egress on its ``eth0``, its ingress on the switch's end of the pair.
``shape(h, rate)`` reshapes one host's link and ``link_down(h)`` pulls its cable, mid-run.
A process enters a host with ``enter(name)`` (``setns``: the calling thread and the threads it
starts later; sockets opened before stay where they were, which is how the ranks of the bench
keep their Store connection on the launcher's loopback).

Everything made is removed on ``close()`` (the ``with`` block's end), also when the block
raises or is interrupted; SIGTERM and SIGHUP are turned into SystemExit for the block's
duration so they unwind through it too. Only SIGKILL can leave namespaces behind: each name
carries its creator's pid, and the next ``EmulatedHosts`` removes those of dead creators.
Needs root, ``ip`` and ``tc``; ``unavailable()`` says why not in one line.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading

PREFIX = "pcn"           # every namespace this module makes: pcn<pid>h<i>, pcn<pid>sw
CLONE_NEWNET = 0x40000000
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)")
_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def rate_bytes_per_s(rate: str) -> float:
    """tc's rate ('1gbit', '100mbit': decimal bits per second) in bytes per second."""
    m = _RATE.fullmatch(rate.strip().lower())
    if not m:
        raise ValueError(f"not a link rate: {rate!r} (examples: 100mbit, 1gbit, 10gbit)")
    return float(m.group(1)) * _SCALE[m.group(2)] / 8


def unavailable() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth pairs, tc)"
    missing = [t for t in ("ip", "tc") if not shutil.which(t)]
    if missing:
        return f"emulated hosts need {' and '.join(missing)} (apt-get install -y iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()[:120]}"
    _ip("netns", "del", probe, check=False)
    return None


def enter(name: str) -> None:
    """Move the calling thread (and the threads it starts from now on) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def ours() -> list[str]:
    """The namespaces of this module that exist now (any creator)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(PREFIX)]


def _reap_orphans() -> None:
    """Remove namespaces whose creating process is gone (it was SIGKILLed mid-run)."""
    for name in ours():
        m = re.fullmatch(rf"{PREFIX}(\d+)(h\d+|sw|probe)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


class _Unwind:
    """SIGTERM/SIGHUP raise SystemExit while the hosts exist, so ``finally`` blocks run."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.saved: dict = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self   # handlers can only be set from the main thread
        for s in self.SIGNALS:
            self.saved[s] = signal.signal(s, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for s, h in self.saved.items():
            signal.signal(s, h)
        return False


class EmulatedHosts:
    """``hosts`` namespaces on one bridge; ``rate`` (tc units, e.g. '1gbit') shapes each
    host's link both ways, None leaves it unshaped (veth at memory speed)."""

    def __init__(self, hosts: int, rate: str | None = None, net: int = 231,
                 burst: str = "256kb", latency: str = "50ms") -> None:
        if hosts < 1:
            raise ValueError(f"need at least one host, got {hosts}")
        if rate is not None:
            rate_bytes_per_s(rate)  # validate before making anything
        self.hosts, self.rate, self.net = hosts, rate, net
        self.burst, self.latency = burst, latency
        tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}h{i}" for i in range(hosts)]
        self.addrs = [f"10.{net}.0.{i + 1}" for i in range(hosts)]
        self._ports = [f"{tag}s{i}" for i in range(hosts)]  # switch-side veth ends (<= 15 chars)
        self._made: list[str] = []
        self._unwind = _Unwind()

    def describe(self) -> str:
        link = f"tbf {self.rate} both ways (burst {self.burst})" if self.rate else "unshaped veth"
        return f"{self.hosts} emulated hosts ({', '.join(self.addrs)}), links: {link}"

    def __enter__(self) -> "EmulatedHosts":
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self._unwind.__enter__()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        _reap_orphans()
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for ns, port, addr in zip(self.names, self._ports, self.addrs):
            self._netns(ns)
            _ip("link", "add", port, "netns", self.switch, "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if self.rate:
            for h in range(self.hosts):
                self.shape(h, self.rate)

    def shape(self, host: int, rate: str) -> None:
        """Reshape host ``host``'s link, both ways, to ``rate`` (a slow link, mid-run)."""
        rate_bytes_per_s(rate)
        for ns, dev in ((self.names[host], "eth0"), (self.switch, self._ports[host])):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", self.burst, "latency", self.latency],
                           capture_output=True, text=True, timeout=20, check=True)

    def link_down(self, host: int) -> None:
        """Take host ``host``'s link down (a pulled cable): the switch's end of its pair."""
        _ip("-n", self.switch, "link", "set", self._ports[host], "down")

    def link_up(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", self._ports[host], "up")

    def close(self) -> None:
        """Remove every namespace made (their veths and qdiscs go with them)."""
        try:
            for name in reversed(self._made):
                _ip("netns", "del", name, check=False)
            self._made.clear()
        finally:
            self._unwind.__exit__()
