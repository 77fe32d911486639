"""rudra_zmq.shm: gradient slots and the seqlocked weight board in /dev/shm (issue #5).

Real /dev/shm segments under a fresh token per test, removed at teardown whatever happens.
Child processes (a publishing writer, a creator stopped by SIGTERM or SIGKILL) are plain
``python -c`` scripts with a deadline of their own. No timing assertions.
"""

import os
import select
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from rudra_zmq import kernels, shm

pytestmark = pytest.mark.timeout(60)
N = 1000


def segments(token: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{token}_"))


@pytest.fixture
def token():
    tok = shm.new_token()
    yield tok
    for name in segments(tok):
        os.unlink(os.path.join(shm.SHM_DIR, name))


def child(script: str, *args) -> subprocess.Popen:
    """A Python child running ``script``; returns once it printed "ready"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if not select.select([proc.stdout], [], [], 30)[0] or proc.stdout.readline() != "ready\n":
        proc.kill()
        raise AssertionError(f"child did not start: {proc.communicate(timeout=10)[1][-2000:]}")
    return proc


# ----------------------------------------------------------------------------- gradient slots
def test_a_gradient_written_by_the_learner_is_summed_by_the_leaf_from_its_slot(token):
    with (
        shm.GradientSlots.create(token, 2, 7, N) as learner,
        shm.GradientSlots.attach(token, 2, 7, N) as leaf,
    ):
        grad = np.arange(N, dtype=np.float32)
        learner.slot(0)[:] = grad
        acc = np.ones(N, np.float32)
        kernels.accumulate(acc, leaf.slot(0))
        np.testing.assert_array_equal(acc, grad + 1)
        for i in (0, 1):
            s = leaf.slot(i)
            assert s.dtype == np.float32 and s.shape == (N,) and s.flags.c_contiguous
            assert learner.slot(i).flags.writeable and not s.flags.writeable
            assert s.ctypes.data % 64 == 0
        with pytest.raises(ValueError):
            leaf.slot(0)[0] = 1.0  # the leaf's mapping is read-only
        with pytest.raises(ValueError, match="0 or 1"):
            learner.slot(2)
    assert segments(token) == []


def test_the_two_slots_alternate_so_gradient_k_plus_1_never_overwrites_slot_k(token):
    with (
        shm.GradientSlots.create(token, 0, 0, N) as learner,
        shm.GradientSlots.attach(token, 0, 0, N) as leaf,
    ):
        assert not np.shares_memory(learner.slot(0), learner.slot(1))
        for k in range(6):  # write k+1 while the leaf still has k
            learner.slot((k + 1) % 2)[:] = k + 1
            np.testing.assert_array_equal(leaf.slot(k % 2), np.full(N, k, np.float32))
            learner.slot(k % 2)[:] = k + 2  # only after the leaf is done with slot k


def test_a_torch_gradient_view_of_a_slot_writes_straight_into_shared_memory(token):
    torch = pytest.importorskip("torch")
    with (
        shm.GradientSlots.create(token, 0, 1, N) as learner,
        shm.GradientSlots.attach(token, 0, 1, N) as leaf,
    ):
        grad = torch.from_numpy(learner.slot(1))  # what FlatModel's p.grad would view
        grad.add_(3.0)
        assert float(leaf.slot(1).sum()) == 3.0 * N


# ----------------------------------------------------------------------------- weight board
def test_the_board_returns_the_published_timestamp_and_weights_from_pieces(token):
    with shm.WeightBoard.create(token, 1, N) as leaf, shm.WeightBoard.attach(token, 1, N) as r:
        dst = np.full(N, 9.0, np.float32)
        assert r.read_into(dst) == -1 and r.ts == -1  # nothing published yet
        w = np.arange(N, dtype=np.float32)
        ro = w[600:].copy()
        ro.flags.writeable = False  # like a received zmq frame
        assert leaf.publish(42, [w[:600], ro]) == 2
        assert r.read_into(dst) == 42 and r.ts == 42
        np.testing.assert_array_equal(dst, w)
        with pytest.raises(ValueError, match="999 floats"):
            leaf.publish(43, [w[:999]])
        with pytest.raises(ValueError, match="float64"):
            leaf.publish(43, [w.astype(np.float64)])
        assert r.read_into(dst) == 42  # a refused publish wrote nothing
        np.testing.assert_array_equal(dst, w)


WRITER = """
import select, sys, time
import numpy as np
from rudra_zmq import shm
token, numel = sys.argv[1], int(sys.argv[2])
board = shm.WeightBoard.create(token, 0, numel)
src = [np.full(numel, 1.0, np.float32), np.full(numel, 2.0, np.float32)]
board.publish(0, [src[0]])
print("ready", flush=True)
ts, deadline = 0, time.monotonic() + 40
while not select.select([sys.stdin], [], [], 0)[0] and time.monotonic() < deadline:
    ts += 1
    board.publish(ts, [src[ts % 2]])                 # version ts holds ts % 2 + 1 everywhere
    time.sleep(0.0005)                               # a busy leaf; back to back would starve
board.close()
print(ts, flush=True)
"""


def broken_read_into(board: shm.WeightBoard, dst: np.ndarray) -> int:
    """A reader without the seqlock: copies whatever is there (what the tests must catch)."""
    ts = board.ts
    kernels.copy_into(dst, board._w)
    return ts


def whole(dst: np.ndarray, ts: int) -> bool:
    return dst.min() == dst.max() == ts % 2 + 1


def test_the_seqlock_never_returns_a_torn_copy_while_another_process_publishes(token):
    n = 1 << 20  # 4 MB: a copy takes long enough to race
    writer = child(WRITER, token, n)
    try:
        board = shm.WeightBoard.attach(token, 0, n)
        dst = np.empty(n, np.float32)
        torn = broken = reads = 0
        last, deadline = -1, time.monotonic() + 30
        while (reads < 200 or not broken) and time.monotonic() < deadline:
            ts = board.read_into(dst, timeout_s=10)
            torn += not whole(dst, ts)
            assert ts >= last
            last, reads = ts, reads + 1
            broken += not whole(dst, broken_read_into(board, dst))
        board.close()
        published = int(writer.communicate("stop\n", timeout=20)[0])
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert reads >= 200 and torn == 0
    assert broken >= 1, "the unchecked reader never saw a tear: the test could not catch one"
    assert published >= last > 0
    assert segments(token) == []


def test_a_reader_never_keeps_the_board_of_a_writer_stopped_mid_publish(token):
    n = 4096
    with shm.WeightBoard.create(token, 0, n) as leaf, shm.WeightBoard.attach(token, 0, n) as r:
        leaf.publish(1, [np.full(n, 2.0, np.float32)])
        # freeze a publish of version 2 halfway: sequence odd, half the weights new
        leaf._seq[0] += 1
        leaf._ts[0] = 2
        leaf._w[: n // 2] = 1.0
        dst = np.empty(n, np.float32)
        assert not whole(dst, broken_read_into(r, dst))  # the check sees the tear
        with pytest.raises(TimeoutError, match="stayed mid-publish"):
            r.read_into(dst, timeout_s=0.2)
        assert r.retries > 0


def test_the_board_is_refused_on_a_weakly_ordered_cpu_and_slots_are_not(token, monkeypatch):
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")
    with pytest.raises(shm.ShmUnavailable, match=r"'aarch64'.*use ipc"):
        shm.WeightBoard.create(token, 0, N)
    with pytest.raises(shm.ShmUnavailable, match="aarch64"):
        shm.WeightBoard.attach(token, 0, N)
    shm.GradientSlots.create(token, 0, 0, N).close()  # slots are ordered by ZeroMQ messages
    assert segments(token) == []


# ----------------------------------------------------------------------------- lifecycle
def test_only_the_creator_unlinks_and_mapped_memory_outlives_the_name(token):
    learner = shm.GradientSlots.create(token, 0, 0, N)
    leaf = shm.GradientSlots.attach(token, 0, 0, N)
    leaf.close()
    leaf.close()  # idempotent
    assert segments(token) == [shm.segment_name(token, 0, 0)]
    leaf = shm.GradientSlots.attach(token, 0, 0, N)
    learner.unlink()  # every peer has it mapped: drop the name
    assert segments(token) == [] and not learner.owner
    learner.slot(0)[:] = 5.0
    assert leaf.slot(0)[0] == 5.0
    with pytest.raises(shm.ShmUnavailable, match="on this host"):
        shm.GradientSlots.attach(token, 0, 0, N)
    view = leaf.slot(0)
    leaf.close()
    learner.close()
    assert view[0] == 5.0  # a view handed out keeps its memory


CREATOR = """
import signal, sys, time
from rudra_zmq import shm
signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
token = sys.argv[1]
slots = shm.GradientSlots.create(token, 3, 0, 1000)    # never closed: atexit must unlink
board = shm.WeightBoard.create(token, 3, 1000)
print("ready", flush=True)
time.sleep(40)
"""


def test_a_creator_stopped_by_sigterm_leaves_no_segment(token):
    proc = child(CREATOR, token)
    try:
        assert len(segments(token)) == 2
        proc.send_signal(signal.SIGTERM)  # rudra-zmq's CLI turns it into an exception
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert segments(token) == []


def test_segments_of_a_killed_or_replaced_creator_are_swept_and_live_ones_kept(token):
    proc = child(CREATOR, token)
    proc.kill()  # SIGKILL: no cleanup of its own
    proc.communicate(timeout=20)
    assert len(segments(token)) == 2
    with shm.GradientSlots.create(token, 0, 0, N) as live:  # create sweeps first
        assert segments(token) == [live.name]
        fake = os.path.join(shm.SHM_DIR, shm.segment_name(token, 0, 1))
        with open(fake, "wb") as f:  # our pid, another start time: pid reused
            f.write(
                shm.HEADER.pack(
                    shm.MAGIC,
                    shm.LAYOUT,
                    shm.KIND_SLOTS,
                    os.getpid(),
                    shm.start_time(os.getpid()) + 1,
                    shm.pid_ns(),
                    N,
                )
            )
        alien = os.path.join(shm.SHM_DIR, shm.segment_name(token, 0, 2))
        with open(alien, "wb") as f:  # another pid namespace: not ours to judge
            f.write(
                shm.HEADER.pack(shm.MAGIC, shm.LAYOUT, shm.KIND_SLOTS, 1, 0, shm.pid_ns() + 1, N)
            )
        assert os.path.basename(fake) in shm.sweep_stale()
        assert segments(token) == sorted([live.name, os.path.basename(alien)])


# ----------------------------------------------------------------------------- errors
def test_a_segment_too_large_for_dev_shm_names_the_size_and_says_to_use_ipc(token):
    n = 10_000_000  # 80 MB of slots > Docker's 64 MiB
    with pytest.raises(shm.ShmUnavailable, match=r"needs 80,000,064 bytes .*64 MiB.*ipc"):
        shm.GradientSlots.create(token, 0, 0, n, limit_bytes=64 << 20)
    with pytest.raises(shm.ShmUnavailable, match=r"needs 40,000,128 bytes"):
        shm.WeightBoard.create(token, 0, n, limit_bytes=32 << 20)
    assert segments(token) == []
    assert shm.slots_nbytes(n) == 80_000_064 and shm.board_nbytes(n) == 40_000_128


def test_attaching_a_missing_or_mismatched_segment_says_what_is_wrong(token):
    with pytest.raises(shm.ShmUnavailable, match="on this host"):
        shm.WeightBoard.attach(token, 0, N)
    with shm.GradientSlots.create(token, 0, 0, N):
        with pytest.raises(shm.ShmUnavailable, match="expected"):
            shm.GradientSlots.attach(token, 0, 0, N + 1000)
        path = os.path.join(shm.SHM_DIR, shm.segment_name(token, 0, 0))
        with open(path, "r+b") as f:  # same size, another model's numel
            f.seek(struct.calcsize("<8sIIIxxxxQQ"))
            f.write(struct.pack("<Q", N + 1))
        with pytest.raises(shm.ShmUnavailable, match="1,001 floats"):
            shm.GradientSlots.attach(token, 0, 0, N)


@pytest.mark.parametrize(
    "tok, node, learner",
    [
        ("../etc", 0, 0),
        ("a/b", 0, 0),
        ("", 0, 0),
        ("x" * 33, 0, 0),
        ("ok", -1, 0),
        ("ok", 0, "1"),
        ("ok", 0, True),
    ],
)
def test_segment_names_refuse_unsafe_tokens_and_ids(tok, node, learner):
    with pytest.raises(ValueError):
        shm.segment_name(tok, node, learner)


def test_segment_names_are_derived_from_token_node_and_learner():
    assert shm.segment_name("abc123", 4, 9) == "rudra_zmq_abc123_n4_l9"
    assert shm.segment_name("abc123", 4) == "rudra_zmq_abc123_n4_w"
