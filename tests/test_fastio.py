"""The compiled ZeroMQ framing (rudra_zmq.fastio) and the C fronts of wire.encode/decode."""
import gc
import random
import sys

import msgpack
import numpy as np
import pytest
import zmq

from rudra_zmq import fastio, wire
from rudra_zmq.wire import Kind


@pytest.fixture
def pair(ctx):
    """A connected DEALER/ROUTER pair on a random loopback port, through FastSockets."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.RCVTIMEO, 5000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"d0")
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    d, r = fastio.FastSocket(dealer), fastio.FastSocket(router)
    yield d, r
    d.close(linger=0)
    r.close(linger=0)


def test_a_message_crosses_whole_and_frames_expose_their_bytes_without_a_copy(pair):
    d, r = pair
    g = np.arange(100_000, dtype=np.float32)          # zero-copy (>= COPY_THRESHOLD)
    d.send_multipart([b"head", g, b""])
    frames = r.recv_multipart()
    assert [len(f) for f in frames] == [2, 4, g.nbytes, 0]
    assert frames[0].bytes == b"d0" and frames[1].bytes == b"head"
    assert bytes(frames[1]) == b"head" and frames[1].buffer.tobytes() == b"head"
    got = np.frombuffer(frames[2], np.float32)
    assert np.array_equal(got, g) and not got.flags.writeable
    r.send_multipart([frames[0], b"back", got])        # a received frame, sent on zero-copy
    back = d.recv_multipart()
    assert back[0].bytes == b"back" and np.array_equal(np.frombuffer(back[1], np.float32), g)


def test_a_pinned_buffer_outlives_its_last_python_reference(pair):
    d, r = pair
    big = np.full(50_000, 7.0, np.float32)
    refs = sys.getrefcount(big)
    d.send_multipart([big])
    del big                      # only the pin holds the array now, until libzmq is done
    gc.collect()
    frames = r.recv_multipart()
    assert np.all(np.frombuffer(frames[1], np.float32) == 7.0)
    assert d.in_flight == 0      # sent: the pin was dropped
    small = np.ones(10, np.float32)                    # copied, never pinned
    d.send_multipart([small])
    assert not d.pins and sys.getrefcount(small) == refs
    r.recv_multipart()


def test_receive_timeouts_and_closed_sockets_raise_as_pyzmq(pair, ctx):
    d, _ = pair
    with pytest.raises(zmq.Again):
        d.recv_multipart(zmq.NOBLOCK)
    d.sock.setsockopt(zmq.RCVTIMEO, 50)
    with pytest.raises(zmq.Again):
        d.recv_multipart()
    s = ctx.socket(zmq.DEALER)
    f = fastio.FastSocket(s)
    s.close(linger=0)
    with pytest.raises(zmq.ZMQError):
        f.send_multipart([b"x"])


def test_a_refused_send_sends_nothing_and_releases_its_buffers(pair):
    _, r = pair
    big = np.zeros(50_000, np.float32)
    refs = sys.getrefcount(big)
    try:
        r.send_multipart([b"nobody", b"h", big])       # ROUTER_MANDATORY: unknown peer
    except zmq.ZMQError as exc:
        errno = exc.errno                              # (the traceback refers to the frames)
    assert errno == zmq.EHOSTUNREACH
    assert r.in_flight == 0 and sys.getrefcount(big) == refs
    with pytest.raises(ValueError):
        r.send_multipart([])


# ------------------------------------------------------------------ the C fronts of wire.py
_INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33,
         -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]


def _hot_cases(rng, n=600):
    for _ in range(n):
        s, q, ts, inc = (rng.choice(_INTS) for _ in range(4))
        pl = [np.arange(rng.choice([0, 1, 3, 40]), dtype=np.float32)
              for _ in range(rng.choice([1, 2, 15, 16, 64]))]
        x = rng.random()
        if x < 0.4:
            yield Kind.PUSHPULL, s, q, ts, inc, pl, {"wait": rng.random() < 0.5}
        elif x < 0.8:
            f = {"sigma": rng.choice(_INTS)} if rng.random() < 0.5 else {}
            if rng.random() < 0.4:   # the end of a streamed reply (either order)
                parts = rng.choice([0, 1, 7, 4096])
                f = {"parts": parts, **f} if rng.random() < 0.5 else {**f, "parts": parts}
            yield Kind.WEIGHTS, s, q, ts, inc, pl, f
        else:
            yield Kind.WPART, s, q, ts, inc, pl[:1], {"offset": rng.choice(_INTS)}


def test_encode_hot_writes_the_bytes_msgpack_would():
    for kind, s, q, ts, inc, pl, f in _hot_cases(random.Random(1)):
        header = fastio.encode_hot(kind, s, q, ts, inc, pl, f)
        assert header == msgpack.packb(
            {"v": wire.PROTOCOL_VERSION, "k": int(kind), "s": s, "q": q, "ts": ts, "inc": inc,
             "p": [["f4", int(p.shape[0])] for p in pl], "x": f}, use_bin_type=True)
        assert wire.encode(kind, s, q, ts, inc, pl, **f)[0] == header


@pytest.mark.parametrize("kind,payloads,fields", [
    (Kind.PUSH, [np.zeros(3, np.float32)], {}),                      # not a hot kind
    (Kind.PUSHPULL, [np.zeros(3, np.float32)], {"wait": 1}),           # int, not bool
    (Kind.PUSHPULL, [np.zeros(3, np.float32)], {"wait": True, "parts": 1}),
    (Kind.WPART, [np.zeros(3, np.float32)] * 2, {"offset": 0}),        # one payload only
    (Kind.WPART, [np.zeros(3, np.float32)], {"offset": 0, "sigma": 1}),
    (Kind.WEIGHTS, [np.zeros(3, np.float32)], {"wait": True}),
    (Kind.WEIGHTS, [np.zeros(3, np.float32)], {"sigma": True}),        # bool, not int
    (Kind.WEIGHTS, [np.zeros(3, np.float64)], {}),
    (Kind.WEIGHTS, [np.zeros((2, 2), np.float32)], {}),
    (Kind.WEIGHTS, [np.zeros(6, np.float32)[::2]], {}),
    (Kind.WEIGHTS, [memoryview(np.zeros(3, np.float32))], {}),
    (Kind.WEIGHTS, [np.zeros(3, ">f4")], {}),
    (Kind.WEIGHTS, [], {}),
    (Kind.WEIGHTS, [np.zeros(1, np.float32)] * 65, {}),
])
def test_encode_hot_declines_what_is_not_the_hot_shape(kind, payloads, fields):
    assert fastio.encode_hot(kind, 0, 1, 2, 3, payloads, fields) is None
    assert fastio.encode_hot(Kind.WEIGHTS, 2**64, 1, 2, 3, [np.zeros(1, np.float32)], {}) \
        is None


def _general(frames, numel):
    return wire._decode_general(frames, None, numel, None, False, False)


def _same(a, b):
    return ((a.kind, a.sender, a.seq, a.ts, a.inc, a.fields) ==
            (b.kind, b.sender, b.seq, b.ts, b.inc, b.fields)
            and len(a.payloads) == len(b.payloads)
            and all(np.array_equal(x, y) and x.dtype == y.dtype
                    for x, y in zip(a.payloads, b.payloads)))


def test_decode_hot_accepts_exactly_what_the_general_decoder_accepts_the_same_way():
    """On valid hot messages and on thousands of mutations of them (flipped, dropped and
    inserted bytes, wrong sizes): whatever the C front accepts, the Python decoder accepts
    with the same result; whatever it declines goes to the Python decoder anyway."""
    rng = random.Random(7)
    accepted = declined = 0
    for kind, s, q, ts, inc, pl, f in _hot_cases(rng, 300):
        frames = wire.encode(kind, s, q, ts, inc, pl, **f)
        numel = sum(p.shape[0] for p in pl)
        variants = [(frames, numel), (frames, None), (frames, numel + 1)]
        header = bytearray(frames[0])
        for _ in range(12):
            h = bytearray(header)
            op = rng.randrange(4)
            i = rng.randrange(len(h))
            if op == 0:
                h[i] = rng.randrange(256)
            elif op == 1:
                del h[i]
            elif op == 2:
                h.insert(i, rng.randrange(256))
            else:
                h = h[:i]
            variants.append(([bytes(h), *frames[1:]], numel))
        variants.append(([frames[0], *frames[1:-1]], numel))                # a frame short
        variants.append(([frames[0], *frames[1:], b"\0\0\0\0"], numel))    # one too many
        for fr, nm in variants:
            hot = fastio.decode_hot(list(fr), -1 if nm is None else nm)
            try:
                ref = _general(fr, nm)
            except wire.WireError:
                ref = None
            if hot is None or hot[0] != wire.PROTOCOL_VERSION:   # (wire.decode's own check)
                declined += 1
                continue
            accepted += 1
            assert ref is not None, (bytes(fr[0]).hex(), nm)
            assert _same(wire.decode(fr, numel=nm), ref)
            assert hot[1:] == (int(ref.kind), ref.sender, ref.seq, ref.ts, ref.inc, ref.fields)
    assert accepted > 600 and declined > 1000


@pytest.mark.parametrize("header", [
    {"v": 1, "k": 6, "s": 0, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {"wait": False},
     "extra": 1},
    {"v": 1, "k": 6, "s": 0, "q": 1, "ts": 0, "inc": 0, "p": [["f8", 1]], "x": {"wait": False}},
    {"v": 1, "k": 6, "s": 0, "q": 1, "ts": 0.0, "inc": 0, "p": [["f4", 2]], "x": {"wait": False}},
    {"v": 1, "k": 6, "s": True, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {"wait": 0}},
    {"v": 1, "k": 6, "s": 0, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {"slot": 0}},
    {"v": 1, "k": 7, "s": -1, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {"parts": 4097}},
    {"v": 1, "k": 7, "s": -1, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {"board": True}},
    {"v": 1, "k": 19, "s": -1, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 1], ["f4", 1]],
     "x": {"offset": 0}},
    {"v": 1, "k": 19, "s": -1, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {}},
    {"v": 1, "k": 3, "s": 0, "q": 1, "ts": 0, "inc": 0, "p": [["f4", 2]], "x": {}},
    {"v": 1, "k": 7, "s": 0, "q": 1, "ts": 2**64 - 1, "inc": 0, "p": [["f4", 2]], "x": {}},
])
def test_decode_hot_declines_headers_outside_the_hot_shape(header):
    raw = msgpack.packb(header, use_bin_type=True)
    assert fastio.decode_hot([raw, np.zeros(2, np.float32).tobytes()], 2) is None


def test_a_wrong_protocol_version_is_refused_by_the_general_path():
    raw = msgpack.packb({"v": 99, "k": 7, "s": -1, "q": 1, "ts": 3, "inc": 5,
                         "p": [["f4", 2]], "x": {}}, use_bin_type=True)
    frames = [raw, np.zeros(2, np.float32).tobytes()]
    assert fastio.decode_hot(frames, 2)[0] == 99          # the front reads it...
    with pytest.raises(wire.WireError) as exc:             # ...decode still refuses it
        wire.decode(frames, numel=2)
    assert exc.value.code == "version"
