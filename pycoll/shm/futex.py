"""Futex wait and wake on a word of shared memory, and whether a local peer's process lives.

The arena's barriers wait on their peers' epoch words, the shared-memory transport
(``pycoll.testing.mailbox_transport``) on a doorbell word of its own; both are woken by the peer that changed
the word. ``wake`` takes a premade ``c_void_p``: a rank wakes its own epoch word on every
sync, and making the ctypes argument there cost a third of the call.
"""

from __future__ import annotations

import ctypes

_SYS_FUTEX = 202            # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_ALL = ctypes.c_int(0x7FFFFFFF)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(addr: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``addr`` holds ``expected``, at most ``seconds`` (the
    kernel compares atomically, so a change made before the call returns at once)."""
    seconds = max(0.0, seconds)
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(ts), None, 0)


def wake(addr: ctypes.c_void_p) -> None:
    """Wake every waiter on the word at ``addr`` (a premade c_void_p)."""
    _libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, _ALL, None, None, 0)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (a SIGKILLed child its parent has not
    reaped yet still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
