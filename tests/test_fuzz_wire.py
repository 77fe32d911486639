"""Fuzzing the wire protocol and the parameter server's request handling (Hypothesis).

What it proves for random and mutated messages (derandomized: every CI run is the same):

1. ``wire.decode`` raises nothing but ``WireError`` for arbitrary frames, and for valid
   messages of every Kind with a mutated header (bit flips, truncation, values replaced by
   random msgpack objects, huge or negative payload counts, keys dropped or added) or mutated
   payload frames (dropped, duplicated, truncated, extended, inserted). What it accepts is
   well formed (kind, field types, dtype and count per frame as declared) and its payloads
   are views of the frames that arrived: nothing copied.
2. ``ParameterServer.handle`` never raises for such frames from random routing ids; a refused
   message changes nothing (weights, momentum, sum, timestamp, registrations, liveness) and
   each reply to those unknown peers is counted as undelivered (ROUTER_MANDATORY).
3. A registered learner's PUSH/PUSHPULL made invalid (size, dtype, sender, connection,
   incarnation, replayed seq, timestamp, kind, shm slot) is refused and leaves the state
   bit-identical; the same message unmutated is applied, once.
4. 10,000 frames, and headers declaring huge payloads or containers, are refused without
   allocating what they declare (tracemalloc).
"""

import dataclasses
import logging
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.wire import Kind, WireError

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
N, SIG = 16, "sig"
MODEL = {Kind.WELCOME, Kind.PUSH, Kind.PUSHPULL, Kind.WEIGHTS, Kind.EVAL, Kind.RELAY}
REQUESTS = [Kind.HELLO, Kind.PUSH, Kind.PULL, Kind.PUSHPULL, Kind.BYE, Kind.RELAY]
I64 = st.integers(-(2**63), 2**63 - 1)
ANY_INT = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([2**62, 2**64 - 1, -(2**63), -1, 0])
MSGPACK = st.recursive(  # anything msgpack carries (map keys the decoder refuses included)
    st.none()
    | st.booleans()
    | ANY_INT
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=3),
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(
            st.text(max_size=4) | st.binary(max_size=1) | st.integers(-2, 2), kids, max_size=4
        )
    ),
    max_leaves=16,
)
HEADER_KEYS = ["v", "k", "s", "q", "ts", "inc", "p", "x", "zz", b""]
VALUES = {
    "subtree": st.lists(st.integers(0, 7), min_size=1, max_size=4),
    "clock": st.lists(st.lists(st.integers(0, 7), min_size=2, max_size=2), min_size=1, max_size=4),
    "slot": st.sampled_from([0, 1]),
    "at": st.integers(0, 20),  # a part's first element (wire.parts): numel is drawn to fit
    str: st.text(max_size=12),
    int: I64,
    bool: st.booleans(),
    list: st.lists(st.integers(0, 99), max_size=4),
    dict: st.dictionaries(st.text(max_size=6), st.floats(), max_size=3),
}
PART_FIELDS = {"at", "more"}
PS_VALUES = {"model": st.sampled_from([SIG, "other"]), "numel": st.sampled_from([N, N - 1])}


@st.composite
def valid(draw, kinds=tuple(Kind), ps=False):
    """(frames, decode kwargs) of a message ``decode`` accepts; ``ps``: aimed at the PS."""
    kind = draw(st.sampled_from(kinds))
    fields = {
        name: draw(
            PS_VALUES[name]
            if ps and name in PS_VALUES
            else VALUES[name]
            if name in VALUES
            else VALUES.get(types[0], st.floats() | I64)
        )
        for name, (types, required) in wire.KIND_FIELDS[kind].items()
        if required or (draw(st.booleans()) and not (ps and name in PART_FIELDS))
    }
    counts = []
    if kind in MODEL and not ("slot" in fields or fields.get("board") is True):
        cuts = sorted(draw(st.lists(st.integers(0, N), max_size=2)))
        counts = (
            np.diff([0, *cuts, N]).tolist()
            if ps
            else draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
        )
    payloads = [np.arange(c, dtype=np.float32) for c in counts] + {
        Kind.BCAST: [np.zeros(draw(st.integers(0, 12)), np.float32)],
        Kind.BATCH: [np.zeros(draw(st.integers(0, 40)), np.uint8), np.zeros(2, np.int64)],
    }.get(kind, [])
    head = [
        draw(st.sampled_from([0, 1, 2, -1, wire.node_sender(0)]) if ps else I64),
        *(draw(st.sampled_from([0, 1, -1]) if ps else I64) for _ in range(3)),
    ]
    frames = wire.encode(kind, *head[:3], 0 if ps else head[3], payloads, **fields)
    ids = [e[0] for e in fields.get("clock", [])] + fields.get("subtree", [])
    low = max([len(ids), *(i + 1 for i in ids)], default=1)
    numel = sum(counts)
    if PART_FIELDS & fields.keys():  # a part: elements at.. of a vector, more to come or not
        numel += fields.get("at", 0)
        if fields.get("more"):
            numel += draw(st.integers(0, 3)) if sum(counts) else -1  # (-1: none fits)
    kw = dict(
        kinds=draw(st.none() | st.sets(st.sampled_from(list(Kind))).map({kind}.union)),
        numel=numel if counts and numel >= 0 and draw(st.booleans()) else None,
        learners=draw(st.none() | st.integers(low, low + 3)),
        slots="slot" in fields or draw(st.booleans()),
    )
    return [bytes(memoryview(f)) for f in frames], kw


OPS = [
    "flip",
    "cut",
    "set",
    "drop",
    "descr",
    "field",
    "drop_frame",
    "dup_frame",
    "cut_frame",
    "grow_frame",
    "new_frame",
]


@st.composite
def mutated(draw, base):
    """``base`` with 1..3 mutations of its header bytes, header values or payload frames."""
    frames, kw = draw(base)
    head, body = frames[0], frames[1:]
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=3)):
        i = draw(st.integers(0, max(len(body) - 1, 0)))
        new = draw(MSGPACK if op in ("set", "field") else st.binary(max_size=64))
        if op == "new_frame" or (op.endswith("_frame") and not body):
            body.insert(i, new)
        elif op in ("drop_frame", "dup_frame"):
            body[i : i + 1] = [] if op == "drop_frame" else [body[i]] * 2
        elif op in ("cut_frame", "grow_frame"):
            body[i] = body[i][: len(body[i]) // 2] if op == "cut_frame" else body[i] + b"!" + new
        elif op in ("flip", "cut"):
            j = draw(st.integers(0, max(len(head) - 1, 0)))
            head = (
                head[:j]
                if op == "cut" or not head
                else head[:j] + bytes([head[j] ^ (1 << draw(st.integers(0, 7)))]) + head[j + 1 :]
            )
        else:
            try:
                h = msgpack.unpackb(head, raw=False, strict_map_key=False)
            except Exception:  # not msgpack any more
                continue
            if not isinstance(h, dict) or (op == "field" and not isinstance(h.get("x"), dict)):
                continue
            key = draw(st.sampled_from([*h, *HEADER_KEYS] if op == "drop" else HEADER_KEYS))
            if op == "drop":
                h.pop(key, None)
            elif op == "set":
                h[key] = new
            elif op == "descr":  # huge, negative, mistyped counts; unknown dtypes
                h["p"] = draw(
                    st.lists(
                        st.tuples(
                            st.sampled_from(["f4", "u1", "i8", "f8", "", 4, None]),
                            ANY_INT | MSGPACK,
                        ).map(list),
                        max_size=4,
                    )
                )
            else:
                h["x"][
                    draw(
                        st.sampled_from(
                            [*h["x"], "slot", "board", "clock", "subtree", "numel", "zz"]
                        )
                    )
                ] = new
            head = msgpack.packb(h, use_bin_type=True)
    return [head, *body], kw


RANDOM = st.tuples(st.lists(st.binary(max_size=4096), max_size=8), st.just({}))
RANDOM_HEADER = st.tuples(
    st.tuples(
        st.dictionaries(st.sampled_from(HEADER_KEYS), MSGPACK).map(msgpack.packb),
        st.lists(st.binary(max_size=256), max_size=4),
    ).map(lambda t: [t[0], *t[1]]),
    st.just({}),
)


def anything(base):
    return RANDOM | RANDOM_HEADER | base | mutated(base) | mutated(base)


def check_decode(frames, **kw):
    """decode raises only WireError; what it accepts is well formed and views the frames."""
    try:
        msg = wire.decode(frames, **kw)
    except WireError as exc:
        assert isinstance(exc.code, str) and exc.code
        return None
    buf = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]  # Frames: writable
    descr, spec = msgpack.unpackb(buf[0]).get("p", []), wire.KIND_FIELDS[msg.kind]
    assert isinstance(msg.kind, Kind) and msg.kind in (kw.get("kinds") or Kind)
    assert all(type(v) is int for v in (msg.sender, msg.seq, msg.ts, msg.inc))
    assert all(n in spec and type(v) in spec[n][0] for n, v in msg.fields.items())
    assert all(n in msg.fields for n, (_, required) in spec.items() if required)
    assert len(msg.payloads) == len(frames) - 1 == len(descr)
    for arr, b, (code, count) in zip(msg.payloads, buf[1:], descr):
        raw = np.frombuffer(b, np.uint8)  # a view of the frame, never a copy
        assert arr.ndim == 1 and arr.dtype == wire.PAYLOAD_DTYPES[code] and arr.size == count
        assert arr.nbytes == raw.nbytes and (arr.nbytes == 0 or np.shares_memory(arr, raw))
        assert code == "f4" or msg.kind not in MODEL | {Kind.BCAST}
        assert arr.flags.writeable == raw.flags.writeable
    if kw.get("numel") is not None and msg.kind in MODEL and not msg.in_shm:
        at, more = msg.fields.get("at", 0), msg.fields.get("more", False)
        assert at + msg.payload_numel <= kw["numel"] and (
            more or at + msg.payload_numel == kw["numel"]
        )
    return msg


@FUZZ
@given(valid())
def test_valid_messages_of_every_kind_decode_to_views_of_their_frames(case):
    assert check_decode(case[0], **case[1]) is not None  # what the mutations start from


@settings(FUZZ, max_examples=600)
@given(anything(valid()), st.sampled_from([bytes, memoryview, zmq.Frame]))
def test_random_and_mutated_messages_raise_only_wire_error(case, wrap):
    check_decode([wrap(f) for f in case[0]], **case[1])


# ------------------------------------------------------------------ the parameter server
@pytest.fixture(scope="module")
def make_ps():
    """make() -> a fresh in-process PS (async, λ=2, N floats; the previous one is closed)."""
    ctx, made, cfg = zmq.Context(), [], small_config("sync.protocol=async")
    logger = logging.getLogger("rudra_zmq")
    level, _ = logger.level, logger.setLevel(logging.ERROR)  # a warning per reply otherwise

    def make(new=True):
        for ps in made:
            ps.weights_out.close()
            ps.sock.close(linger=0)
        made[:] = (
            [
                ParameterServer(
                    cfg,
                    "tcp://127.0.0.1:0",
                    ctx=ctx,
                    model=(np.linspace(-1, 1, N, dtype=np.float32), [(0, N, 1.0, 1.0)], SIG),
                )
            ]
            if new
            else []
        )
        return made[0] if new else None

    yield make
    make(new=False)
    ctx.destroy(linger=0)
    logger.setLevel(level)


def snapshot(ps):
    """Everything a refused message must leave alone (the weights first)."""
    s, e, u = ps.state, ps.state.engine, ps.state.updater
    return (
        s.w.tobytes(),
        u.v.tobytes(),
        u.acc.tobytes(),
        e.timestamp,
        e.gradients_received,
        dict(s.identities),
        dict(s.applied),
        dict(s.steps),
        set(e.members),
        set(s.stopped),
        s.done,
        set(s.last_heard),
        sorted(ps.weights_out.waiting),
        list(s.welcomes),
    )


def handle(ps, ident, frames):
    """ps.handle must not raise; returns whether it refused the message."""
    before = dataclasses.replace(ps.state.counters)
    ps.handle([ident, *frames])
    c = ps.state.counters
    assert c.sent - before.sent == c.undelivered - before.undelivered  # no peer is connected
    return c.invalid > before.invalid


@settings(FUZZ, max_examples=300)
@given(
    st.lists(
        st.tuples(st.binary(max_size=8), anything(valid(REQUESTS, ps=True))),
        min_size=1,
        max_size=4,
        unique_by=lambda m: m[0],
    )
)
def test_the_ps_never_raises_and_refused_messages_change_nothing(make_ps, msgs):
    ps = make_ps()
    weights = snapshot(ps)[:5]
    for ident, (frames, _) in msgs:  # distinct connections: no gradient can be accepted
        before = snapshot(ps)
        if handle(ps, ident, frames):
            assert snapshot(ps) == before
    assert snapshot(ps)[:5] == weights


MUTATIONS = {  # each alone makes a registered learner's gradient invalid
    "numel": st.integers(0, 2 * N).filter(lambda n: n != N),
    "dtype": st.just(None),
    "sender": I64.filter(lambda s: s != 0),
    "inc": I64.filter(lambda i: i != 0),
    "ident": st.binary(max_size=8).filter(lambda b: b != b"L0"),
    "seq": st.integers(-(2**63), 10),  # not newer than the HELLO's seq 10: a replay
    "ts": st.integers(1, 2**63 - 1) | st.integers(-(2**63), -1),
    "slot": st.sampled_from([0, 1]),
    "kind": st.sampled_from([Kind.RELAY, Kind.BATCH_REQ]),
}


@settings(FUZZ, max_examples=200)
@given(
    st.sampled_from([Kind.PUSH, Kind.PUSHPULL]),
    st.integers(0, 2**32 - 1),
    st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True),
    st.data(),
)
def test_invalid_gradients_of_a_registered_learner_leave_the_weights_bit_identical(
    make_ps, kind, seed, mutations, data
):
    ps = make_ps()
    assert not handle(ps, b"L0", wire.encode(Kind.HELLO, 0, 10, model=SIG, numel=N))
    g = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    m = {
        "kind": kind,
        "sender": 0,
        "seq": data.draw(st.integers(11, 2**63 - 1)),
        "ts": 0,
        "inc": data.draw(st.sampled_from([0, ps.state.incarnation])),
        "payloads": [g],
    }
    good = wire.encode(**{**m, "payloads": wire.chunk(g, data.draw(st.integers(4, 4 * N)))})
    ident = b"L0"
    for mut in mutations:
        new = data.draw(MUTATIONS[mut])
        if mut == "numel":
            m["payloads"] = [np.resize(g, new)]
        elif mut == "dtype":  # the same bytes described as u1 or i8
            m["payloads"] = [
                p.view(np.int64 if p.nbytes % 8 == 0 else np.uint8) for p in m["payloads"]
            ]
        elif mut == "ident":
            ident = new  # another connection
        elif mut == "inc" and new == ps.state.incarnation:
            m["inc"] = -new
        elif mut == "kind":  # learners do not relay, nor ask a PS for batches
            m = {
                **{k: m[k] for k in ("sender", "seq", "ts", "inc", "payloads")},
                "kind": new,
                **({"clock": [[0, 0]]} if new == Kind.RELAY else {"step": 0}),
            }
        elif mut != "slot" or m["kind"] in (Kind.PUSH, Kind.PUSHPULL):
            m[mut] = new  # slot: this PS has no shared-memory slots
    before = snapshot(ps)
    assert handle(ps, ident, wire.encode(**m)) and snapshot(ps) == before
    # the message unmutated is applied, and once only (a resend is answered, not applied)
    assert not handle(ps, b"L0", good) and ps.state.engine.timestamp == 1
    after = snapshot(ps)
    assert after[0] != before[0]
    assert not handle(ps, b"L0", good) and snapshot(ps)[:5] == after[:5]


# ------------------------------------------------------------------ bounded allocation
def _header(kind=Kind.PUSH, **over):
    return msgpack.packb(
        {
            "v": wire.PROTOCOL_VERSION,
            "k": int(kind),
            "s": 0,
            "q": 1,
            "ts": 0,
            "inc": 0,
            "p": [["f4", 1]],
            "x": {},
            **over,
        }
    )


@pytest.mark.parametrize(
    "frames",
    [
        [_header(p=[["f4", 0]] * 10_000), *[b""] * 10_000],  # > MAX_FRAMES
        [_header(), *[b"\0\0\0\0"] * 10_000],  # more frames than said
        [_header(p=[["f4", 2**62]]), b"\0\0\0\0"],  # huge declared payloads
        [
            _header(
                Kind.BATCH,
                p=[["u1", 2**64 - 1], ["i8", 2**60]],
                x={"shape": [1], "epoch": 0, "step": 0},
            ),
            b"\0",
            b"",
        ],
        [_header(p=[["f4", 2**40]] * 3), b"", b"", b""],
        [b"\xdd\xff\xff\xff\xff"],
        [b"\xdf\xff\xff\xff\xff"],  # array/map of 2**32 items
        [b"\xdb\xff\xff\xff\xff" + b"a" * 100],
        [b"\xc6\xff\xff\xff\xff"],  # str, bin of 4 GiB
    ],
    ids=[
        "10k-frames",
        "10k-extra",
        "f4-2^62",
        "batch-2^64",
        "3x2^40",
        "arr32",
        "map32",
        "str32",
        "bin32",
    ],
)
def test_many_frames_and_huge_declared_sizes_are_refused_without_allocating(frames):
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(WireError):
            wire.decode(frames, numel=1)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # 1 MiB, plus the header's own Python objects: msgpack makes <= ~64 B of them per header
    # byte (10,000 ["f4", 0] descriptors: 1.4 MB; so does a valid 16,384-entry RELAY clock)
    assert peak < (1 << 20) + 32 * len(frames[0])


# ------------------------------------------------------------------ bugs found by the fuzzer
def _nested(kind=Kind.PUSH, **over):  # "@@" becomes a list nested 1020 deep (1 KiB)
    return _header(kind, **over).replace(b"\xa2@@", b"\x91" * 1020 + b"\x01")


@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb({**msgpack.unpackb(_header()), "zz": 1, b"": 1}),  # sorted() TypeError
        _nested(v="@@"),
        _nested(p=["@@"]),
        _nested(p={"a": "@@"}),  # repr() RecursionError
        _nested(Kind.RELAY, x={"clock": ["@@"]}),  # (msgpack nests 1023 deep)
        _nested(Kind.HELLO, p=[], x={"model": SIG, "numel": N, "subtree": [0, "@@"]}),
    ],
    ids=[
        "str-and-bytes-keys",
        "nested-v",
        "nested-descriptor",
        "nested-p-map",
        "nested-clock-entry",
        "nested-subtree",
    ],
)
def test_headers_that_crashed_decode_are_refused(make_ps, raw):
    with pytest.raises(WireError):
        wire.decode([raw, b"\0\0\0\0"])
    assert handle(make_ps(), b"x", [raw, b"\0\0\0\0"])  # any other exception stops the PS


def test_a_refused_hello_does_not_count_as_hearing_from_that_learner(make_ps):
    ps = make_ps()
    assert handle(ps, b"x", wire.encode(Kind.HELLO, 1, 1, model="other", numel=N))
    assert handle(ps, b"y", wire.encode(Kind.HELLO, 10**9, 1, model=SIG, numel=N))
    assert ps.state.last_heard == {}  # a spoofed HELLO would keep a dead learner alive


def test_an_error_reply_is_a_message_the_peer_can_decode(make_ps):
    ps, sent = make_ps(), []
    # refusals are sent by the PS's request path (serving.py)
    ps.serving.send = lambda ident, kind, payloads=(), **f: sent.append(
        wire.encode(kind, -1, 1, **f)
    )
    for v in ([0] * 30_000, "\x00" * 16_384):  # 16-30 KiB headers, refused
        ps.handle([b"x", msgpack.packb({"v": v})])
    assert len(sent) == 2
    for frames in sent:  # today: 66-90 KiB ERROR headers, refused as header_too_large
        wire.decode(frames)
