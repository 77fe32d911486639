import os
import sys

# Keep the test oracles importable as `oracles` and never oversubscribe the 2-core CI box.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The two xdist workers share the cores, but each run's roles (and each `worker` rank) plan
# their threads as if they owned them: OpenMP threads that spin while waiting then steal the
# cores the other worker computes on (run_plan.role_env makes the same choice when it knows).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _worker_ports() -> None:
    """Each xdist worker's runs plan their ports in a range of their own ($RUDRA_ZMQ_PORTS,
    inherited by the roles): a role restarted by one worker's run could otherwise find its
    port taken by the other's plan (CI: "Address already in use" for an ImageNet test's PS
    beside the soak test)."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not count or "RUDRA_ZMQ_PORTS" in os.environ:
        return
    from rudra_zmq import transport

    i, n = int(worker.removeprefix("gw")), int(count)
    first = transport.FIRST_PORT
    width = (transport.ephemeral_port_range()[0] - first) // n
    if width >= transport.MIN_PORTS:
        os.environ[transport.PORTS_ENV] = f"{first + i * width}-{first + (i + 1) * width - 1}"


_worker_ports()


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
