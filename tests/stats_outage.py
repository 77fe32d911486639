"""Helpers of the tests of records a server keeps in its files and the statistics server
reads back when their record was lost (``stats/missed_records.py``): a statistics server that
goes down and comes back, a PS restarted, the records of one type a run wrote."""

import contextlib
import io
import json
import threading
import time

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server import ps as ps_module
from rudra_zmq.stats.server import StatsServer
from rudra_zmq.wire import Kind


@contextlib.contextmanager
def stats_up(cfg, bind, run_dir, dataset):
    """A statistics server bound at ``bind``, served by a thread until the block ends."""
    stop = threading.Event()
    server = StatsServer(cfg, bind, run_dir, dataset=dataset, out=io.StringIO())
    thread = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive(), "statistics server thread did not stop"


def records_of(run_dir, kind: str) -> list[dict]:
    """The ``kind`` records in ``run_dir``'s metrics.jsonl (none when there is none)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def restarted_ps(cfg, run_dir, stats):
    """The parameter server of ``run_dir`` restarted (``--resume``), its window for the
    learners' copies over with none come back: it resumes and sends its restart record."""
    server = ps_module.ParameterServer(
        cfg, "tcp://127.0.0.1:0", stats=stats, run_dir=run_dir, resume=True
    )
    server.recovery.first_at = 0.0
    server._recover_if_due()
    return server


def read_then_sent_twice(run_dir, dataset, rec: dict) -> StatsServer:
    """A statistics server of a run of two servers that reads what their files keep, then
    gets ``rec`` (server 1's record of what it kept) twice, and finishes; returned."""
    cfg2 = small_config("architecture.servers=2")
    server = StatsServer(cfg2, "tcp://127.0.0.1:0", run_dir, dataset=dataset, out=io.StringIO())
    stopped = threading.Event()
    stopped.set()
    try:
        server._missed_records(force=True)
        for seq in (1, 2):
            frames = wire.encode(Kind.METRIC, wire.SENDER_PS, seq, metric={**rec, "server": 1})
            server.handle([bytes(f) for f in frames])
    finally:
        server.serve_forever(stopped)  # stopped: it only finishes (and looks once more)
    return server
