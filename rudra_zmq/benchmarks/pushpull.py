"""``rudra-zmq bench pushpull``: the PS's own path beside an echo server and raw ZeroMQ.

The passive side (``--bind``; :mod:`.pushpull_server`) runs per case a real
:class:`~rudra_zmq.server.ps.ParameterServer` on a synthetic model of n float32 parameters (no
torch), optionally under a tree of :class:`~rudra_zmq.tree.node.TreeNode` processes
(``--arch adv``), an echo server (the PS's protocol, answering from a preallocated array with no
update) and a raw ZeroMQ server (a ROUTER answering with a preallocated buffer, zero-copy). The
measuring side (:mod:`.pushpull_client`) starts λ client processes that speak the wire protocol
as ``learner/learner.py`` does (``channel.Channel``, zero-copy gradients, replies validated by
``wire.decode``) to the PS and the echo server, and send the same bytes raw. Modes, as ps-lite's
``test_kv_app_benchmark``: ``push_then_pull``, ``pushpull``, ``push``, ``pull``. PS, echo and
raw blocks alternate in every round, so load from other users hits all alike. Printed: goodput,
operations and PS updates per second, p50/p99, PS/raw, PS/echo (the PS's own work), echo/raw
(the protocol's cost), and CPU µs and page faults per operation. Modes, method, output and
cross-host use: ``docs/benchmarks.md``.

    rudra-zmq bench pushpull --sizes 90K 1M 10M                    # λ=1, async, push+pull
    host-a$ rudra-zmq bench pushpull --bind tcp://0.0.0.0:5555     # PS 5556, raw 5557, echo 5558
    host-b$ rudra-zmq bench pushpull --connect tcp://host-a:5555 --learners 4 -b 100K -e 10M -f 10
"""

from __future__ import annotations

import numpy as np
import zmq

from .. import sync, transport
from . import common, pushpull_client, sides
from .pushpull_server import handlers

TARGETS = ("ps", "echo", "raw")
MODES = {
    "push_then_pull": "push then pull",
    "pushpull": "push+pull",
    "push": "push only",
    "pull": "pull only",
}
PROTOCOLS = sync.PROTOCOLS


# ----------------------------------------------------------------------------- measuring side
def _block(ctl, clients, target: str, count: int) -> dict:
    """One block (blocks until done): every client runs ``count`` operations at once; the
    merged figures, the PS's updates and the server processes' CPU and page faults during
    the block (asked before and after it)."""
    c0 = ctl.request("counters", target=target)
    rs = clients.call("run", target=target, count=count)
    c1 = ctl.request("counters", target=target)
    wall = max(r["t1"] for r in rs) - min(r["t0"] for r in rs)
    return {
        "wall": wall,
        "lat": [x for r in rs for x in r["lat"]],
        "bytes": sum(r["up"] + r["down"] for r in rs),
        "ops": count * len(rs),
        "updates": c1["updates"] - c0["updates"],
        "server_cpu_s": c1["cpu_s"] - c0["cpu_s"],
        "server_minflt": c1["minflt"] - c0["minflt"],
        "client_cpu_s": sum(r["cpu_s"] for r in rs),
        "client_minflt": sum(r["minflt"] for r in rs),
    }


def _ps_env(pairs) -> dict:
    env = {}
    for kv in pairs or ():
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--ps-env takes KEY=VALUE, got {kv!r}")
        env[key] = value
    return env


def run_case(ctl, clients, n: int, mode: str, args) -> dict:
    """Start the servers of one case, time every target, stop them; the case's record."""
    req = dict(
        n=n,
        protocol=args.protocol,
        learners=args.learners,
        softsync_n=args.softsync_n,
        ps_threads=args.ps_threads,
        io_threads=args.io_threads,
        chunk_mib=args.chunk_mib,
        arch=args.arch,
        fanout=args.fanout,
        depth=args.depth,
        ps_env=_ps_env(getattr(args, "ps_env", None)),
    )
    eps = ctl.request("ps", **req)
    clients.call(
        "connect",
        ps=[ctl.reachable(e) for e in eps["learners"]],
        echo=ctl.reachable(eps["echo"]),
        raw=ctl.reachable(eps["raw"]),
        n=n,
        chunk_bytes=args.chunk_mib << 20,
        mode=mode,
    )
    try:
        counts = {}
        for target in TARGETS:
            b = _block(ctl, clients, target, 2)  # probe
            b = _block(
                ctl, clients, target, common.calibrate(b["wall"] / 2, args.warmup, lo=2)
            )  # warm-up
            counts[target] = common.calibrate(
                b["wall"] * len(clients.procs) / b["ops"], args.seconds, lo=3, hi=200_000
            )
        rounds = {t: [] for t in TARGETS}
        for _ in range(args.repeat):
            for target in TARGETS:
                rounds[target].append(_block(ctl, clients, target, counts[target]))
    finally:
        clients.call("close")
        ctl.request("stop")
    out = {
        "bench": "pushpull",
        "label": f"{args.arch} {args.protocol} λ={args.learners} {MODES[mode]}",
        "arch": args.arch,
        "protocol": args.protocol,
        "learners": args.learners,
        "mode": mode,
        "params": n,
        "size": 4 * n,
        "bytes_per_op": 4 * n * pushpull_client.PAYLOADS[mode],
        "repeat": args.repeat,
    }
    for target, blocks in rounds.items():
        lat = common.summary(np.concatenate([b["lat"] for b in blocks]) * 1e6)
        lo, med, hi = common.mmm([b["bytes"] * 8 / b["wall"] / 1e9 for b in blocks])
        mid = sorted(blocks, key=lambda b: b["wall"])[len(blocks) // 2]
        per_client = mid["ops"] // args.learners
        ops = sum(b["ops"] for b in blocks)
        out.update(
            {
                f"{target}_gbps": med,
                f"{target}_gbps_min": lo,
                f"{target}_gbps_max": hi,
                f"{target}_mean_us": mid["wall"] / per_client * 1e6,
                f"{target}_p50_us": lat["p50"],
                f"{target}_p99_us": lat["p99"],
                f"{target}_ops": mid["ops"],
                f"{target}_bytes": mid["bytes"],
                f"{target}_ops_per_s": mid["ops"] / mid["wall"],
                f"{target}_server_cpu_us": sum(b["server_cpu_s"] for b in blocks) / ops * 1e6,
                f"{target}_server_faults": sum(b["server_minflt"] for b in blocks) / ops,
                f"{target}_client_cpu_us": sum(b["client_cpu_s"] for b in blocks) / ops * 1e6,
                f"{target}_client_faults": sum(b["client_minflt"] for b in blocks) / ops,
            }
        )
    ps_mid = sorted(rounds["ps"], key=lambda b: b["wall"])[len(rounds["ps"]) // 2]
    out.update(
        ops=out["ps_ops"],
        bytes=out["ps_bytes"],
        gbps=out["ps_gbps"],
        p50_us=out["ps_p50_us"],
        updates=ps_mid["updates"],
        updates_per_s=ps_mid["updates"] / ps_mid["wall"],
        time_ratio=out["ps_p50_us"] / out["raw_p50_us"],
        goodput_ratio=out["ps_gbps"] / out["raw_gbps"],
        ps_echo_ratio=out["ps_p50_us"] / out["echo_p50_us"],
        echo_raw_ratio=out["echo_p50_us"] / out["raw_p50_us"],
    )
    return out


def line(r: dict) -> str:
    """The case's text: the figures, then a ``#`` line of CPU and page faults per op."""
    cost = "  ".join(
        f"{t} {r[f'{t}_server_cpu_us']:.0f}/{r[f'{t}_client_cpu_us']:.0f} µs "
        f"{r[f'{t}_server_faults']:.1f}/{r[f'{t}_client_faults']:.1f} faults"
        for t in TARGETS
    )
    return (
        f"pushpull {r['label']:<28} n={common.fmt_count(r['params']):>7} "
        f"({common.fmt_bytes(r['size']):>10})  PS {r['ps_gbps']:6.2f} Gbps "
        f"[{r['ps_gbps_min']:.2f}-{r['ps_gbps_max']:.2f}] p50 {r['ps_p50_us']:9.1f} p99 "
        f"{r['ps_p99_us']:9.1f} µs {r['ps_ops_per_s']:8.1f} ops/s {r['updates_per_s']:8.1f} "
        f"upd/s | echo p50 {r['echo_p50_us']:9.1f} µs | raw {r['raw_gbps']:6.2f} Gbps p50 "
        f"{r['raw_p50_us']:9.1f} p99 {r['raw_p99_us']:9.1f} µs | PS/raw time "
        f"{r['time_ratio']:.2f}x goodput {r['goodput_ratio']:.2f}x | PS/echo "
        f"{r['ps_echo_ratio']:.2f}x echo/raw {r['echo_raw_ratio']:.2f}x | ops {r['ops']} "
        f"bytes {r['bytes']}\n#   per op, server/clients: {cost}"
    )


def add_arguments(p) -> None:
    sides.add_side_args(p, "runs the parameter server, tree nodes, echo and raw servers")
    common.add_size_args(p, "90K", "10M", 10, "model size in float32 parameters")
    p.add_argument(
        "--mode",
        nargs="+",
        default=["pushpull"],
        choices=list(MODES),
        help="ps-lite's modes (default pushpull = one PUSHPULL round trip)",
    )
    p.add_argument("--learners", "-l", type=int, default=1, help="λ client processes")
    p.add_argument("--protocol", default="async", choices=PROTOCOLS)
    p.add_argument("--softsync-n", type=int, default=1, help="n of n-softsync")
    p.add_argument(
        "--arch",
        default="base",
        choices=("base", "adv"),
        help="adv: a PS tree (--fanout, --depth) between clients and PS",
    )
    p.add_argument("--fanout", type=int, default=2)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--ps-threads", type=int, default=1, help="PS kernel threads (default 1)")
    p.add_argument("--chunk-mib", type=int, default=8, help="runtime.chunk_mib: largest frame")
    p.add_argument(
        "--io-threads",
        type=int,
        default=1,
        help="ZeroMQ I/O threads of the PS, echo and raw servers (default 1, "
        "libzmq's default and the PS's)",
    )
    p.add_argument(
        "--ps-env",
        nargs="+",
        metavar="KEY=VALUE",
        help="environment of the PS process only, e.g. OMP_WAIT_POLICY=passive",
    )
    common.add_timing_args(p)
    common.add_output_args(p)


def run(args) -> int:
    """The passive side (``--bind``, serves until told to quit or idle) or every case of the
    measuring side; blocks until done and returns the exit code."""
    if args.bind:
        return sides.serve_agent(
            "pushpull server", args.bind, handlers, args.idle_timeout, args.exit_with_parent
        )
    if sync.barrier(args.protocol) and "push" in args.mode:
        raise ValueError(
            f"push-only under {args.protocol} cannot work: a learner must pull the "
            "new weights before its next push (use push_then_pull or pushpull)"
        )
    if args.learners < 1:
        raise ValueError(f"--learners must be >= 1, got {args.learners}")
    sizes = common.sizes_from_args(args)
    transport.tune_malloc()
    ps_env = _ps_env(args.ps_env)
    report = common.Report(
        args,
        "bench pushpull (parameter server vs echo vs raw ZeroMQ)",
        notes=[
            "goodput = payload bits moved by all clients / wall time of a round (min-max over "
            "rounds); p50/p99 of single operations; PS/raw time = p50 ratio (lower is better), "
            "goodput = Gbps ratio (higher is better); echo = the PS's protocol without its work",
            f"PS: momentum SGD, {args.ps_threads} kernel thread(s), chunk_mib={args.chunk_mib}, "
            f"env {ps_env or 'as above'}; ZeroMQ io_threads={args.io_threads} (all servers); "
            f"other side: {args.connect or 'spawned on this machine'}",
        ],
        plot=(
            "size",
            [("gbps", "PS goodput (Gbps)"), ("p50_us", "p50 per operation (µs)")],
            "label",
        ),
    )
    ctx = zmq.Context()
    peers = sides.Sides(ctx, "pushpull", args.connect, handlers)
    clients = pushpull_client.Clients(args.learners)
    try:
        ctl = peers.control("tcp")
        for mode in args.mode:
            for n in sizes:
                r = run_case(ctl, clients, n, mode, args)
                report.case(r, line(r))
    finally:
        clients.close()
        peers.close()
        ctx.destroy(linger=0)  # closes what an error left open, never hangs
    report.close()
    return 0
