"""The wire protocol: round trips, chunking, and refusal of malformed messages."""

import msgpack
import numpy as np
import pytest

from rudra_zmq import wire
from rudra_zmq.wire import Kind, WireError


def roundtrip(frames, **kw):
    return wire.decode([bytes(memoryview(f)) for f in frames], **kw)


def test_push_roundtrip_keeps_header_and_payload_without_pickle():
    g = np.arange(10, dtype=np.float32)
    frames = wire.encode(Kind.PUSH, 3, 17, ts=5, inc=99, payloads=[g])
    assert len(frames) == 2 and frames[1] is g  # payload travels as is (zero-copy)
    msg = roundtrip(frames, kinds={Kind.PUSH}, numel=10)
    assert (msg.kind, msg.sender, msg.seq, msg.ts, msg.inc) == (Kind.PUSH, 3, 17, 5, 99)
    np.testing.assert_array_equal(msg.payloads[0], g)
    assert not msg.payloads[0].flags.writeable


def test_chunked_payload_adds_up_to_the_model_and_chunks_are_views():
    g = np.arange(1000, dtype=np.float32)
    parts = wire.chunk(g, max_bytes=1024)
    assert [p.shape[0] for p in parts] == [256, 256, 256, 232]
    assert all(np.shares_memory(p, g) for p in parts)
    msg = roundtrip(wire.encode(Kind.WEIGHTS, -1, 1, payloads=parts), numel=1000)
    np.testing.assert_array_equal(np.concatenate(msg.payloads), g)


def test_batch_carries_images_and_labels():
    x = np.zeros(2 * 3 * 4 * 4, np.uint8)
    y = np.array([1, 2], np.int64)
    msg = roundtrip(
        wire.encode(Kind.BATCH, -2, 1, payloads=[x, y], shape=[2, 3, 4, 4], epoch=0.5, step=3)
    )
    assert msg.fields == {"shape": [2, 3, 4, 4], "epoch": 0.5, "step": 3}
    assert msg.payloads[1].dtype == np.int64


def header(**over):
    h = {
        "v": wire.PROTOCOL_VERSION,
        "k": int(Kind.PUSH),
        "s": 0,
        "q": 1,
        "ts": 0,
        "inc": 0,
        "p": [["f4", 4]],
        "x": {},
    }
    h.update(over)
    return msgpack.packb(h)


GOOD_PAYLOAD = np.zeros(4, np.float32).tobytes()


@pytest.mark.parametrize(
    "frames,code,match",
    [
        ([], "empty", "empty message"),
        ([b"\xc1garbage", GOOD_PAYLOAD], "bad_header", "not valid msgpack"),
        ([msgpack.packb([1, 2]), GOOD_PAYLOAD], "bad_header", "must be a map"),
        ([header(v=99), GOOD_PAYLOAD], "version", "protocol version 99"),
        ([header(k=77), GOOD_PAYLOAD], "bad_kind", "unknown message kind 77"),
        ([header(ts="5"), GOOD_PAYLOAD], "bad_header", "'ts' must be an integer"),
        ([header(ts=True), GOOD_PAYLOAD], "bad_header", "'ts' must be an integer"),
        ([header(zz=1), GOOD_PAYLOAD], "bad_header", "unknown header fields"),
        ([header(), GOOD_PAYLOAD[:-1]], "bad_length", "has 15 bytes, its header says 4 x f4"),
        ([header(p=[["f8", 2]]), GOOD_PAYLOAD], "bad_payload", "descriptor"),
        ([header(p=[["u1", 16]]), GOOD_PAYLOAD], "bad_dtype", "its payloads are f4"),
        ([header(p=[]), GOOD_PAYLOAD], "bad_payload", "describes 0 payload frames but 1"),
        ([header(p=[])], "bad_payload", "carries 1..4096 payload frames, got 0"),
        ([header(x={"wait": True}), GOOD_PAYLOAD], "bad_field", "PUSH has no field 'wait'"),
        (
            [header(k=int(Kind.PULL), p=[], x={"wait": True})],
            "bad_field",
            "PULL has no field 'wait'",
        ),
        (
            [header(v=6, k=int(Kind.PUSHPULL)), GOOD_PAYLOAD],
            "version",
            "protocol version 6 is not 9",
        ),  # a learner from before parts: it would take a part ahead for the whole reply
        (
            [header(k=int(Kind.RECEIPT), p=[], x={"re": 1})],
            "bad_field",
            "RECEIPT",
        ),  # a receipt must say whether the request arrived
        (
            [header(k=int(Kind.RELAY), x={"clock": "x"}), GOOD_PAYLOAD],
            "bad_field",
            "field 'clock' has type str",
        ),
        ([header(k=int(Kind.RELAY), x={}), GOOD_PAYLOAD], "bad_field", "missing field 'clock'"),
        ([b"\x00" * (wire.MAX_HEADER_BYTES + 1)], "header_too_large", "exceeds"),
    ],
)
def test_malformed_messages_are_refused_with_a_named_reason(frames, code, match):
    with pytest.raises(WireError, match=match) as exc:
        wire.decode(frames)
    assert exc.value.code == code


def test_model_size_mismatch_names_both_sizes():
    g = np.zeros(89_570, np.float32)
    with pytest.raises(WireError, match="carries 89,570 floats; the model has 89,578"):
        roundtrip(wire.encode(Kind.PUSH, 7, 1, payloads=[g]), numel=89_578)


def test_unexpected_kind_for_this_receiver_is_refused():
    with pytest.raises(WireError, match="BATCH_REQ is not accepted here"):
        roundtrip(wire.encode(Kind.BATCH_REQ, 0, 1, step=0), kinds={Kind.PUSH, Kind.PULL})


def test_msgpack_bombs_are_bounded():
    with pytest.raises(WireError, match="not valid msgpack"):
        wire.decode([msgpack.packb({"v": 1, "x": {"metric": {str(i): i for i in range(300)}}})])


def test_encode_refuses_fields_the_kind_does_not_have():
    with pytest.raises(ValueError, match="PUSH has no field 'sigma'"):
        wire.encode(Kind.PUSH, 0, 1, sigma=3)
    with pytest.raises(ValueError, match="1-D contiguous"):
        wire.encode(Kind.PUSH, 0, 1, payloads=[np.zeros(3, np.float64)])


@pytest.mark.parametrize("code", wire.MODEL_DTYPES)
@pytest.mark.parametrize("kind", [Kind.WEIGHTS, Kind.PUSH])
def test_model_payloads_are_checked_against_the_runs_dtype(code, kind):
    """Weights against ``dtypes.weights``, gradients against ``dtypes.gradients``: a run may
    send float16 gradients and float32 weights (or the other way round)."""
    arr = np.arange(6).astype(wire.PAYLOAD_DTYPES[code])
    frames = wire.encode(kind, wire.SENDER_PS, 1, payloads=[arr[:4], arr[4:]])
    side = "weights" if kind == Kind.WEIGHTS else "gradients"
    run = wire.ModelDtypes(**{side: code})
    msg = wire.decode(frames, numel=6, dtypes=run)
    assert [p.dtype for p in msg.payloads] == [wire.PAYLOAD_DTYPES[code]] * 2
    np.testing.assert_array_equal(np.concatenate(msg.payloads), arr)
    for other in set(wire.MODEL_DTYPES) - {code}:
        with pytest.raises(
            WireError, match=f"its payloads are {other} in this run, payload 0 is {code}"
        ) as exc:
            wire.decode(frames, numel=6, dtypes=wire.ModelDtypes(**{side: other}))
        assert exc.value.code == "bad_dtype"
        # the other side's dtype does not matter to this kind
        other_side = "gradients" if side == "weights" else "weights"
        wire.decode(frames, numel=6, dtypes=wire.ModelDtypes(**{side: code, other_side: other}))
    if code != "f4":  # a run says nothing: float32
        with pytest.raises(WireError, match="its payloads are f4"):
            wire.decode(frames, numel=6)


def test_eval_weights_are_float32_whatever_the_wire():
    """EVAL carries the PS's master weights to the statistics server: never narrowed."""
    half = wire.ModelDtypes("f2", "f2")
    f4 = wire.encode(Kind.EVAL, wire.SENDER_PS, 1, payloads=[np.zeros(6, np.float32)], epoch=1.0)
    wire.decode(f4, numel=6, dtypes=half)
    f2 = wire.encode(Kind.EVAL, wire.SENDER_PS, 1, payloads=[np.zeros(6, np.float16)], epoch=1.0)
    with pytest.raises(WireError, match="EVAL: its payloads are f4"):
        wire.decode(f2, numel=6, dtypes=half)


def test_an_unknown_model_dtype_is_a_programming_error():
    with pytest.raises(ValueError, match="gradients dtype 'f8' is not one of"):
        wire.ModelDtypes("f8")
    with pytest.raises(TypeError, match="dtypes must be a wire.ModelDtypes"):
        wire.decode([header(), GOOD_PAYLOAD], dtypes="f4")


def test_a_part_carries_its_own_floats_anywhere_in_the_vector_and_never_past_its_end():
    g = np.zeros(12, np.float32)
    ok = [
        wire.encode(Kind.PUSHPULL, 0, 1, payloads=[g[:3]], at=0, more=True),
        wire.encode(Kind.PUSHPULL, 0, 1, payloads=[g[9:]], at=9),
        wire.encode(Kind.PUSHPULL, 0, 1, payloads=[g[:3]], at=0),  # part 0, sent last
        wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[4:]], at=4),
        wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[:4]], at=0),  # the rest: elements 0-3
        wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[:0]], at=12),  # everything went ahead
        wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[4:8]], at=4, more=True, re=3),
    ]
    for frames in ok:
        m = roundtrip(frames, numel=12)
        assert m.fields["at"] + m.payload_numel <= len(g)
    bad = [
        (wire.encode(Kind.PUSHPULL, 0, 1, payloads=[g[6:]], at=9, more=True), "6 floats at 9"),
        (wire.encode(Kind.PUSHPULL, 0, 1, payloads=[g[:4]], at=10), "4 floats at 10"),
        (wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[:0]], at=12, more=True), "0 floats at 12"),
        (wire.encode(Kind.WEIGHTS, -1, 1, payloads=[g[:3]], at=-3), "floats at -3"),
    ]
    for frames, says in bad:
        with pytest.raises(WireError, match=says + ".*another model config or wire.parts"):
            roundtrip(frames, numel=12)
