"""The payload codec: float32 frames are views (no copy), frames of every model dtype decode
into float32 at their offsets, and the PS's update and a tree node's sum take half-precision
frames as the float32 values they stand for; a half wire narrows as configured, with error
feedback on gradients and once per weight version."""

import numpy as np
import pytest

import oracles
from cluster import small_config
from rudra_zmq import codec, wire
from rudra_zmq.config import OptimizerConfig
from rudra_zmq.server import update
from rudra_zmq.server.update import Updater
from rudra_zmq.sync import Update
from rudra_zmq.tree.state import NodeState
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
        wire.encode(Kind.PUSH, 0, 1, payloads=pieces),
        numel=x.shape[0],
        dtypes=wire.ModelDtypes(gradients=code),
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
    cfg = small_config()
    assert codec.for_gradients(cfg) is codec.FLOAT32 and codec.for_weights(cfg) is codec.FLOAT32
    assert codec.FLOAT32.code == "f4" and codec.dtypes(cfg) == wire.FLOAT32
    with pytest.raises(ValueError, match="encodes 1-D float32 vectors, got float64"):
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


@pytest.mark.parametrize("name,code", [("float16", "f2"), ("bfloat16", "bf16")])
def test_a_half_wire_narrows_each_side_as_configured(name, code):
    cfg = small_config(f"wire.gradient_dtype={name}", f"wire.weights_dtype={name}")
    assert codec.dtypes(cfg) == wire.ModelDtypes(code, code)
    g, w = codec.for_gradients(cfg), codec.for_weights(cfg)
    assert (g.code, g.feedback, w.code, w.feedback) == (code, True, code, False)
    v = _vector(7)
    frames = w.encode(v, 512)  # 256 halves a frame: chunked by bytes, as float32 is
    assert [f.shape[0] for f in frames] == [256, 256, 256, 233]
    assert not any(np.shares_memory(f, v) for f in frames)  # v may be written at once
    out = np.empty(N, np.float32)
    codec.load(out, frames)
    np.testing.assert_array_equal(out, _frames(code, v)[1])  # nearest even, as the oracles
    mixed = small_config(f"wire.gradient_dtype={name}")
    assert codec.dtypes(mixed) == wire.ModelDtypes(code, "f4")
    assert codec.for_weights(mixed) is codec.FLOAT32
    off = small_config(f"wire.gradient_dtype={name}", "wire.error_feedback=false")
    assert codec.for_gradients(off).feedback is False


@pytest.mark.parametrize("code", ["f2", "bf16"])
def test_error_feedback_carries_each_rounding_error_into_the_next_gradient(code):
    """What the sender has sent plus what it still holds is exactly what it was given: over
    many steps nothing is lost, where plain narrowing loses the same bias every step."""
    half, plain = codec.Half(code, feedback=True), codec.Half(code)
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(N) * 1e-3).astype(np.float32)
    sent_fb = np.zeros(N, np.float64)
    sent_plain = np.zeros(N, np.float64)
    given = np.zeros(N, np.float64)
    out = np.empty(N, np.float32)
    for _ in range(50):
        g = base  # the same gradient each step: plain narrowing loses the same error 50 times
        given += g
        for c, acc in ((half, sent_fb), (plain, sent_plain)):
            codec.load(out, c.encode(g, 1 << 20))
            acc += out
    # the residual closes the books, to float32 rounding of each step's v - half(v)
    np.testing.assert_allclose(sent_fb + half.residual, given, rtol=0, atol=1e-6)
    err_fb = np.abs(sent_fb - given).max()
    err_plain = np.abs(sent_plain - given).max()
    assert err_fb <= np.abs(half.residual).max() + 1e-6  # at most one step's rounding left
    assert err_fb < err_plain / 10, (err_fb, err_plain)


def test_a_weight_version_sent_to_many_learners_is_narrowed_once():
    c = codec.Half("f2")
    w = _vector(8)
    a = c.encode(w, 1 << 20, key=5)
    assert c.encode(w, 1 << 20, key=5)[0] is a[0]  # the same version: the same buffer
    w2 = w.copy()
    assert c.encode(w2, 1 << 20, key=5)[0] is not a[0]  # another array (a restart)
    w[:] = 0  # a recycled buffer holding the next version: a new key
    b = c.encode(w, 1 << 20, key=6)
    assert b[0] is not a[0] and not b[0].any()
    assert c.encode(w, 1 << 20)[0] is not b[0]  # no key: always narrowed


@pytest.mark.parametrize("value", ["fp16", "half", "float64"])
def test_a_dtype_typo_stops_the_config_naming_the_choices(value):
    from rudra_zmq.typed_yaml import ConfigError

    for key in ("gradient_dtype", "weights_dtype"):
        with pytest.raises(ConfigError, match=f"wire.{key} is '{value}'; expected one of float32"):
            small_config(f"wire.{key}={value}")
