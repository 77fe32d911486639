"""The statistics server: metrics to metrics.jsonl, test error of EVAL weights, the end of a
run, and a client that never blocks training."""
import contextlib
import io
import json
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
from rudra_zmq.config import load_config
from rudra_zmq.datasets import to_float
from rudra_zmq.flat import FlatModel
from rudra_zmq.models import build_model
from rudra_zmq.data_order import load_data
from rudra_zmq.roles.stats_client import METRIC_HWM, StatsClient
from rudra_zmq.roles.stats_server import StatsServer
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
        server = StatsServer(cfg, "tcp://127.0.0.1:0", run_dir, ctx, dataset=dataset, out=out,
                             **kw)
        server.out_text = out.getvalue  # for the tests: what it printed so far
        thread = threading.Thread(
            target=lambda: result.setdefault("reason", server.serve_forever(stop)), daemon=True)
        server.result = result
        server.thread = thread
        thread.start()
        yield server, ctx
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=40)   # a stopped server still draws its plots
            assert not thread.is_alive(), "statistics server thread did not stop"
        ctx.destroy(linger=0)


@contextlib.contextmanager
def client(ctx, endpoint, sender=wire.SENDER_PS):
    c = StatsClient(ctx, endpoint, sender)
    try:
        yield c
    finally:
        c.close(linger_ms=0)


def finish(server, c, timeout=40.0):   # "done" draws the plots: >8 s seen under load
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
    with running_stats(cfg, tmp_path, digits, t0=t0) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
        assert ps.metric({"type": "ps", "t": t0 + 5.0, "ts": 3, "updates_per_s": 1.5,
                          "gradients_per_s": 6.0, "invalid": 0})
        assert ps.metric({"type": "batch", "items": [
            {"type": "update", "t": t0 + 6.0 + k, "ts": k + 1, "epoch": 0.1 * k,
             "mean_sigma": 1.0, "sigmas": [1, 1], "lr": 0.05, "n_grads": 2}
            for k in range(3)]})
        assert ps.metric({"type": "learner", "learner": 0, "step": 4, "samples_per_s": 99.0,
                          "loss": 2.3})  # no "t": stamped with its arrival
        finish(server, ps)
    start, *recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert start == {"type": "start", "t": 0.0, "unix": t0}    # the run's clock, for restarts
    assert [r["type"] for r in recs] == ["ps", "update", "update", "update", "learner", "done"]
    assert [r["t"] for r in recs[:4]] == pytest.approx([5.0, 6.0, 7.0, 8.0])
    assert 99.0 < recs[4]["t"] < 120.0
    assert [r["ts"] for r in recs[1:4]] == [1, 2, 3]
    assert recs[-1]["evals_sent"] == 0
    assert server.records == 6 and server.invalid == 0


def test_eval_gives_chance_error_untrained_and_low_error_after_training(cfg, digits, tmp_path):
    flat = FlatModel(build_model("digits_cnn", 10, digits.shape, seed=cfg.model.seed))
    untrained = oracle_error(flat, digits)
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
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
    server.handle(as_bytes(wire.encode(Kind.METRIC, -1, 4,
                                       metric={"type": "done", "evals_sent": 3})))
    assert server.serve_forever() == "done"  # returns by itself: everything is queued
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "eval"]
    assert [e["ts"] for e in evals] == [3]
    assert server.evals_skipped == 2 and server.evals_done == 1


def test_garbage_messages_are_counted_and_ignored(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
        raw = transport.make_socket(ctx, zmq.PUSH)
        try:
            raw.connect(server.endpoint)
            garbage = [
                [b"\xc1 not msgpack"],
                wire.encode(Kind.PULL, 0, 1, wait=True),                     # wrong kind
                wire.encode(Kind.EVAL, 0, 2, payloads=[np.zeros(7, np.float32)],
                            epoch=1.0),                                      # wrong size
                wire.encode(Kind.METRIC, 0, 3, metric={"no_type": 1}),
                wire.encode(Kind.METRIC, 0, 4, metric={"type": "batch", "items": 5}),
            ]
            for frames in garbage:
                raw.send_multipart(frames)
            wait_for(lambda: server.invalid == len(garbage))
        finally:
            raw.close(linger=0)
        assert ps.metric({"type": "ps", "t": time.time(), "ts": 0, "updates_per_s": 0.0,
                          "gradients_per_s": 0.0, "invalid": 0})
        finish(server, ps)
    assert [r["type"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == ["start", "ps", "done"]
    assert server.invalid == len(garbage) and server.evals_done == 0


def test_done_writes_summary_csv_and_plots_and_returns(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps, client(ctx, server.endpoint, 0) as learner:
        now = time.time()
        learner.metric({"type": "learner", "learner": 0, "t": now, "step": 10,
                        "samples_per_s": 640.0, "loss": 1.0})
        ps.metric({"type": "batch", "items": [
            {"type": "update", "t": now, "ts": k, "epoch": k / 10, "mean_sigma": 2.0,
             "sigmas": [2, 2], "lr": 0.05, "n_grads": 2} for k in range(1, 6)]})
        wait_for(lambda: server.records == 6)  # the eval must come after these
        # The EVAL travels on its own connection: "done" announces it, so the server waits.
        ps.eval_weights(5, 0.5, server.flat.weights.copy())
        finish(server, ps)
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,wall_s,ts,test_error")
    assert len(rows) == 2 and rows[1].startswith("0.5,")
    assert list(tmp_path.glob("*.png"))
    assert f"run directory: {tmp_path}" in server.out_text()
    line = [ln for ln in server.out_text().splitlines() if "test error" in ln][0]
    assert "ts      5" in line and "<σ> 2.00" in line and "samples/s 640" in line


def test_a_stopped_server_still_writes_what_it_has(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
        ps.metric({"type": "ps", "t": time.time(), "ts": 0, "updates_per_s": 1.0,
                   "gradients_per_s": 1.0, "invalid": 0})
        wait_for(lambda: server.records == 1)
    assert server.result["reason"] == "stopped"
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "throughput.png").is_file()


def test_a_diverged_run_is_named_once(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
        bad = np.full_like(server.flat.weights, np.nan)
        ps.eval_weights(1, 0.5, bad)
        wait_for(lambda: server.evals_done == 1)
        ps.eval_weights(2, 1.0, bad)
        wait_for(lambda: server.evals_done == 2)
        assert server.out_text().count("training has diverged") == 1, server.out_text()
        ps.eval_weights(3, 1.5, server.flat.weights.copy())   # finite again: no new warning
        wait_for(lambda: server.evals_done == 3)
        assert server.out_text().count("diverged") == 1
        ps.metric({"type": "learner", "learner": 0, "t": time.time(), "step": 1,
                   "samples_per_s": 1.0, "loss": float("inf")})
        wait_for(lambda: server.records == 4)        # 3 evals, then this one
    # metrics.jsonl stays strict JSON: no NaN/Infinity tokens, null instead
    text = (tmp_path / "metrics.jsonl").read_text()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
            for line in text.splitlines()]
    assert [r["test_loss"] for r in recs if r["type"] == "eval"][:2] == [None, None]
    assert [r["loss"] for r in recs if r["type"] == "learner"] == [None]


class _ClosedPipe(io.StringIO):
    """Progress output whose reader is gone (a SIGKILLed launcher)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_progress_pipe_does_not_stop_the_server(cfg, digits, tmp_path):
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
        server.out = _ClosedPipe()
        ps.eval_weights(1, 0.1, server.flat.weights.copy())
        wait_for(lambda: server.evals_done == 1)      # its progress line hit the closed pipe
        finish(server, ps)
    assert server.out is None
    assert len((tmp_path / "summary.csv").read_text().splitlines()) == 2


def test_big_batches_are_split_and_numpy_values_converted(cfg, digits, tmp_path):
    items = [{"type": "update", "t": time.time(), "ts": k, "epoch": np.float64(k / 1000),
              "mean_sigma": np.float32(1.5), "sigmas": list(np.arange(30)), "lr": 0.05,
              "n_grads": 30} for k in range(2000)]
    with running_stats(cfg, tmp_path, digits) as (server, ctx), \
            client(ctx, server.endpoint) as ps:
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
        sent = sum(c.metric({"type": "learner", "learner": 0, "t": time.time(), "step": i,
                             "samples_per_s": 1.0, "loss": 0.0}) for i in range(1000))
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
    code = ("from rudra_zmq.config import load_config\n"
            "from rudra_zmq.roles.stats_server import serve\n"
            "cfg = load_config(overrides=['data.dataset=digits', 'model.name=digits_cnn'])\n"
            f"raise SystemExit(serve(cfg, 'tcp://127.0.0.1:0', {str(tmp_path)!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("statistics server listening on tcp://127.0.0.1:")
        ctx = zmq.Context()
        try:
            with client(ctx, line.split()[-1]) as ps:
                assert ps.metric({"type": "ps", "t": time.time(), "ts": 0, "invalid": 0,
                                  "updates_per_s": 1.0, "gradients_per_s": 1.0})
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
