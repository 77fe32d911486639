"""What CurveZMQ costs push+pull: round trips per second and their p50 with ``security.curve``
beside plaintext, measured in one run.

For each model size (default 90K, the paper's cifar10_full, and 10M parameters): an async PS
in this process on tcp loopback, driven by ``--learners`` synthetic learner threads (a fixed
gradient, no compute) doing PUSHPULL round trips for ``--seconds`` per arm, in the order
plain, curve, curve, plain (load drift hits both alike). The curve arms use per-run keys made
in a temporary directory (``keys.make_run_keys``), the authenticator and the per-message key
check of a real run. End-to-end training with CURVE: ``rudra-zmq bench train-throughput
--cases default curve``.

Examples::

    rudra-zmq bench curve                 # 90K and 10M, 20 s arms (about 3 minutes)
    rudra-zmq bench curve --quick         # a smoke run (seconds)
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time

import numpy as np
import zmq

from .common import Report, add_output_args, fmt_count, parse_size

SIGNATURE = "bench-curve"


def add_arguments(p) -> None:
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[90_000, 10_000_000],
        help="parameters per model (default: 90K 10M)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per arm (default 20)")
    p.add_argument("--learners", type=int, default=2, help="synthetic learner threads")
    p.add_argument("--quick", action="store_true", help="2 s arms")
    add_output_args(p)


def _config(learners: int):
    from ..config import load_config

    return load_config(
        None,
        [
            "sync.protocol=async",
            f"sync.learners={learners}",
            "train.epochs=1000000000000.0",
            "train.eval_every_epochs=0",
            "train.checkpoint_every_s=0",
            "runtime.learner_timeout_s=0",
        ],
    )


def _learner(ctx, endpoint, i, numel, until, out):
    from .. import wire
    from ..channel import Channel
    from ..wire import Kind

    ch = Channel(ctx, endpoint, i, name="parameter server", timeout_ms=60_000)
    ch.send(Kind.HELLO, model=SIGNATURE, numel=numel)
    ch.recv({Kind.WELCOME}, numel=numel)
    grad = wire.chunk(np.full(numel, 1e-6, np.float32))
    lat = []
    while time.monotonic() < until:  # each reply is dropped at once, releasing its frames
        t0 = time.perf_counter()
        ch.request(Kind.PUSHPULL, 0, grad, numel=numel, reply_kinds={Kind.WEIGHTS, Kind.UPTODATE})
        lat.append(time.perf_counter() - t0)
    out[i] = lat
    ch.close()


def arm(numel: int, curve, seconds: float, learners: int) -> dict:
    """One arm (``curve``: an ``auth.Curve``, or None for plaintext). Blocks."""
    from .. import transport
    from ..server.ps import ParameterServer

    transport.set_security(curve)
    ctx = zmq.Context()
    try:
        w = np.random.default_rng(0).standard_normal(numel).astype(np.float32) * 0.01
        ps = ParameterServer(
            _config(learners),
            "tcp://127.0.0.1:0",
            ctx=ctx,
            model=(w, [(0, numel, 1.0, 1.0)], SIGNATURE),
        )
        stop = threading.Event()
        server = threading.Thread(target=ps.serve_forever, args=(stop,), daemon=True)
        server.start()
        out: dict = {}
        until = time.monotonic() + seconds
        threads = [
            threading.Thread(
                target=_learner, args=(ctx, ps.endpoint, i, numel, until, out), daemon=True
            )
            for i in range(learners)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 120)
        elapsed = time.monotonic() - t0
        stop.set()
        server.join(60)
    finally:
        if curve is not None:
            curve.release(ctx)
        transport.set_security(None)
        ctx.destroy(linger=0)
    lat = [x for v in out.values() for x in v]
    return {"ops_per_s": len(lat) / elapsed, "p50_us": 1e6 * statistics.median(lat)}


def run(args) -> int:
    """Print one line per size: round trips/s and p50, plain and curve, and their ratios."""
    from .. import kernels
    from ..security import auth, keys

    if args.quick:
        args.seconds = 2.0
    kernels.set_num_threads(1)
    rep = Report(
        args,
        "CURVE cost on push+pull",
        notes=[
            f"async PS on tcp loopback, {args.learners} synthetic learner threads (no compute), "
            f"arms of {args.seconds:g} s in the order plain, curve, curve, plain; ratio = curve "
            "/ plain (round trips per second: lower is slower; p50: higher is slower)"
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        keys.make_run_keys(tmp, [f"learner-{i}" for i in range(args.learners)])
        for numel in args.sizes:
            arms = {"plain": [], "curve": []}
            for which in ("plain", "curve", "curve", "plain"):
                curve = auth.Curve(tmp) if which == "curve" else None
                arms[which].append(arm(numel, curve, args.seconds, args.learners))
            r = {"size": numel, "label": fmt_count(numel)}
            for which, runs in arms.items():
                r[f"{which}_ops_per_s"] = statistics.mean(a["ops_per_s"] for a in runs)
                r[f"{which}_p50_us"] = statistics.mean(a["p50_us"] for a in runs)
            r["ops_ratio"] = r["curve_ops_per_s"] / r["plain_ops_per_s"]
            r["p50_ratio"] = r["curve_p50_us"] / r["plain_p50_us"]
            rep.case(
                r,
                f"{r['label']:>5}: plain {r['plain_ops_per_s']:8.1f} round trips/s "
                f"(p50 {r['plain_p50_us']:8.0f} µs), curve {r['curve_ops_per_s']:8.1f}"
                f"/s (p50 {r['curve_p50_us']:8.0f} µs): curve/plain "
                f"{r['ops_ratio']:.3f} round trips/s, {r['p50_ratio']:.3f} p50",
            )
    rep.close()
    return 0
