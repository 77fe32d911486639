"""Test helpers: run rudra_zmq roles in background threads of the test process.

Every helper owns its context and sockets, binds random loopback ports and cleans up.
"""
import contextlib
import threading

import numpy as np
import zmq

from rudra_zmq import wire
from rudra_zmq.config import load_config
from rudra_zmq.wire import Kind


def small_config(*overrides):
    base = ["model.name=mlp", "data.dataset=digits", "sync.learners=2", "sync.batch_size=8",
            "optimizer.lr=0.1", "optimizer.momentum=0.9", "optimizer.weight_decay=0.001",
            "train.epochs=100", "train.eval_every_epochs=0", "runtime.timeout_s=20"]
    return load_config(None, [*base, *overrides])


@contextlib.contextmanager
def running(server, serve_kwargs=None):
    """Run ``server.serve_forever(stop_event)`` in a thread; stop and join on exit."""
    stop = threading.Event()
    errors = []

    def target():
        try:
            server.serve_forever(stop_event=stop, **(serve_kwargs or {}))
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        yield errors
    finally:
        stop.set()
        t.join(10)
        assert not t.is_alive(), "server thread did not stop"


class FakeLearner:
    """A raw DEALER speaking the wire protocol, to poke the PS directly."""

    def __init__(self, ctx, endpoint, learner_id, timeout_ms=5000):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, str(learner_id).encode())
        self.sock.connect(endpoint)
        self.id = learner_id
        self.seq = 0
        self.timeout_ms = timeout_ms

    def send(self, kind, ts=0, payloads=(), **fields):
        self.seq += 1
        self.sock.send_multipart(wire.encode(kind, self.id, self.seq, ts, 0, payloads, **fields))

    def send_raw(self, frames):
        self.sock.send_multipart(frames)

    def recv(self):
        assert self.sock.poll(self.timeout_ms), "no reply from the server"
        return wire.decode(self.sock.recv_multipart())

    def has_reply(self, timeout_ms=200):
        return bool(self.sock.poll(timeout_ms))

    def hello(self, signature, numel):
        self.send(Kind.HELLO, model=signature, numel=numel)
        msg = self.recv()
        assert msg.kind == Kind.WELCOME, msg
        return np.concatenate(msg.payloads), msg.ts

    def close(self):
        self.sock.close(0)
