"""Session-wide fixtures: the shared rank pool is shut down when the session ends."""

import pytest

from pycoll.testing import ranks


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    yield
    ranks.shutdown()
