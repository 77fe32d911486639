"""The payload codec: float32 frames are views (no copy), frames of every model dtype decode
into float32 at their offsets, and the PS's update and a tree node's sum take half-precision
frames as the float32 values they stand for."""

import numpy as np
import pytest

import oracles
from cluster import small_config
from rudra_zmq import codec, update, wire
from rudra_zmq.config import OptimizerConfig
from rudra_zmq.node_state import NodeState
from rudra_zmq.sync import Update
from rudra_zmq.update import Updater
from rudra_zmq.wire import Kind

N = 1001
SPLIT = [0, 400, 401, N]  # uneven pieces, one of a single element


def _frames(code, x):
    """``x`` (float32) in wire format ``code``, as the read-only frames a receiver gets, and
    the float32 values they stand for."""
    if code == "f4":
        h = x
    elif code == "f2":
        h = x.astype(np.float16)
    else:
        h = np.empty(x.shape[0], np.uint16)
        oracles.narrow_bf16(h, x)
    pieces = [h[a:b] for a, b in zip(SPLIT, SPLIT[1:])]
    msg = wire.decode(
        wire.encode(Kind.PUSH, 0, 1, payloads=pieces), numel=x.shape[0], model_dtype=code
    )
    widened = h.astype(np.float32) if code != "bf16" else oracles.bf16_to_f32(h)
    return msg.payloads, widened


def _vector(seed=0, n=N):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_float32_frames_are_views_of_the_vector_not_copies():
    v = _vector()
    frames = codec.FLOAT32.encode(v, 1024)  # 256 floats a frame
    assert [f.shape[0] for f in frames] == [256, 256, 256, 233]
    assert all(np.shares_memory(f, v) for f in frames)
    np.testing.assert_array_equal(np.concatenate(frames), v)
    assert codec.of(small_config()) is codec.FLOAT32 and codec.FLOAT32.code == "f4"
    with pytest.raises(ValueError, match="encodes float32 vectors, got float64"):
        codec.FLOAT32.encode(v.astype(np.float64), 1024)


@pytest.mark.parametrize("code", wire.MODEL_DTYPES)
def test_load_widens_frames_of_every_model_dtype_at_their_offsets(code):
    frames, want = _frames(code, _vector())
    out = np.full(N, np.nan, np.float32)
    codec.load(out, frames)
    np.testing.assert_array_equal(out, want)  # widening is exact


@pytest.mark.parametrize("code", wire.MODEL_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_add_sums_scaled_frames_of_every_model_dtype_in_place(code, scale):
    frames, g = _frames(code, _vector(1))
    acc = _vector(2)
    want = acc + np.float32(scale) * g
    codec.add(acc, frames, scale)
    np.testing.assert_allclose(acc, want, rtol=2e-6, atol=2e-6)
    if scale == 1.0:
        np.testing.assert_array_equal(acc, want)


def test_floats_hands_back_float32_frames_themselves_and_nothing_for_halves():
    f4, _ = _frames("f4", _vector())
    assert all(a is b for a, b in zip(codec.floats(f4), f4))
    assert codec.floats(_frames("f2", _vector())[0]) is None
    assert codec.floats(_frames("bf16", _vector())[0]) is None


def test_a_piece_of_another_dtype_is_refused_naming_it():
    acc = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="payload of dtype float64"):
        codec.add(acc, [np.ones(4)])
    with pytest.raises(ValueError, match="payload of dtype int64"):
        codec.load(acc, [np.ones(4, np.int64)])
    assert not acc.any()


def _updater():
    segments = [(0, 300, 1.0, 1.0), (300, N, 2.0, 0.0)]  # per-layer multipliers
    opt = OptimizerConfig(lr=0.1, momentum=0.9, weight_decay=0.004)
    return Updater(_vector(3), segments, opt)


def _update(learners):
    return Update(
        timestamp=1,
        learners=tuple(learners),
        timestamps=(0,) * len(learners),
        sigmas=(0,) * len(learners),
        mean_sigma=0.0,
        lr=0.1,
        g_scale=1 / len(learners),
        epoch=0.1,
    )


@pytest.mark.parametrize("code", ["f2", "bf16"])
def test_the_update_takes_half_frames_as_the_float32_values_they_stand_for(code):
    """Bit for bit the update from float32 frames holding the widened values: for one message
    that makes the update alone (read from acc, not the frames) and for a sum of two."""
    for learners in ([0], [0, 1]):
        half, f32 = _updater(), _updater()
        for i in learners:
            frames, g = _frames(code, _vector(10 + i))
            done = _update(learners) if i == learners[-1] else None
            half.receive(frames, 1.0, done)
            f32.receive(_frames("f4", g)[0], 1.0, done)
        np.testing.assert_array_equal(half.w, f32.w)
        np.testing.assert_array_equal(half.v, f32.v)
        assert not half.acc.any() and not f32.acc.any()


def test_float32_frames_that_make_the_update_alone_are_read_in_place(monkeypatch):
    """Zero-copy as before the codec: no pass over acc when one float32 message is the whole
    update; a half-precision one is decoded into acc first."""
    calls = []
    real_add = codec.add
    monkeypatch.setattr(update.codec, "add", lambda *a: (calls.append(a[1]), real_add(*a)))
    u = _updater()
    u.receive(_frames("f4", _vector(4))[0], 1.0, _update([0]))
    assert calls == []
    u.receive(_frames("f2", _vector(4))[0], 1.0, _update([0]))
    assert len(calls) == 1


@pytest.mark.parametrize("code", ["f2", "bf16"])
def test_a_tree_node_sums_half_frames_and_float32_slots_alike(code):
    cfg = small_config(
        "sync.protocol=hardsync",
        "sync.learners=4",
        "architecture.kind=adv",
        "architecture.fanout=2",
    )
    st = NodeState(cfg, 0)
    for i in (0, 1):
        st.register(
            str(i).encode(), wire.decode(wire.encode(Kind.HELLO, i, 1, model="sig", numel=N))
        )
    st.clock.timestamp = 0
    frames, a = _frames(code, _vector(5))
    b = _vector(6)  # a float32 shared-memory slot
    for i, pieces in ((0, frames), (1, [b])):
        msg = wire.decode(wire.encode(Kind.PUSHPULL, i, 1, 0, 0, [np.zeros(N, np.float32)]))
        st.add(str(i).encode(), msg, st.entries(msg), pieces)
    buf, _ = st.take_relay()
    np.testing.assert_array_equal(buf, a + b)
