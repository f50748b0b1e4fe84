"""Every ``PYCOLL_*`` environment variable, declared once: name, type, default, meaning.

The code reads a setting only through ``get(name)``, and the README's settings table is
checked against this table by ``tests/unit/test_settings.py`` (every name there, every default as
written here), so a knob cannot be added, renamed or re-defaulted in one place only. NCCL
does the same with ``NCCL_PARAM``.

``get`` reads the environment at each call: a test or a tool that sets a variable before it
creates a group sees it honoured. A value that does not parse raises ``ValueError`` naming
the variable, before any communication.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], object]    # the text of the variable -> its value
    default: object                   # the value when the variable is unset or empty
    shown: str                        # the default as the README's table writes it
    doc: str                          # what it sets, in one line


def _bytes(text: str) -> int:
    """'4194304', '4M', '4MiB', '256K' (binary units, as the bench's sizes)."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:I?B)?", text.strip().upper())
    if not m:
        raise ValueError(text)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


TABLE: tuple[Setting, ...] = (
    Setting("PYCOLL_TRANSPORT", str, "auto", "`auto`", "auto, tcp, shm (one host) or hierarchical"),
    Setting("PYCOLL_ALGO", str, "", "the tuner's cheapest by cost model", "force TCP algorithms"),
    Setting("PYCOLL_COST", str, "", "fitted on loopback", "the TCP cost model's parameters"),
    Setting("PYCOLL_SEGMENT_BYTES", _bytes, 4 * MiB, "4 MiB", "TCP pipeline segment"),
    Setting("PYCOLL_TCP_SPIN_US", float, 1000.0, "1000", "the longest a TCP step polls before it blocks"),
    Setting("PYCOLL_SHM_SLOT_BYTES", _bytes, 4 * MiB, "4 MiB", "shared-memory staging slot per rank"),
    Setting("PYCOLL_SHM_HEAP_BYTES", _bytes, 64 * MiB, "64 MiB", "one rank's region of a registered chunk"),
    Setting("PYCOLL_SHM_HEAP_CACHE_BYTES", _bytes, GiB, "1 GiB", "freed registered blocks kept for reuse"),
    Setting("PYCOLL_SHM_PEER_BYTES", _bytes, 8 * MiB, "8 MiB", "peers' pages of unmap_peers blocks kept mapped"),
    Setting("PYCOLL_SOCKET_IFNAME", str, "", "route to `MASTER_ADDR`, else loopback", "interface to listen on"),
    Setting("PYCOLL_SOCKET_ADDR", str, "", "route to `MASTER_ADDR`, else loopback", "address to listen on"),
    Setting("PYCOLL_HOST_ID", str, "", "hostname + boot id", "pretend hosts (tests, demos)"),
    Setting("PYCOLL_FAULT", str, "", "off", "fault injection (docs/faults.md)"),
    Setting("PYCOLL_TRACE", str, "", "off", "record real traffic to this folder"),
    Setting("PYCOLL_DEBUG", str, "", "off", "log algorithms and steps (INFO, DEBUG)"),
    Setting("PYCOLL_STATS_WINDOW", int, 1024, "1024", "arrivals per peer kept for pycoll.stats"),
    Setting("PYCOLL_CLOCK_SYNC", str, "", "off (measured across hosts only)", "measure: align trace clocks on one host too"),
    Setting("PYCOLL_HANGDUMP", str, "1", "`1`", "0: SIGUSR1 does not log the pending collectives"),
    Setting("PYCOLL_P2P_TRANSPORT", str, "auto", "`auto`", "tcp: point-to-point on one host over sockets too"),
    Setting("PYCOLL_MAX_UNEXPECTED_BYTES", _bytes, GiB, "1 GiB", "cap on buffered unexpected p2p messages"),
    Setting("PYCOLL_AUTH_KEY", str, "", "none", "a key every rank gets out of band"),
    Setting("PYCOLL_AUTH_KEY_FILE", str, "", "none", "a file holding that key"),
    Setting("PYCOLL_CUDA_PATH", str, "auto", "`auto`", "CUDA tensors: auto, nccl, ipc or staging"),
    Setting("PYCOLL_CUDA_IPC_SLOT_BYTES", _bytes, 32 * MiB, "32 MiB", "CUDA IPC staging slot per rank"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in TABLE}


def get(name: str, env: Mapping[str, str] | None = None):
    """The value of setting ``name`` now (its default when unset or blank)."""
    setting = SETTINGS[name]   # a KeyError here is a typo in pycoll, not a user's mistake
    text = (os.environ if env is None else env).get(name, "").strip()
    if not text:
        return setting.default
    try:
        return setting.parse(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: {setting.doc}; expected {setting.parse.__name__.strip('_')}, "
                         f"default {setting.shown}") from None


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of setting ``name`` as set (None when unset): for the settings whose being
    set at all, even to an empty string, means something (the key and its file)."""
    SETTINGS[name]
    return (os.environ if env is None else env).get(name)
