"""The group lifecycle table (``core/communicator.py``: ``LIFECYCLE``): every state reachable
from open, freed the only end, nothing leads back to open, and ``_move`` refuses a step that
is not in the table."""

import pytest

from pycoll.core import communicator as c


def test_the_table_is_a_one_way_path_to_freed():
    reach, todo = {c.OPEN}, [c.OPEN]
    while todo:
        for nxt in c.LIFECYCLE[todo.pop()]:
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    assert reach == set(c.LIFECYCLE)
    assert [s for s, to in c.LIFECYCLE.items() if not to] == [c.FREED]
    assert all(c.OPEN not in to for to in c.LIFECYCLE.values())


def test_a_step_outside_the_table_is_refused():
    class Group:
        rank, state = 0, c.FREED
        _move = c.Communicator._move

    g = Group()
    with pytest.raises(AssertionError, match="freed -> open is no transition"):
        g._move(c.OPEN)
    g.state = c.CLOSING
    g._move(c.DRAINING)
    assert g.state == c.DRAINING
