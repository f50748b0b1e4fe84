"""Session-wide fixtures: the shared rank pool is shut down when the session ends."""

import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    yield
    harness._shutdown()
