"""The servers' one request path (server/serving.py) on its own: a real ServerState, recorded
handlers and replies, no sockets."""

import logging

import msgpack
import numpy as np

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server.serving import Serving
from rudra_zmq.server.state import ServerState
from rudra_zmq.sync import ProtocolViolation
from rudra_zmq.wire import Kind

N, SIG = 12, "sig"


def path(*overrides):
    """(serving, what it did): handlers, replies, STOPs and heard senders recorded in order."""
    from rudra_zmq import codec

    cfg = small_config(*overrides)
    st = ServerState(cfg, np.zeros(N, np.float32), [(0, N, 1.0, 1.0)], SIG, epoch_size=64)
    did = []

    def handler(ident, msg):
        did.append(("handler", msg.kind, msg.sender))
        if msg.kind == Kind.HELLO:
            st.register(ident, msg)
        elif msg.ts < 0:
            raise ProtocolViolation("this handler refuses a pull of a negative timestamp")

    serving = Serving(
        None,
        wire.SENDER_PS,
        st,
        {k: handler for k in (Kind.HELLO, Kind.PUSH, Kind.PUSHPULL, Kind.RELAY, Kind.PULL)},
        send=lambda ident, kind, payloads=(), **f: did.append(("send", kind, f.get("code"))),
        stop=lambda ident, sender, seq: did.append(("stop", sender, seq)),
        learners=st.learners,
        log=logging.getLogger("test_serving"),
        heard=lambda sender, now: did.append(("heard", sender)),
        dtypes=codec.dtypes(cfg),
    )
    return serving, st, did


def request(serving, ident, kind, sender, seq, payloads=(), ts=0, **fields):
    serving.handle([ident, *wire.encode(kind, sender, seq, ts, 0, list(payloads), **fields)])


def test_each_request_is_checked_then_dispatched_and_a_refusal_is_an_error_counted_once():
    serving, st, did = path("sync.learners=2")
    serving.handle([b"a", msgpack.packb({"v": 1})])  # not a header
    request(serving, b"a", Kind.PULL, 0, 1)  # before its HELLO
    request(serving, b"a", Kind.HELLO, 0, 2, model=SIG, numel=N)
    request(serving, b"a", Kind.PULL, 0, 3)
    request(serving, b"b", Kind.PULL, 0, 4)  # another connection
    request(serving, b"a", Kind.PULL, 0, 5, ts=-1)  # the handler refuses it
    assert did == [
        ("send", Kind.ERROR, "bad_header"),
        ("send", Kind.ERROR, "rejoin"),
        ("handler", Kind.HELLO, 0),
        ("heard", 0),
        ("handler", Kind.PULL, 0),
        ("send", Kind.ERROR, "rejoin"),
        ("heard", 0),
        ("handler", Kind.PULL, 0),
        ("send", Kind.ERROR, "protocol"),
    ]
    assert st.counters.invalid == 4


def test_once_training_is_over_a_checked_request_is_told_stop_and_a_hello_still_dispatched():
    serving, st, did = path("sync.learners=2")
    request(serving, b"a", Kind.HELLO, 0, 1, model=SIG, numel=N)
    st.done = True
    request(serving, b"a", Kind.PUSHPULL, 0, 2, [np.ones(N, np.float32)])
    request(serving, b"b", Kind.PULL, 0, 3)  # not checked: refused
    request(serving, b"b", Kind.HELLO, 1, 4, model=SIG, numel=N)
    assert did == [
        ("handler", Kind.HELLO, 0),
        ("heard", 0),
        ("stop", 0, 2),
        ("send", Kind.ERROR, "rejoin"),
        ("handler", Kind.HELLO, 1),
    ]


def test_bye_is_answered_ack_and_marks_the_sender_stopped():
    serving, st, did = path("sync.learners=2")
    request(serving, b"a", Kind.HELLO, 1, 1, model=SIG, numel=N)
    request(serving, b"a", Kind.BYE, 1, 2)
    assert did[-1] == ("send", Kind.ACK, None) and st.stopped == {1}


def test_a_check_is_answered_with_whether_that_request_arrived_and_dispatches_nothing():
    serving, st, did = path("sync.learners=2")
    receipts = []
    serving.send = lambda ident, kind, payloads=(), **f: receipts.append((kind, f))
    request(serving, b"a", Kind.CHECK, 0, 7)  # never got anything from learner 0
    request(serving, b"a", Kind.HELLO, 0, 7, model=SIG, numel=N)
    request(serving, b"a", Kind.CHECK, 0, 7)  # that HELLO
    request(serving, b"a", Kind.CHECK, 0, 8)  # a request that never came (lost on the way)
    request(serving, b"z", Kind.CHECK, 1, 7)  # another learner's: answered, nothing checked
    assert receipts == [
        (Kind.RECEIPT, {"re": 7, "got": False}),
        (Kind.RECEIPT, {"re": 7, "got": True}),
        (Kind.RECEIPT, {"re": 8, "got": False}),
        (Kind.RECEIPT, {"re": 7, "got": False}),
    ]
    assert did == [("handler", Kind.HELLO, 0)] and st.counters.invalid == 0


def test_a_gradient_in_another_wire_dtype_than_the_runs_is_refused_before_any_handler():
    """A learner started with another ``wire.gradient_dtype`` than its server: bad_dtype."""
    serving, st, did = path("sync.learners=2", "wire.gradient_dtype=float16")
    request(serving, b"a", Kind.HELLO, 0, 1, model=SIG, numel=N)
    request(serving, b"a", Kind.PUSHPULL, 0, 2, [np.ones(N, np.float32)])
    request(serving, b"a", Kind.PUSHPULL, 0, 3, [np.ones(N, np.float16)])
    assert did == [
        ("handler", Kind.HELLO, 0),
        ("send", Kind.ERROR, "bad_dtype"),
        ("heard", 0),
        ("handler", Kind.PUSHPULL, 0),
    ]
