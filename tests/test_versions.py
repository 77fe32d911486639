"""WeightVersions: a weight version handed to ZeroMQ zero-copy is never written again."""

import time

import numpy as np
import pytest
import zmq

from rudra_zmq.server.versions import WeightVersions


@pytest.fixture
def pair():
    ctx = zmq.Context()
    # inproc: the peer's queue holds the very message (and so the buffer) until it is read,
    # so "in flight" is deterministic (over tcp libzmq may release it once it is in the
    # kernel's socket buffer). Received with copy=False, as pyzmq requires for inproc.
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://versions-test")
    b.connect("inproc://versions-test")
    yield a, b
    ctx.destroy(linger=0)


def _wait_free(versions, timeout=20.0):
    """pyzmq drops its reference from a background thread once libzmq released the message."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if versions._free_index() is not None:
            return True
        time.sleep(0.01)
    return False


def test_a_version_in_flight_is_not_reused_until_zeromq_releases_it(pair):
    a, b = pair
    n = 1 << 18  # 1 MiB: above pyzmq's copy threshold, so the send really is zero-copy
    v = WeightVersions(np.arange(n, dtype=np.float32))
    first = v.current
    # hold the send in flight: the peer does not read yet, and nothing else refers to `first`
    a.send(first[: n // 2], copy=False)
    a.send(first[n // 2 :], copy=False)
    new = v.next_buffer()
    assert new is not first and v.allocated == 2
    new[:] = -1.0
    v.publish(new)
    del first
    third = v.next_buffer()
    # that allocated: the only spare (the first version) is still in flight
    assert v.allocated == 3 and len(v._spares) == 1 and third.base is None
    got = [b.recv(copy=False), b.recv(copy=False)]
    np.testing.assert_array_equal(
        np.concatenate([np.frombuffer(f.buffer, np.float32) for f in got]), np.arange(n)
    )
    del got
    assert _wait_free(v), "the spare was never released after the peer received it"
    reused = v.next_buffer()
    assert v.allocated == 3 and reused.shape == (n,) and not v._spares
    np.testing.assert_array_equal(reused, np.arange(n))  # it is the first version's buffer


def test_current_and_views_held_elsewhere_are_never_handed_out():
    v = WeightVersions(np.zeros(8, np.float32))
    held = []
    for _ in range(5):
        buf = v.next_buffer()
        assert all(buf is not h.base and buf is not h for h in held)
        assert buf is not v.current
        held.append(v.current[:4])  # a view keeps its base alive, like a zmq.Frame does
        v.publish(buf)
        del buf
    assert v.allocated == 6
    held.clear()
    before = v.allocated
    for _ in range(5):  # now every spare is free again: no more allocations
        v.publish(v.next_buffer())
    assert v.allocated == before
    assert len(v._spares) <= v.max_spares


def test_rejects_non_float32_weights():
    with pytest.raises(ValueError, match="float32"):
        WeightVersions(np.zeros(4, np.float64))
