"""The parameter server's at-most-once updates and restarts from checkpoints, with its
learners as threads of this process: a replayed gradient, and 20 crash/restart cycles in one
run (the PS stopped between two messages without a final checkpoint, as after a SIGKILL)."""

import threading
import time

import numpy as np
import pytest
import zmq

from cluster import FakeLearner, running, small_config
from rudra_zmq import transport, wire
from rudra_zmq.data.server import DataServer
from rudra_zmq.learner.learner import Learner
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(120)


def test_a_replayed_pushpull_is_applied_once_and_answered_each_time(ctx):
    ps = ParameterServer(small_config("sync.protocol=async"), "tcp://127.0.0.1:0", ctx=ctx)
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.state.signature, ps.state.numel)
        g = np.ones(ps.state.numel, np.float32)
        frames = wire.encode(Kind.PUSHPULL, 0, a.seq + 1, 0, 0, [g])
        for _ in range(3):  # the captured message, three times
            a.send_raw(frames)
            r = a.recv()
            assert (r.kind, r.ts, r.fields["re"], r.fields["sigma"]) == (
                Kind.WEIGHTS,
                1,
                a.seq + 1,
                0,
            )
        a.close()  # no ROUTER_HANDOVER: its routing id is free once its connection is gone
        time.sleep(0.2)
        b = FakeLearner(ctx, ps.endpoint, 0)  # a new connection, same routing id
        b.send_raw(frames)
        assert b.recv().ts == 1
        b.send_raw(wire.encode(Kind.PUSHPULL, 0, a.seq, 0, 0, [g]))  # older
        r = b.recv()
        assert r.kind == Kind.ERROR and "replayed" in r.fields["error"]
        push = wire.encode(Kind.PUSH, 0, a.seq + 2, 1, 0, [g])  # a plain PUSH, three times
        for _ in range(3):
            b.send_raw(push)
            r = b.recv()
            assert (r.kind, r.fields["re"], r.fields["sigma"]) == (Kind.ACK, a.seq + 2, 0)
        b.close()
    assert not errors
    assert ps.state.engine.timestamp == 2 and ps.state.engine.gradients_received == 2
    assert ps.state.counters.duplicates == 6  # resends and replays, applied or not


def start_ps(cfg, endpoint, run_dir, ctx, resume):
    """A PS on ``endpoint``, which the previous one (in this process) may still hold for a
    moment: ZeroMQ closes sockets in its I/O thread."""
    for _ in range(100):
        try:
            return ParameterServer(cfg, endpoint, run_dir=run_dir, ctx=ctx, resume=resume)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.02)
    raise AssertionError(f"{endpoint} stayed in use")


def test_twenty_ps_crashes_in_one_run_lose_at_most_the_updates_since_each_checkpoint(tmp_path, ctx):
    """async, λ=2, a checkpoint every 3 updates; the PS is stopped without its final
    checkpoint 20 times, each time after >= 5 updates, and restarted with --resume."""
    every = 3
    cfg = small_config(
        "sync.protocol=async",
        "train.epochs=1.2",
        "runtime.retry_s=0.1",
        f"train.checkpoint_every_updates={every}",
        "train.checkpoint_every_s=0",
        "runtime.learner_timeout_s=0",
    )
    ps_ep, data_ep = transport.free_tcp_endpoint(), transport.free_tcp_endpoint()
    data = DataServer(cfg, data_ep, ctx)
    stop_data, failed, errors = threading.Event(), threading.Event(), []
    data_thread = threading.Thread(target=data.serve_forever, args=(stop_data,), daemon=True)
    data_thread.start()

    def learn(i):
        try:
            Learner(cfg, i, ps_ep, data_ep, None, ctx).run(stop_event=failed)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    learners = [threading.Thread(target=learn, args=(i,), daemon=True) for i in range(2)]
    lost, since, reported = [], [], []
    crashed_at = 0  # each crash's timestamp, read by the next cycle
    try:
        for t in learners:
            t.start()
        for cycle in range(21):
            ps = start_ps(cfg, ps_ep, tmp_path, ctx, resume=cycle > 0)
            start = ps.state.engine.timestamp
            if cycle:
                lost.append(crashed_at - start)
                assert ps.state.incarnations[-1] == ps.state.incarnation
            stop = threading.Event()
            server = threading.Thread(target=ps.serve_forever, args=(stop,), daemon=True)
            server.start()
            deadline = time.time() + 30
            while cycle < 20 and ps.state.engine.timestamp < start + 5:
                assert time.time() < deadline and not errors, errors
                time.sleep(0.005)
            schedule = ps.checkpoints
            if cycle < 20:
                ps.checkpoints = None  # a crash: no final checkpoint
                stop.set()
            server.join(60)
            assert not server.is_alive()
            crashed_at = ps.state.engine.timestamp
            since.append(crashed_at - schedule.last_ts)
            reported.append(ps.state.counters.lost_updates)
        for t in learners:
            t.join(30)
        assert not errors, errors
    finally:
        failed.set()
        stop_data.set()
        data_thread.join(10)
    st = ps.state
    assert st.done and len(st.incarnations) == 21
    assert lost == since[:20], (lost, since)  # exactly what the newest checkpoint lacked
    assert sum(lost) < 20 * (every + 3), lost  # a checkpoint every 3 (+ a few after the crash)
    assert reported[-1] <= sum(lost)  # learners saw at most that
    assert st.engine.updates == st.engine.timestamp == st.engine.gradients_received
    assert np.isfinite(st.w).all() and np.isfinite(st.updater.v).all()
