"""The point-to-point tags pycoll reserves for itself, in one place.

User tags are those torch passes through ``send``/``recv`` (any int, 0 by default); pycoll's
own exchanges over a group's point-to-point engine use negative tags far below any a user
would pick, each use in a range of its own, so that they can never meet a user's message
nor each other's.
"""

# Each range holds 2**39 tags downwards from its start.
MONITORED_BARRIER = -(1 << 40)   # minus the call's number
CLOCK = -(1 << 42)               # clock offset ping-pongs (observe/clock.py)
STATS = -(1 << 43)               # pycoll.stats exchanges, 4 per call (observe/stragglers.py)
RANGES = {"monitored_barrier": MONITORED_BARRIER, "clock": CLOCK, "stats": STATS}
SPAN = 1 << 39


def reserved(tag: int) -> str | None:
    """Which of pycoll's ranges ``tag`` falls in, or None."""
    for name, start in RANGES.items():
        if start - SPAN < tag <= start:
            return name
    return None
