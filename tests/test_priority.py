"""Weights before forward needs them (``wire.priority``, ``learner/priority.py``): the parts
backward finished go lowest offset first, at most ``depth`` per connection in libzmq's
hands, the request's last one sent without x{more}; the next forward runs a layer once its
parts are in. Hardsync ends with the very weights of ``wire.priority=false`` (K = 1, 2, 4);
a bad value stops at the config in one line."""

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq
from torch import nn

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.channel import Channel
from rudra_zmq.config import load_config
from rudra_zmq.flat import FlatModel
from rudra_zmq.learner.priority import EarlyWeights, PriorityPush
from rudra_zmq.shape import ClusterShape
from rudra_zmq.typed_yaml import ConfigError
from rudra_zmq.wire import Kind
from test_buckets import spy_instances
from test_shards import initial_weights, run_sharded, weights_of


class Tracker:
    def __init__(self):
        self.done = False


class FakeChannel:
    """What ``PriorityPush`` asks of a channel: its sends, each with a tracker."""

    def __init__(self, log, k):
        self.log, self.k, self.trackers = log, k, []

    def send_part(self, frames, track=False):
        self.log.append((self.k, frames, "more"))
        self.trackers.append(Tracker())
        return self.trackers[-1]

    def send_final(self, i, track=False):
        self.log.append((self.k, i, "last"))
        self.trackers.append(Tracker())
        return self.trackers[-1]


def test_ready_parts_go_lowest_first_at_most_depth_in_flight_and_the_last_sent_ends_it():
    log = []
    chans = [FakeChannel(log, 0)]
    push = PriorityPush(chans, [5], lambda k: (list(range(5)), [lambda: None] * 5), depth=2)
    push.begin([0])
    calls = push.calls()[0]
    for i in (4, 3, 2):  # backward: the last layers first
        calls[i]()
    assert log == [(0, 4, "more"), (0, 3, "more")]  # two in libzmq's hands, 2 held here
    calls[1]()
    calls[0]()  # the first layers' parts overtake part 2
    assert push.pump() and len(log) == 2  # nothing taken whole yet: nothing more goes
    chans[0].trackers[0].done = True
    push.pump()
    assert log[2] == (0, 0, "more")
    for t in chans[0].trackers:
        t.done = True
    push.pump()
    assert log[3] == (0, 1, "more")
    for t in chans[0].trackers:
        t.done = True
    assert not push.pump()
    assert log[4:] == [(0, 2, "last")]  # the one sent last carries no x{more}


def test_the_final_part_waits_until_backward_finished_every_part():
    log = []
    push = PriorityPush(
        [FakeChannel(log, 0)], [3], lambda k: (list(range(3)), [lambda: None] * 3), depth=4
    )
    push.begin([0])
    calls = push.calls()[0]
    calls[0]()
    calls[2]()
    assert [x[2] for x in log] == ["more", "more"]  # part 1 not finished: none is last
    calls[1]()
    assert log[-1] == (0, 1, "last")


def test_a_server_that_said_stop_while_forward_settled_is_sent_nothing():
    """The calls are made before backward, from the servers then training; the forward
    settles the previous replies, where server 1 says STOP, and the request begins again
    without it: its parts finished by backward are not sent (KeyError before)."""
    log = []
    chans = [FakeChannel(log, 0), FakeChannel(log, 1)]
    push = PriorityPush(chans, [2, 2], lambda k: (list(range(2)), [lambda: None] * 2))
    push.begin([0, 1])
    calls = push.calls()
    push.begin([0])  # the forward's settle: server 1 finished training
    for k in (1, 0):
        for i in (1, 0):
            calls[k][i]()
    assert log == [(0, 1, "more"), (0, 0, "last")]


def test_a_forward_waits_for_no_part_of_a_server_that_finished_training():
    """Two servers, striped (every layer on both); server 1 said STOP, so the request went
    to server 0 alone: once server 0's reply is in, the forward runs (before: it waited for
    server 1's parts for ever, test_restart_from_learners K2 striped with priority on)."""
    flat = flat_model()
    cfg = load_config(None, ["sync.protocol=hardsync", "wire.parts=2", "architecture.servers=2"])
    shape = ClusterShape.of(cfg).sized(flat.numel)
    polls = []

    def poll(_ms):
        polls.append(1)
        assert len(polls) < 50, "the forward waits for a server that was sent nothing"
        early.server_in(0)

    early = EarlyWeights(flat, shape, poll, lambda: None)
    early.expect([0])
    flat.module(torch.zeros(1, 6))
    assert all(early.loaded) and len(polls) >= 1
    early.close()


def test_a_resend_sends_the_parts_sent_and_those_not_sent_yet_go_once_after_it(ctx):
    """The server restarts with a request half sent (the connection drops and comes back):
    the channel sends again the parts it had sent, in the order sent, and the parts not sent
    yet (backward still on them, or in ``PriorityPush``'s queue) then go once, the last one
    without x{more}: no part reaches the new server twice, none before backward finished it
    (a half codec narrows a part when it is handed to libzmq)."""
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    server.setsockopt(zmq.RCVTIMEO, 10_000)
    ch = Channel(ctx, f"tcp://127.0.0.1:{port}", 3, timeout_ms=20_000, retry_ms=60_000)
    grad = np.arange(8, dtype=np.float32)
    parts = [(at, [grad[at : at + 2]]) for at in range(0, 8, 2)]
    fills = [lambda: None] * 4  # float32 views: nothing to fill
    push = PriorityPush(
        [ch], [4], lambda k: (ch.parts(Kind.PUSHPULL, 0, parts, grad, last=-1), fills)
    )
    push.begin([0])
    calls = push.calls()[0]
    calls[3]()  # backward: the last layers first
    calls[2]()
    first = [wire.decode(server.recv_multipart()[1:]) for _ in range(2)]
    assert [m.fields["at"] for m in first] == [6, 4]
    back = ctx.socket(zmq.ROUTER)
    back.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        server.close(linger=0)  # the server restarts on the same port
        time.sleep(0.3)  # the channel sees the connection drop
        back.bind(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while ch.resent == 0 and time.monotonic() < deadline:
            ch.tick()  # as the learner's wait for the replies does
            time.sleep(0.01)
        assert ch.resent == 1
        calls[1]()  # backward goes on: the first layers' parts go after the resend
        calls[0]()
        while push.pump():
            time.sleep(0.001)
        got = [wire.decode(back.recv_multipart()[1:]) for _ in range(4)]
        assert [(m.fields["at"], m.fields.get("more", False)) for m in got] == [
            (6, True), (4, True),  # the resend: what had been sent, in the order sent
            (2, True), (0, False),  # the parts not sent before, once; the last ends it
        ]  # fmt: skip
        back.setsockopt(zmq.RCVTIMEO, 300)
        with pytest.raises(zmq.Again):  # and nothing else: no part twice
            back.recv_multipart()
    finally:
        ch.close()
        back.close(linger=0)


def flat_model():
    torch.manual_seed(0)
    return FlatModel(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Linear(4, 3)))


def test_a_layer_runs_once_its_parts_are_in_and_the_root_settles_the_rest():
    flat = flat_model()
    shape = ClusterShape.of(load_config(None, ["sync.protocol=hardsync", "wire.parts=4"]))
    shape = shape.sized(flat.numel)
    events, arrivals = [], iter(range(len(shape.parts)))

    def poll(_ms):  # one part of the reply comes per poll, in layer order
        i = next(arrivals)
        p = shape.parts[i]
        early.arrived(p.server, p.at, p.numel, None)
        events.append(("part", i))

    early = EarlyWeights(flat, shape, poll, lambda: events.append(("settle",)))
    for i, m in enumerate(flat.module):
        m.register_forward_pre_hook(lambda *_, i=i: events.append(("layer", i)))
    early.expect([0])
    flat.module(torch.zeros(1, 6))
    first = flat.layout[0][2]  # the first layer's parameters end here
    needed = [p.index for p in shape.parts if p.lo < first]
    assert events[: len(needed)] == [("part", i) for i in needed]
    assert events[len(needed)] == ("layer", 0)  # before the later parts came
    assert events[-1] == ("settle",) and early.waited >= 1
    early.close()


WIRE_FLOAT16 = ["wire.gradient_dtype=float16", "wire.weights_dtype=float16"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dtype", [[], WIRE_FLOAT16], ids=["float32", "float16"])
def test_hardsync_with_priority_ends_bit_identical_to_without_k_1_2_4(ctx, monkeypatch, dtype):
    """The parts reordered and the forward started on partly arrived replies, the servers
    end with the very weights of ``wire.priority=false``: a layer runs on the version each of
    its parts belongs to, and the sums are per part. On a float16 wire each part is narrowed
    (with its slice of the error feedback) when it is handed to libzmq, after backward
    finished it, as without priority."""
    common = ["sync.protocol=hardsync", "train.epochs=0.25", "wire.parts=3", *dtype]
    early = spy_instances(monkeypatch, EarlyWeights)
    for k in (1, 2, 4):
        off = run_sharded(small_config(*common, "wire.priority=false"), k, ctx)
        assert early == []
        on = run_sharded(small_config(*common, "wire.priority=true"), k, ctx)
        assert len(early) == 2  # each learner's
        # the forwards waited for parts, or ran while replies were still coming
        assert sum(e.waited + e.ran_ahead for e in early) > 0, k
        early.clear()
        steps = {s.state.engine.timestamp for s in off + on}
        assert len(steps) == 1 and steps.pop() > 10, k
        w = weights_of(on)
        assert not np.array_equal(w, initial_weights(small_config(*common))), k  # it trained
        np.testing.assert_array_equal(w, weights_of(off), err_msg=f"K={k}")


def test_a_bad_priority_value_stops_at_the_config_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="wire.priority"):
        load_config(None, ["wire.priority=maybe"])
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", "configs/quickstart.yaml", "--run-dir",
         str(tmp_path / "r"), "--set", "wire.priority=maybe"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode != 0 and not (tmp_path / "r").exists()
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "wire.priority" in res.stderr and "maybe" in res.stderr
