"""What checkpoints cost the parameter server: milliseconds per checkpoint, and its update
throughput with checkpoints every 10 s beside none, measured in one run.

For each model size (default 90K, the paper's cifar10_full, and 10M parameters): the time of
one ``CheckpointSchedule.save`` (snapshot, write, fsync, rename; the median of ``--saves``)
into a temporary directory on the run directory's file system (``--dir``), then an async PS
in this process driven by ``--learners`` synthetic learner threads (no model: a fixed
gradient, no compute) for ``--seconds`` per arm, in the order off, on, on, off. The ratio of
updates/s (on/off) is what a user sees; the expected cost is ms per checkpoint / interval.

Examples::

    rudra-zmq bench checkpoint                   # 90K and 10M, 30 s arms (about 5 minutes)
    rudra-zmq bench checkpoint --quick           # a smoke run (seconds)
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from .common import Report, add_output_args, fmt_count, parse_size

SIGNATURE = "bench-checkpoint"


def add_arguments(p) -> None:
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[90_000, 10_000_000],
        help="parameters per model (default: 90K 10M)",
    )
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per arm (default 30)")
    p.add_argument(
        "--every-s",
        type=float,
        default=10.0,
        help="checkpoint interval of the 'on' arms (default 10)",
    )
    p.add_argument("--learners", type=int, default=2, help="synthetic learner threads")
    p.add_argument("--saves", type=int, default=5, help="checkpoints timed alone per size")
    p.add_argument(
        "--dir",
        default=".",
        help="where the temporary checkpoints go (default: the current directory's file system)",
    )
    p.add_argument("--quick", action="store_true", help="2 s arms, every 0.5 s, 2 saves")
    add_output_args(p)


def _config(every_s: float, learners: int):
    from ..config import load_config

    return load_config(
        None,
        [
            "sync.protocol=async",
            f"sync.learners={learners}",
            "train.epochs=1000000000000.0",
            "train.eval_every_epochs=0",
            f"train.checkpoint_every_s={every_s}",
            "train.checkpoint_every_updates=0",
            "runtime.learner_timeout_s=0",
            "optimizer.momentum=0.9",
        ],
    )


def _model(numel: int):
    w = np.random.default_rng(0).standard_normal(numel).astype(np.float32) * 0.01
    return w, [(0, numel, 1.0, 1.0)], SIGNATURE


def save_ms(numel: int, saves: int, directory: Path) -> list[float]:
    """Milliseconds of ``saves`` checkpoints of a PS state of ``numel`` parameters. Blocks."""
    from ..server.checkpointing import CheckpointSchedule
    from ..server.state import ServerState

    cfg = _config(10.0, 2)
    st = ServerState(cfg, *_model(numel), epoch_size=1000)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        sched = CheckpointSchedule(cfg.train, Path(tmp))
        out = []
        for _ in range(saves):
            t0 = time.perf_counter()
            sched.save(st)
            out.append(1000 * (time.perf_counter() - t0))
    return out


def _learner(ctx, endpoint, i, numel, until, counts):
    from .. import wire
    from ..channel import Channel
    from ..wire import Kind

    ch = Channel(ctx, endpoint, i, name="parameter server", timeout_ms=60_000)
    ch.send(Kind.HELLO, model=SIGNATURE, numel=numel)
    ch.recv({Kind.WELCOME}, numel=numel)
    grad = wire.chunk(np.full(numel, 1e-4, np.float32))
    n = 0
    while time.monotonic() < until:  # each reply is dropped at once, releasing its frames
        ch.request(Kind.PUSHPULL, 0, grad, numel=numel, reply_kinds={Kind.WEIGHTS, Kind.UPTODATE})
        n += 1
    counts[i] = n
    ch.close()


def arm(numel: int, every_s: float, seconds: float, learners: int, directory: Path) -> dict:
    """One arm: an async PS (checkpoints every ``every_s`` s, 0 = none) and ``learners``
    threads pushing for ``seconds``. Returns updates/s and the checkpoints written. Blocks."""
    from ..server.ps import ParameterServer

    cfg = _config(every_s, learners)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ps = ParameterServer(
            cfg, "tcp://127.0.0.1:0", run_dir=tmp if every_s else None, ctx=ctx, model=_model(numel)
        )
        stop = threading.Event()
        server = threading.Thread(target=ps.serve_forever, args=(stop,), daemon=True)
        server.start()
        counts = {}
        until = time.monotonic() + seconds
        threads = [
            threading.Thread(
                target=_learner, args=(ctx, ps.endpoint, i, numel, until, counts), daemon=True
            )
            for i in range(learners)
        ]
        t0, ts0 = time.monotonic(), ps.state.engine.timestamp
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 120)
        elapsed, updates = time.monotonic() - t0, ps.state.engine.timestamp - ts0
        written = ps.checkpoints.written if ps.checkpoints else 0
        spent = ps.checkpoints.seconds if ps.checkpoints else 0.0
        ps.checkpoints = None  # no final checkpoint outside the measured window
        stop.set()
        server.join(60)
    ctx.destroy(linger=0)
    return {
        "updates_per_s": updates / elapsed,
        "checkpoints": written,
        "checkpoint_s": spent,
        "seconds": elapsed,
    }


def run(args) -> int:
    """Print one line per size: ms per checkpoint, updates/s off and on, their ratio."""
    from .. import kernels

    if args.quick:
        args.seconds, args.every_s, args.saves = 2.0, 0.5, 2
    kernels.set_num_threads(1)
    directory = Path(args.dir)
    rep = Report(
        args,
        "checkpoint cost",
        notes=[
            f"async PS, {args.learners} synthetic learner threads (no compute), arms of "
            f"{args.seconds:g} s in the order off, on, on, off; on = a checkpoint every "
            f"{args.every_s:g} s into {directory.resolve()}"
        ],
    )
    for numel in args.sizes:
        ms = save_ms(numel, args.saves, directory)
        arms = {"off": [], "on": []}
        for name in ("off", "on", "on", "off"):
            arms[name].append(
                arm(
                    numel,
                    args.every_s if name == "on" else 0.0,
                    args.seconds,
                    args.learners,
                    directory,
                )
            )
        off = statistics.mean(a["updates_per_s"] for a in arms["off"])
        on = statistics.mean(a["updates_per_s"] for a in arms["on"])
        written = sum(a["checkpoints"] for a in arms["on"])
        in_run_ms = 1000 * sum(a["checkpoint_s"] for a in arms["on"]) / max(written, 1)
        rec = {
            "params": numel,
            "save_ms_median": statistics.median(ms),
            "save_ms_max": max(ms),
            "in_run_ms": in_run_ms,
            "written": written,
            "updates_per_s_off": off,
            "updates_per_s_on": on,
            "ratio": on / off,
            "expected_cost": statistics.median(ms) / 1000 / args.every_s,
        }
        rep.case(
            rec,
            f"{fmt_count(numel):>5} params: {rec['save_ms_median']:8.1f} ms per "
            f"checkpoint alone (max {rec['save_ms_max']:.1f}), {in_run_ms:.1f} ms "
            f"in the run ({written} written); updates/s off {off:9.1f}, on "
            f"{on:9.1f}: on/off {on / off:.3f} (expected cost "
            f"{100 * rec['expected_cost']:.2f} %)",
        )
    rep.close()
    return 0
