"""The statistics server: metrics to metrics.jsonl, test error of EVAL weights, the end of a
run, and a client that never blocks training."""

import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from rudra_zmq import transport, wire
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.data.data_order import load_data
from rudra_zmq.data.datasets import to_float
from rudra_zmq.flat import FlatModel
from rudra_zmq.models import build_model
from rudra_zmq.stats import run_end
from rudra_zmq.stats.client import METRIC_HWM, StatsClient
from rudra_zmq.stats.progress import Progress, duration
from rudra_zmq.stats.server import StatsServer
from rudra_zmq.stats.tensorboard_log import MISSING, check_tensorboard
from rudra_zmq.wire import Kind


@pytest.fixture(scope="module")
def cfg():
    return load_config(overrides=["data.dataset=digits", "model.name=digits_cnn"])


@pytest.fixture(scope="module")
def digits(cfg):
    return load_data(cfg)


@contextlib.contextmanager
def running_stats(cfg, run_dir, dataset, **kw):
    """A StatsServer on a random loopback port, served by a background thread."""
    ctx = zmq.Context()
    stop = threading.Event()
    out = io.StringIO()
    result = {}
    thread = None
    try:
        server = StatsServer(cfg, "tcp://127.0.0.1:0", run_dir, ctx, dataset=dataset, out=out, **kw)
        server.out_text = out.getvalue  # for the tests: what it printed so far
        thread = threading.Thread(
            target=lambda: result.setdefault("reason", server.serve_forever(stop)), daemon=True
        )
        server.result = result
        server.thread = thread
        thread.start()
        yield server, ctx
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=40)  # a stopped server still draws its plots
            assert not thread.is_alive(), "statistics server thread did not stop"
        ctx.destroy(linger=0)


@contextlib.contextmanager
def client(ctx, endpoint, sender=wire.SENDER_PS):
    c = StatsClient(ctx, endpoint, sender)
    try:
        yield c
    finally:
        c.close(linger_ms=0)


def finish(server, c, timeout=40.0):  # "done" draws the plots: >8 s seen under load
    """Send "done" and wait for the server to return by itself."""
    assert c.metric({"type": "done", "t": time.time()})
    server.thread.join(timeout)
    assert server.result.get("reason") == "done", "the server did not finish on 'done'"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(cond, timeout=20.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.01)


def oracle_error(flat, ds):
    """The test error of ``flat``'s weights, computed here as the oracle."""
    with torch.no_grad():
        out = flat.module(to_float(ds.x_test, ds.mean, ds.std))
    return int((out.argmax(1) != torch.from_numpy(ds.y_test)).sum()) / len(ds.y_test)


def test_metrics_end_up_in_metrics_jsonl_with_times_relative_to_t0(cfg, digits, tmp_path):
    t0 = time.time() - 100.0
    with (
        running_stats(cfg, tmp_path, digits, t0=t0) as (server, ctx),
        client(ctx, server.endpoint) as ps,
    ):
        assert ps.metric(
            {
                "type": "ps",
                "t": t0 + 5.0,
                "ts": 3,
                "updates_per_s": 1.5,
                "gradients_per_s": 6.0,
                "invalid": 0,
            }
        )
        assert ps.metric(
            {
                "type": "batch",
                "items": [
                    {
                        "type": "update",
                        "t": t0 + 6.0 + k,
                        "ts": k + 1,
                        "epoch": 0.1 * k,
                        "mean_sigma": 1.0,
                        "sigmas": [1, 1],
                        "lr": 0.05,
                        "n_grads": 2,
                    }
                    for k in range(3)
                ],
            }
        )
        assert ps.metric(
            {"type": "learner", "learner": 0, "step": 4, "samples_per_s": 99.0, "loss": 2.3}
        )  # no "t": stamped with its arrival
        finish(server, ps)
    start, *recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert start == {"type": "start", "t": 0.0, "unix": t0}  # the run's clock, for restarts
    assert [r["type"] for r in recs] == ["ps", "update", "update", "update", "learner", "done"]
    assert [r["t"] for r in recs[:4]] == pytest.approx([5.0, 6.0, 7.0, 8.0])
    assert 99.0 < recs[4]["t"] < 120.0
    assert [r["ts"] for r in recs[1:4]] == [1, 2, 3]
    assert recs[-1]["evals_sent"] == 0
    assert server.records == 6 and server.invalid == 0


def test_eval_gives_chance_error_untrained_and_low_error_after_training(cfg, digits, tmp_path):
    flat = FlatModel(build_model("digits_cnn", 10, digits.shape, seed=cfg.model.seed))
    untrained = oracle_error(flat, digits)
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        assert ps.eval_weights(0, 0.0, flat.weights.copy())
        wait_for(lambda: server.evals_done == 1)  # else the newer EVAL could replace it
        # A few hundred quick SGD steps on the training split.
        gen = torch.Generator().manual_seed(0)
        x_all = to_float(digits.x_train, digits.mean, digits.std)
        y_all = torch.from_numpy(digits.y_train)
        opt = torch.optim.SGD(flat.module.parameters(), lr=0.05, momentum=0.9)
        for _ in range(300):
            idx = torch.randint(0, len(y_all), (32,), generator=gen)
            flat.zero_grad()
            torch.nn.functional.cross_entropy(flat.module(x_all[idx]), y_all[idx]).backward()
            opt.step()
        trained = oracle_error(flat, digits)
        assert ps.eval_weights(300, 6.7, flat.weights.copy(), chunk_bytes=4096)  # chunked
        finish(server, ps)
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "eval"]
    assert [(e["ts"], e["epoch"]) for e in evals] == [(0, 0.0), (300, 6.7)]
    assert evals[0]["test_error"] == pytest.approx(untrained, abs=1e-9)
    assert evals[0]["test_error"] > 0.7 and evals[0]["test_loss"] > 2.0
    assert evals[1]["test_error"] == pytest.approx(trained, abs=1e-9)
    assert evals[1]["test_error"] < 0.15 and evals[1]["test_loss"] < 0.5
    assert all(0 <= e["t"] < 30 for e in evals)
    assert "test error" in server.out_text() and "run directory:" in server.out_text()


def as_bytes(frames):
    return [bytes(memoryview(f)) for f in frames]


def test_only_the_newest_of_queued_evals_is_evaluated(cfg, digits, tmp_path):
    server = StatsServer(cfg, "tcp://127.0.0.1:0", tmp_path, dataset=digits, out=io.StringIO())
    w = server.flat.weights.copy()
    for ts in (1, 2, 3):
        server.handle(as_bytes(wire.encode(Kind.EVAL, -1, ts, ts=ts, payloads=[w], epoch=0.5)))
    server.handle(
        as_bytes(wire.encode(Kind.METRIC, -1, 4, metric={"type": "done", "evals_sent": 3}))
    )
    assert server.serve_forever() == "done"  # returns by itself: everything is queued
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "eval"]
    assert [e["ts"] for e in evals] == [3]
    assert server.evals_skipped == 2 and server.evals_done == 1


def test_garbage_messages_are_counted_and_ignored(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        raw = transport.make_socket(ctx, zmq.PUSH)
        try:
            raw.connect(server.endpoint)
            garbage = [
                [b"\xc1 not msgpack"],
                wire.encode(Kind.PULL, 0, 1),  # wrong kind
                wire.encode(
                    Kind.EVAL, 0, 2, payloads=[np.zeros(7, np.float32)], epoch=1.0
                ),  # wrong size
                wire.encode(Kind.METRIC, 0, 3, metric={"no_type": 1}),
                wire.encode(Kind.METRIC, 0, 4, metric={"type": "batch", "items": 5}),
            ]
            for frames in garbage:
                raw.send_multipart(frames)
            wait_for(lambda: server.invalid == len(garbage))
        finally:
            raw.close(linger=0)
        assert ps.metric(
            {
                "type": "ps",
                "t": time.time(),
                "ts": 0,
                "updates_per_s": 0.0,
                "gradients_per_s": 0.0,
                "invalid": 0,
            }
        )
        finish(server, ps)
    assert [r["type"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == ["start", "ps", "done"]
    assert server.invalid == len(garbage) and server.evals_done == 0


def test_done_writes_summary_csv_and_plots_and_returns(cfg, digits, tmp_path):
    with (
        running_stats(cfg, tmp_path, digits) as (server, ctx),
        client(ctx, server.endpoint) as ps,
        client(ctx, server.endpoint, 0) as learner,
    ):
        now = time.time()
        learner.metric(
            {
                "type": "learner",
                "learner": 0,
                "t": now,
                "step": 10,
                "samples_per_s": 640.0,
                "loss": 1.0,
            }
        )
        ps.metric(
            {
                "type": "batch",
                "items": [  # 4 x 2 gradients of µ 32 in 0.4 s: 640/s
                    {
                        "type": "update",
                        "t": now + 0.1 * k,
                        "ts": k,
                        "epoch": k / 10,
                        "mean_sigma": 2.0,
                        "sigmas": [2, 2],
                        "lr": 0.05,
                        "n_grads": 2,
                    }
                    for k in range(1, 6)
                ],
            }
        )
        wait_for(lambda: server.records == 6)  # the eval must come after these
        # The EVAL travels on its own connection: "done" announces it, so the server waits.
        ps.eval_weights(5, 0.5, server.flat.weights.copy())
        finish(server, ps)
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,wall_s,ts,test_error")
    assert not (tmp_path / "tensorboard").exists()  # logging.tensorboard is off
    assert len(rows) == 2 and rows[1].startswith("0.5,")
    assert list(tmp_path.glob("*.png"))
    assert f"run directory: {tmp_path}" in server.out_text()
    line = [ln for ln in server.out_text().splitlines() if "test error" in ln][0]
    assert "ts      5" in line and "<σ> 2.00" in line and "samples/s 640" in line


def test_a_stopped_server_still_writes_what_it_has(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        ps.metric(
            {
                "type": "ps",
                "t": time.time(),
                "ts": 0,
                "updates_per_s": 1.0,
                "gradients_per_s": 1.0,
                "invalid": 0,
            }
        )
        wait_for(lambda: server.records == 1)
    assert server.result["reason"] == "stopped"
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "throughput.png").is_file()


def test_a_diverged_run_is_named_once(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        bad = np.full_like(server.flat.weights, np.nan)
        ps.eval_weights(1, 0.5, bad)
        wait_for(lambda: server.evals_done == 1)
        ps.eval_weights(2, 1.0, bad)
        wait_for(lambda: server.evals_done == 2)
        assert server.out_text().count("training has diverged") == 1, server.out_text()
        ps.eval_weights(3, 1.5, server.flat.weights.copy())  # finite again: no new warning
        wait_for(lambda: server.evals_done == 3)
        assert server.out_text().count("diverged") == 1
        ps.metric(
            {
                "type": "learner",
                "learner": 0,
                "t": time.time(),
                "step": 1,
                "samples_per_s": 1.0,
                "loss": float("inf"),
            }
        )
        wait_for(lambda: server.records == 4)  # 3 evals, then this one
    # metrics.jsonl stays strict JSON: no NaN/Infinity tokens, null instead
    text = (tmp_path / "metrics.jsonl").read_text()
    recs = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
        for line in text.splitlines()
    ]
    assert [r["test_loss"] for r in recs if r["type"] == "eval"][:2] == [None, None]
    assert [r["loss"] for r in recs if r["type"] == "learner"] == [None]


class _ClosedPipe(io.StringIO):
    """Progress output whose reader is gone (a SIGKILLed launcher)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_progress_pipe_does_not_stop_the_server(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        server.out = _ClosedPipe()
        ps.eval_weights(1, 0.1, server.flat.weights.copy())
        wait_for(lambda: server.evals_done == 1)  # its progress line hit the closed pipe
        finish(server, ps)
    assert server.out is None
    assert len((tmp_path / "summary.csv").read_text().splitlines()) == 2


def test_big_batches_are_split_and_numpy_values_converted(cfg, digits, tmp_path):
    items = [
        {
            "type": "update",
            "t": time.time(),
            "ts": k,
            "epoch": np.float64(k / 1000),
            "mean_sigma": np.float32(1.5),
            "sigmas": list(np.arange(30)),
            "lr": 0.05,
            "n_grads": 30,
        }
        for k in range(2000)
    ]
    with running_stats(cfg, tmp_path, digits) as (server, ctx), client(ctx, server.endpoint) as ps:
        assert ps.metric({"type": "batch", "items": items})  # > 64 KiB of header: split
        finish(server, ps)
    updates = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "update"]
    assert [u["ts"] for u in updates] == list(range(2000))
    assert updates[7]["mean_sigma"] == 1.5 and updates[7]["sigmas"][-1] == 29


def test_the_client_never_blocks_when_no_server_listens():
    ctx = zmq.Context()
    c = StatsClient(ctx, transport.free_tcp_endpoint(), 0)
    try:
        start = time.time()
        sent = sum(
            c.metric(
                {
                    "type": "learner",
                    "learner": 0,
                    "t": time.time(),
                    "step": i,
                    "samples_per_s": 1.0,
                    "loss": 0.0,
                }
            )
            for i in range(1000)
        )
        w = np.zeros(1 << 20, np.float32)
        evals = sum(c.eval_weights(i, 0.0, w) for i in range(10))
        assert time.time() - start < 1.0
        assert sent <= METRIC_HWM + 10 and c.dropped == 1000 - sent
        assert evals <= 3 and c.evals_dropped == 10 - evals and c.evals_sent == evals
    finally:
        c.close()  # default linger: ctx.term() below waits at most CLOSE_LINGER_MS
        start = time.time()
        ctx.term()
        assert time.time() - start < 2.0


def test_serve_exits_cleanly_on_sigterm_and_writes_what_it_has(tmp_path):
    code = (
        "from rudra_zmq.config import load_config\n"
        "from rudra_zmq.stats.server import serve\n"
        "cfg = load_config(overrides=['data.dataset=digits', 'model.name=digits_cnn'])\n"
        f"raise SystemExit(serve(cfg, 'tcp://127.0.0.1:0', {str(tmp_path)!r}))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("statistics server listening on tcp://127.0.0.1:")
        assert line.rstrip().endswith("(waiting for the parameter server and 4 learners)")
        ctx = zmq.Context()
        try:
            with client(ctx, line.split("listening on ")[1].split()[0]) as ps:
                assert ps.metric(
                    {
                        "type": "ps",
                        "t": time.time(),
                        "ts": 0,
                        "invalid": 0,
                        "updates_per_s": 1.0,
                        "gradients_per_s": 1.0,
                    }
                )
                wait_for(lambda: (tmp_path / "metrics.jsonl").stat().st_size > 0)
        finally:
            ctx.term()
        proc.send_signal(signal.SIGTERM)
        # bounded, not a hang: drawing the plots took over 8 s on a loaded 2-core box
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0
        assert f"run directory: {tmp_path}" in out
        assert (tmp_path / "summary.csv").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ progress lines
def update(t, ts, epoch, sigma=1.0):
    return {
        "type": "update",
        "t": t,
        "ts": ts,
        "epoch": epoch,
        "mean_sigma": sigma,
        "sigmas": [sigma],
        "lr": 0.05,
        "n_grads": 1,
    }


def test_the_progress_line_gives_elapsed_time_and_an_eta_once_training_started():
    p = Progress(epochs=10.0, batch_size=32)
    assert p.evaluated(6.4, 0, 0.0, 0.92, 2.3) == []  # the initial weights: not yet
    started, before = p.update(update(16.5, 1, 0.1))
    assert started == (
        "training started: the parameter server applied its first update after 16.5 s of start-up"
    )
    assert before.startswith("epoch   0.00  ts      0  test error 92.00%")
    assert before.endswith("<σ> -  samples/s -  elapsed 0.0 s  ETA -"), before
    # an evaluation waits for the update records up to its timestamp
    assert p.evaluated(17.0, 2, 0.2, 0.5, 1.0) == []
    (line,) = p.update(update(17.0, 2, 0.2, sigma=3.0))  # 1 gradient of 32 in 0.5 s
    assert line.endswith("<σ> 2.00  samples/s 64  elapsed 0.5 s  ETA 49.0 s"), line
    for ts in range(3, 21):  # 18 gradients in 1.5 s: 384/s
        assert p.update(update(17.0 + (ts - 2) / 12, ts, ts / 20 + 0.1)) == []
    (line,) = p.evaluated(18.5, 20, 1.1, 0.3, 0.8)
    assert line == (
        "epoch   1.10  ts     20  test error 30.00%  loss 0.8000  <σ> 1.00  "
        "samples/s 384  elapsed 2.0 s  ETA 17.8 s"
    )
    p.update(update(200.5, 900, 9.0))  # 8.9 epochs in 184 s: 1 left
    assert p.evaluated(200.5, 900, 9.0, 0.1, 0.3)[0].endswith("elapsed 3m04s  ETA 20.7 s")
    p.update(update(230.0, 1000, 10.2))  # past the end: nothing left
    assert p.evaluated(230.5, 1000, 10.2, 0.1, 0.3)[0].endswith("ETA 0.0 s")
    assert p.evaluated(231.0, 1001, 10.3, 0.1, 0.3) == []  # its updates never came:
    assert p.flush()[0].endswith("<σ> -  samples/s -  elapsed 3m34s  ETA 0.0 s")  # at the end


def test_progress_keeps_a_bounded_number_of_updates_between_lines_and_its_sigma_exact():
    """With evaluations off (or far apart) every update record waited for the next line: a
    long run's worth. The older ones are summed: the line's <σ> is still over every update."""
    p = Progress(epochs=10.0, batch_size=32)
    n = 100_007
    for ts in range(1, n + 1):
        p.update(update(10.0 + ts / 1000, ts, ts / n, sigma=float(ts % 5)))
    assert len(p._updates) < n // 2
    (line,) = p.evaluated(10.0 + n / 1000, n, 1.0, 0.5, 1.0)
    assert f"<σ> {sum(ts % 5 for ts in range(1, n + 1)) / n:.2f}" in line, line


def test_a_resumed_runs_progress_counts_training_time_only():
    """Resumed 600 s after the run began, with 30 s of training before: elapsed goes on from
    30 s, start-up counts from the resume."""
    p = Progress(epochs=10.0, batch_size=32, begun=600.0, trained_s=30.0)
    assert p.evaluated(605.0, 100, 5.0, 0.2, 0.5) == []  # the restored weights
    started, line = p.update(update(612.0, 101, 5.05))
    assert started.endswith("after 12.0 s of start-up")
    assert "elapsed 30.0 s" in line
    p.update(update(614.0, 120, 6.0))
    assert "elapsed 32.0 s" in p.evaluated(614.0, 120, 6.0, 0.1, 0.3)[0]


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.04, 59.94, 60.2, 125, 3599, 3 * 3600 + 7 * 60 + 29)] == [
        "0.0 s",
        "59.9 s",
        "1m00s",
        "2m05s",
        "59m59s",
        "3h07m",
    ]


def test_a_restarted_server_counts_elapsed_time_from_the_runs_training_start(cfg, digits, tmp_path):
    t0 = time.time() - 100.0
    first = StatsServer(
        cfg, "tcp://127.0.0.1:0", tmp_path, dataset=digits, out=io.StringIO(), t0=t0
    )
    first.handle(
        as_bytes(
            wire.encode(
                Kind.METRIC,
                wire.SENDER_PS,
                1,
                metric={
                    "type": "batch",
                    "items": [update(t0 + 16.5, 1, 0.1), update(t0 + 18.5, 2, 1.1)],
                },
            )
        )
    )
    stop = threading.Event()
    stop.set()
    assert first.serve_forever(stop) == "stopped"
    assert "after 16.5 s of start-up" in first.out.getvalue()
    again = StatsServer(cfg, "tcp://127.0.0.1:0", tmp_path, dataset=digits, out=io.StringIO())
    assert again.t0 == t0 and again.progress.started == 16.5
    again.handle(
        as_bytes(
            wire.encode(
                Kind.EVAL, wire.SENDER_PS, 2, ts=2, epoch=1.1, payloads=[again.flat.weights.copy()]
            )
        )
    )
    again.handle(
        as_bytes(
            wire.encode(Kind.METRIC, wire.SENDER_PS, 3, metric={"type": "done", "evals_sent": 1})
        )
    )
    assert again.serve_forever() == "done"
    out = again.out.getvalue()
    assert "training started" not in out  # it had, before the restart
    # ~100 s after the run's start, 16.5 s of it start-up; no update seen since: no rate yet
    assert re.search(r"elapsed 1m2\ds  ETA -\n", out), out


# ------------------------------------------------------------------ TensorBoard
@pytest.fixture(scope="module")
def tb_cfg():
    return load_config(
        overrides=["data.dataset=digits", "model.name=digits_cnn", "logging.tensorboard=true"]
    )


def test_tensorboard_gets_the_scalars_of_metrics_jsonl(tb_cfg, digits, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t0 = time.time() - 100.0
    with (
        running_stats(tb_cfg, tmp_path, digits, t0=t0) as (server, ctx),
        client(ctx, server.endpoint) as ps,
        client(ctx, server.endpoint, 0) as l0,
        client(ctx, server.endpoint, 1) as l1,
    ):
        ps.metric(
            {
                "type": "ps",
                "t": t0 + 5.0,
                "ts": 0,
                "updates_per_s": 0.0,
                "gradients_per_s": 0.0,
                "invalid": 0,
            }
        )  # start-up
        ps.eval_weights(0, 0.0, server.flat.weights.copy())  # the initial weights
        wait_for(lambda: server.evals_done == 1)
        ps.metric(
            {
                "type": "batch",
                "items": [
                    update(t0 + 10.0 + k, k + 1, 0.1 * (k + 1), sigma=0.5 * k) for k in range(4)
                ],
            }
        )
        wait_for(lambda: server.records == 6)
        l0.metric(
            {
                "type": "learner",
                "learner": 0,
                "t": t0 + 11.5,
                "ts": 2,
                "step": 2,
                "samples_per_s": 100.0,
                "loss": 2.0,
            }
        )
        wait_for(lambda: server.records == 7)
        l1.metric(
            {
                "type": "learner",
                "learner": 1,
                "t": t0 + 12.5,
                "ts": 3,
                "step": 3,
                "samples_per_s": 50.0,
                "loss": 2.0,
            }
        )
        ps.metric(
            {
                "type": "ps",
                "t": t0 + 13.0,
                "ts": 4,
                "updates_per_s": 2.0,
                "gradients_per_s": 2.0,
                "invalid": 0,
            }
        )
        ps.metric(
            {
                "type": "members",
                "t": t0 + 13.5,
                "ts": 4,
                "epoch": 0.4,
                "learner": 1,
                "event": "evicted",
                "learners": 3,
                "c": 3,
            }
        )
        wait_for(lambda: server.records == 10)
        ps.eval_weights(4, 0.4, np.zeros_like(server.flat.weights))
        finish(server, ps)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()

    def scalars(tag):
        return [(e.step, pytest.approx(e.value, rel=1e-6), e.wall_time) for e in acc.Scalars(tag)]

    evals = [r for r in recs if r["type"] == "eval"]
    updates = [r for r in recs if r["type"] == "update"]
    assert [s[:2] for s in scalars("test/error")] == [(e["ts"], e["test_error"]) for e in evals]
    assert [s[:2] for s in scalars("test/loss")] == [(e["ts"], e["test_loss"]) for e in evals]
    assert evals[0]["test_error"] != evals[1]["test_error"]
    assert (
        [s[:2] for s in scalars("staleness/mean_sigma")]
        == [(u["ts"], u["mean_sigma"]) for u in updates]
        == [(1, 0.0), (2, 0.5), (3, 1.0), (4, 1.5)]
    )
    assert [s[:2] for s in scalars("throughput/samples_per_s")] == [(2, 100.0), (3, 150.0)]
    assert [s[:2] for s in scalars("throughput/updates_per_s")] == [(0, 0.0), (4, 2.0)]
    assert [s[:2] for s in scalars("sync/learners")] == [(0, 4), (4, 3)]
    # wall time: the record's; what came before training, at its start (the first update)
    start = t0 + 10.0
    assert [s[2] for s in scalars("test/error")] == pytest.approx([start, t0 + evals[1]["t"]])
    assert [s[2] for s in scalars("staleness/mean_sigma")] == pytest.approx(
        [t0 + u["t"] for u in updates]
    )
    assert [s[2] for s in scalars("sync/learners")] == pytest.approx([start, t0 + 13.5])


def test_what_tensorboard_hears_before_training_is_stamped_with_its_start(tmp_path):
    """Once, the newest value of each tag, at the first update's time."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rudra_zmq.stats.tensorboard_log import TensorBoardLog

    tb = TensorBoardLog(tmp_path, t0=1000.0, learners=2)
    for t in (5.0, 6.0, 7.0):  # the PS reports every second during start-up
        tb.record({"type": "ps", "t": t, "ts": 0, "updates_per_s": 0.0})
    tb.record(update(10.0, 1, 0.1))
    # the initial weights' evaluation, written after training started (a long one)
    tb.record({"type": "eval", "t": 6.0, "ts": 0, "test_error": 0.9, "test_loss": 2.3})
    tb.record({"type": "eval", "t": 12.0, "ts": 5, "test_error": 0.5, "test_loss": 1.3})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.wall_time) for e in acc.Scalars("test/error")] == [(0, 1010.0), (5, 1012.0)]
    assert [(e.step, e.wall_time) for e in acc.Scalars("throughput/updates_per_s")] == [(0, 1010.0)]


def test_tensorboard_without_its_package_fails_before_training_and_says_what_to_install(
    tb_cfg, digits, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    with pytest.raises(ConfigError) as err:
        check_tensorboard()
    assert str(err.value).startswith(MISSING)
    assert MISSING == (
        "logging.tensorboard needs the tensorboard package: pip install 'rudra_zmq[tensorboard]'"
    )
    with pytest.raises(ConfigError, match=r"pip install 'rudra_zmq\[tensorboard\]'"):
        StatsServer(
            tb_cfg, "tcp://127.0.0.1:0", tmp_path / "run", dataset=digits, out=io.StringIO()
        )
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


# ------------------------------------------------------------------ the final weights
def _done(server, ts, epoch, seq=9):
    server.handle(
        as_bytes(
            wire.encode(
                Kind.METRIC,
                wire.SENDER_PS,
                seq,
                metric={
                    "type": "done",
                    "t": time.time(),
                    "ts": ts,
                    "epoch": epoch,
                    "evals_sent": 5,
                },
            )
        )
    )


def test_final_weights_whose_eval_never_came_are_evaluated_from_weights_npy(cfg, digits, tmp_path):
    """The PS's final EVAL lost (a statistics server restarted near the end): the server
    evaluates RUN/weights.npy once ps_final.json says it holds the weights at done's ts."""
    server = StatsServer(cfg, "tcp://127.0.0.1:0", tmp_path, dataset=digits, out=io.StringIO())
    w = server.flat.weights.copy()
    server.handle(
        as_bytes(wire.encode(Kind.EVAL, wire.SENDER_PS, 1, ts=3, payloads=[w], epoch=0.5))
    )  # an earlier evaluation arrived
    _done(server, 40, 4.0)
    np.save(tmp_path / "weights.npy", w)
    (tmp_path / "ps_final.json").write_text(
        json.dumps({"timestamp": 40, "epoch": 4.0, "done": True})
    )
    assert server.serve_forever() == "done"
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "eval"]
    assert [(e["ts"], e.get("weights")) for e in evals] == [(3, None), (40, "weights.npy")]
    assert evals[1]["test_error"] == pytest.approx(oracle_error(server.flat, digits), abs=1e-9)
    assert "ts     40  test error" in server.out.getvalue()


def test_a_stale_ps_final_is_not_taken_for_the_final_weights(cfg, digits, tmp_path, monkeypatch):
    """ps_final.json of another timestamp (a run resumed from it): not the final weights;
    after DONE_WAIT_S the server ends without them, saying so in its log."""
    monkeypatch.setattr(run_end, "DONE_WAIT_S", 1.0)
    server = StatsServer(cfg, "tcp://127.0.0.1:0", tmp_path, dataset=digits, out=io.StringIO())
    np.save(tmp_path / "weights.npy", server.flat.weights)
    (tmp_path / "ps_final.json").write_text(
        json.dumps({"timestamp": 20, "epoch": 2.0, "done": True})
    )
    _done(server, 40, 4.0)
    assert server.serve_forever() == "done"
    assert [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "eval"] == []


def test_a_server_started_after_the_ps_ended_evaluates_the_final_weights_and_finishes(
    cfg, digits, tmp_path
):
    """A statistics server (re)started as or after the PS ended never gets its "done":
    RUN/ps_final.json saying training is done (at train.epochs or later) stands for it, and
    the final weights are evaluated from RUN/weights.npy; the metrics record that "done" with
    its source. A ps_final.json at fewer epochs (a
    finished run resumed to train on) is not taken for the end."""
    from rudra_zmq.flat import FlatModel
    from rudra_zmq.models import build_model

    w = FlatModel(
        build_model(cfg.model.name, cfg.data.num_classes, digits.shape, seed=cfg.model.seed)
    ).weights.copy()
    epochs = cfg.train.epochs
    for run, epoch, finishes in (("ended", epochs + 0.02, True), ("resumed", epochs - 1, False)):
        run_dir = tmp_path / run
        run_dir.mkdir()
        np.save(run_dir / "weights.npy", w)
        (run_dir / "ps_final.json").write_text(
            json.dumps({"timestamp": 40, "epoch": epoch, "updates": 40, "done": True})
        )
        with running_stats(cfg, run_dir, digits) as (server, _):
            server.thread.join(30 if finishes else 2.5)
            assert server.result.get("reason") == ("done" if finishes else None), run
        recs = read_jsonl(run_dir / "metrics.jsonl")
        evals = [r for r in recs if r["type"] == "eval"]
        done = [(r["ts"], r["epoch"], r["source"]) for r in recs if r["type"] == "done"]
        assert done == ([(40, epoch, "ps_final.json")] if finishes else []), run
        if finishes:
            assert [(e["ts"], e["epoch"], e["weights"]) for e in evals] == [
                (40, epoch, "weights.npy")
            ]
            assert evals[0]["test_error"] == pytest.approx(
                oracle_error(server.flat, digits), abs=1e-9
            )
        else:
            assert evals == []


@pytest.mark.parametrize(
    "origin, said",
    [
        ("learner 3", "from learner 3's copy of its range"),
        ("tree node 1", "from tree node 1's copy of its range"),
        ("checkpoint", "from checkpoint ck"),
        ("initial", "from the initial weights (no learner held a copy)"),
    ],
)
def test_a_restarts_line_says_whose_copy_the_range_came_from(origin, said):
    r = {"type": "restart", "ts": 7, "incarnation": 2, "from": origin, "checkpoint": "ck"}
    (line,) = Progress(epochs=10.0, batch_size=32).restart({**r, "server": 1, "lost": 0})
    assert line == f"server 1 restarted (incarnation 2) at ts 7 {said}"
