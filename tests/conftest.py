"""Session-wide fixtures: the shared rank pool is shut down when the session ends; ``backend``
runs a test once on gloo and once on pycoll."""

import pytest

from pycoll.testing import ranks


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    yield
    ranks.shutdown()


@pytest.fixture(params=["gloo", "pycoll"])
def backend(request) -> str:
    return request.param
