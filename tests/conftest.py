import os
import sys

# Keep the test oracles importable as `oracles` and never oversubscribe the 2-core CI box.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402
import zmq  # noqa: E402


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty dataset cache of the test's own (RUDRA_ZMQ_CACHE): nothing lands in
    ~/.cache, and nothing decoded by another test is found."""
    from rudra_zmq.data import datasets

    path = tmp_path / "cache"
    monkeypatch.setenv(datasets.CACHE_ENV, str(path))
    return path


@pytest.fixture
def ctx():
    """A ZeroMQ context for one test; destroyed with linger 0, which closes any socket a
    failed test left open, so teardown cannot hang."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)
