"""Test helpers: run rudra_zmq roles in background threads of the test process.

Every helper owns its context and sockets, binds random loopback ports and cleans up.
"""

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import psutil
import zmq

from rudra_zmq import wire
from rudra_zmq.config import load_config
from rudra_zmq.wire import Kind


def small_config(*overrides):
    base = [
        "model.name=mlp",
        "data.dataset=digits",
        "sync.learners=2",
        "sync.batch_size=8",
        "optimizer.lr=0.1",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=0.001",
        "train.epochs=100",
        "train.eval_every_epochs=0",
        "runtime.timeout_s=20",
    ]
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

    def __init__(self, ctx, endpoint, learner_id, timeout_ms=5000, sockopts=None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, str(learner_id).encode())
        for opt, value in (sockopts or {}).items():  # before connect: e.g. a small RCVBUF
            self.sock.setsockopt(opt, value)
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


def kill_during_training(cmd, run_dir, pick, cwd=None, start_timeout=90, stop_timeout=60):
    """Start ``cmd`` (a ``rudra-zmq run ... --run-dir run_dir``), wait until the PS has made an
    update, SIGKILL the process that ``pick(entries of processes.json)`` returns (None: not
    yet, keep waiting), and wait for the run to stop. Returns (exit code, output, victim).

    Blocks up to ``start_timeout + stop_timeout`` seconds; kills the run on every exit path.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd
    )
    try:
        deadline = time.time() + start_timeout
        victim = None
        while time.time() < deadline and victim is None:
            time.sleep(0.5)
            procs, metrics = run_dir / "processes.json", run_dir / "metrics.jsonl"
            if procs.exists() and metrics.exists() and '"update"' in metrics.read_text():
                entries = json.loads(procs.read_text())
                entries = entries if isinstance(entries, list) else entries.get("processes", [])
                victim = pick(entries)
        assert victim is not None, "the run never started training"
        os.kill(victim["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=stop_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, victim


def gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (a zombie awaiting a reaper counts as gone: orphans are
    reaped by pid 1, which in some containers never does)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def weights_difference(reference_dir, other_dir) -> tuple[float, float]:
    """Two finished runs' final weights (``weights.npy``): how far training moved the
    reference from its initial weights, and the other run's difference from the reference,
    both relative (L2). Asserts that training moved the weights, so that a small difference
    means something."""
    from rudra_zmq.server.start import initial_model

    w_ref = np.load(reference_dir / "weights.npy")
    w_other = np.load(other_dir / "weights.npy")
    w0 = initial_model(load_config(other_dir / "config.yaml"))[0]
    moved = np.linalg.norm(w_ref - w0) / np.linalg.norm(w0)
    rel = np.linalg.norm(w_other - w_ref) / np.linalg.norm(w_ref)
    assert moved > 1e-2, "training must move the weights for the comparison to mean anything"
    return moved, rel


def free_port_range(n: int = 3) -> int:
    """The first of ``n`` consecutive ports free on every interface (for roles that listen
    at ports counted up from one base, as `rudra-zmq launch` and `worker` do)."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")
