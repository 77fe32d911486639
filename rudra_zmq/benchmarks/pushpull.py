"""``rudra-zmq bench pushpull``: the parameter server's own path beside raw ZeroMQ.

The passive side (``--bind``) runs a real :class:`~rudra_zmq.roles.ps.ParameterServer` per case
(a synthetic model of n float32 parameters, so no torch), optionally under a Rudra-adv tree of
:class:`~rudra_zmq.roles.tree_node.TreeNode` processes (``--arch adv``; the nodes run beside the
PS), and a raw ZeroMQ server. The measuring side starts λ client processes; each speaks the
wire protocol as ``roles/learner.py`` does (``transport.Channel``: HELLO, then PUSHPULL / PUSH /
PULL with the gradient sent zero-copy in ``runtime.chunk_mib`` frames, replies received
``copy=False`` and validated by ``wire.decode``; the learner's copy of received weights into
its model is left out) and also talks to the raw server: a ROUTER that answers each request
with a preallocated buffer, zero-copy both ways, in the same frame sizes. Modes, as ps-lite's
``test_kv_app_benchmark``:

=================  ===================================================  ==================
mode               one operation                                        raw equivalent
=================  ===================================================  ==================
``push_then_pull`` PUSH -> ACK, then PULL -> WEIGHTS                    N up; then N down
``pushpull``       PUSHPULL -> WEIGHTS (or UPTODATE)                    N up and N down
``push``           PUSH -> ACK (not under hardsync: it needs the pull)   N up, a header down
``pull``           PULL of timestamp -1 -> WEIGHTS                      a header up, N down
=================  ===================================================  ==================

Hardsync pulls wait for the update (``wait``), so an operation is one synchronous step of λ
learners. Per case: a probe, a warm-up, an operation count calibrated to ``--seconds``, then
``--repeat`` rounds of one PS block and one raw block (all λ clients at once, same count), so
load from other users hits both alike. Printed: goodput (payload bits moved by all clients /
wall time; min/median/max over rounds), operations and PS updates per second, p50/p99 of
single operations, the same for raw, and PS/raw (time p50 and goodput).

    rudra-zmq bench pushpull --sizes 90K 1M 10M                    # λ=1, async, push+pull
    rudra-zmq bench pushpull --learners 8 --mode push --protocol softsync --sizes 1M
    host-a$ rudra-zmq bench pushpull --bind tcp://0.0.0.0:5555     # PS on 5556, raw on 5557
    host-b$ rudra-zmq bench pushpull --connect tcp://host-a:5555 --learners 4 -b 100K -e 10M -f 10
"""
from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import zmq

from .. import transport
from ..update import stream_part_floats
from . import common, pushpull_client, sides

# raw: pyzmq (the goal's baseline); rawc: the same through rudra_zmq.fastio (a reference)
TARGETS = ("ps", "raw", "rawc")
MODES = {"push_then_pull": "push then pull", "pushpull": "push+pull", "push": "push only",
         "pull": "pull only"}
PROTOCOLS = ("async", "softsync", "hardsync")


def ps_overrides(req: dict) -> list[str]:
    """Config overrides of the benchmark PS: the requested protocol, λ, threads and frames;
    momentum SGD; an epoch so long that training never ends; no evaluation."""
    out = [f"sync.protocol={req['protocol']}", f"sync.learners={req['learners']}",
           "sync.batch_size=1", "optimizer.lr=1.0e-6", "optimizer.momentum=0.9",
           "optimizer.weight_decay=0.0005", "train.epochs=1.0e+15",
           "train.eval_every_epochs=0", "train.eval_every_updates=0",
           "data.dataset=synthetic", "data.synthetic_train=1000000000",
           f"runtime.ps_threads={req['ps_threads']}", f"runtime.chunk_mib={req['chunk_mib']}",
           f"runtime.stream_parts={req.get('stream_parts', 8)}",
           f"runtime.hot_path={str(req.get('hot_path', True)).lower()}",
           "runtime.timeout_s=3600", f"architecture.kind={req['arch']}",
           f"architecture.fanout={req['fanout']}", f"architecture.depth={req['depth']}"]
    if req["protocol"] == "softsync":
        out.append(f"sync.n={req['softsync_n']}")
    return out


# ----------------------------------------------------------------------------- passive side
def _ps_process(conn, stop, bind, n, overrides, ps_threads, io_threads):
    from .. import kernels
    from ..config import load_config
    from ..roles.ps import ParameterServer

    sides.exit_with_parent()
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    weights = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01
    ctx = zmq.Context(io_threads=io_threads)
    ps = ParameterServer(load_config(None, overrides), bind, ctx=ctx,
                         model=(weights, [(0, n, 1.0, 1.0)], pushpull_client.SIGNATURE))
    conn.send(ps.endpoint)

    def answer_updates():   # the agent asks between blocks: the engine's exact count
        while True:
            conn.recv()
            conn.send(ps.engine.updates)   # an int read: safe beside the serving thread

    threading.Thread(target=answer_updates, daemon=True, name="updates").start()
    ps.serve_forever(stop_event=stop)


def _node_process(conn, stop, node_id, bind, parent, overrides):
    from .. import kernels
    from ..config import load_config
    from ..roles.tree_node import TreeNode

    sides.exit_with_parent()
    transport.tune_malloc()
    kernels.set_num_threads(1)   # as `rudra-zmq node` does
    node = TreeNode(load_config(None, overrides), node_id, bind, parent)
    conn.send(node.endpoint)
    node.serve_forever(stop_event=stop)


def _start(target, *args):
    """Start ``target(conn, stop, *args)`` in a spawned process; (process, stop, endpoint,
    conn)."""
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    stop = spawn.Event()
    proc = spawn.Process(target=target, args=(child, stop, *args), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start (exit code {proc.exitcode})")
    return proc, stop, parent.recv(), parent


def _stop(procs) -> None:
    for _proc, stop, *_ in procs:
        stop.set()
    for proc, *_ in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def handlers(ctx: zmq.Context, agent: sides.Agent) -> dict:
    """ps: (re)start the PS (and tree) for one case; stop; _close (the agent exits)."""
    state = {"ps": [], "raw": None}

    def start_ps(req):
        _stop(state["ps"])
        state["ps"] = []
        overrides = ps_overrides(req)
        ps = _start(_ps_process, agent.data_endpoint("tcp", slot=1), req["n"], overrides,
                    req["ps_threads"], req["io_threads"])
        state["ps"].append(ps)
        eps = [ps[2]] * req["learners"]
        if req["arch"] == "adv":
            from ..config import load_config
            from ..topology import plan
            tree = plan(load_config(None, overrides))
            where = {None: ps[2]}
            for node in sorted(tree.nodes, key=lambda nd: -nd.level):   # parents first
                p = _start(_node_process, node.id, agent.data_endpoint("tcp", slot=4 + node.id),
                           where[node.parent], overrides)
                state["ps"].append(p)
                where[node.id] = p[2]
            eps = [where[tree.leaf_of(i).id] for i in range(req["learners"])]
        if state["raw"] is not None and state["raw_io"] != req["io_threads"]:
            _stop(state["raw"])
            state["raw"] = None
        if state["raw"] is None:   # pyzmq (the baseline), then the compiled framing
            state["raw"] = [_start(pushpull_client.raw_server, agent.data_endpoint("tcp", slot),
                                   req["io_threads"], fast) for slot, fast in ((2, False),
                                                                              (3, True))]
            state["raw_io"] = req["io_threads"]
        return {"learners": eps, "raw": state["raw"][0][2], "rawc": state["raw"][1][2]}

    def updates(req):
        conn = state["ps"][0][3]
        conn.send(None)
        if not conn.poll(30):
            raise TimeoutError("the parameter server did not report its update count")
        return {"updates": conn.recv()}

    def stop_ps(req):
        _stop(state["ps"])
        state["ps"] = []
        return {}

    def close():
        _stop(state["ps"] + (state["raw"] or []))

    return {"ps": start_ps, "updates": updates, "stop": stop_ps, "_close": close}


# ----------------------------------------------------------------------------- measuring side
def _block(ctl, clients, target: str, count: int) -> dict:
    """One block: every client runs ``count`` operations at once; the merged figures (and
    the PS's updates during the block, asked before and after it)."""
    u0 = ctl.request("updates")["updates"] if target == "ps" else 0
    rs = clients.call("run", target=target, count=count)
    u1 = ctl.request("updates")["updates"] if target == "ps" else 0
    wall = max(r["t1"] for r in rs) - min(r["t0"] for r in rs)
    return {"wall": wall, "lat": [x for r in rs for x in r["lat"]],
            "bytes": sum(r["up"] + r["down"] for r in rs), "ops": count * len(rs),
            "updates": u1 - u0}


def in_parts(args) -> bool:
    """Whether the clients push in parts: ``--gradient-parts`` resolved as a learner resolves
    runtime.gradient_parts, for the PS on the ``--connect`` side (or on this machine)."""
    return args.arch == "base" and transport.pushes_gradients_in_parts(args.gradient_parts,
                                                                       args.connect)


def run_case(ctl, clients, n: int, mode: str, args) -> dict:
    req = dict(n=n, protocol=args.protocol, learners=args.learners, softsync_n=args.softsync_n,
               ps_threads=args.ps_threads, io_threads=args.io_threads,
               chunk_mib=args.chunk_mib, stream_parts=args.stream_parts, arch=args.arch,
               hot_path=getattr(args, "hot_path", "on") == "on",
               fanout=args.fanout, depth=args.depth)
    eps = ctl.request("ps", **req)
    clients.call("connect", ps=[ctl.reachable(e) for e in eps["learners"]],
                 raw=ctl.reachable(eps["raw"]), rawc=ctl.reachable(eps["rawc"]), n=n, chunk_bytes=args.chunk_mib << 20,
                 mode=mode, wait=args.protocol == "hardsync",
                 part_floats=stream_part_floats(n, args.chunk_mib << 20, args.stream_parts)
                 if in_parts(args) else n)
    try:
        counts = {}
        for target in TARGETS:
            b = _block(ctl, clients, target, 2)                               # probe
            b = _block(ctl, clients, target, common.calibrate(b["wall"] / 2, args.warmup,
                                                              lo=2))          # warm-up
            counts[target] = common.calibrate(b["wall"] * len(clients.procs) / b["ops"],
                                              args.seconds, lo=3, hi=200_000)
        rounds = {t: [] for t in TARGETS}
        for _ in range(args.repeat):
            for target in TARGETS:
                rounds[target].append(_block(ctl, clients, target, counts[target]))
    finally:
        clients.call("close")
        ctl.request("stop")
    out = {"bench": "pushpull", "label": f"{args.arch} {args.protocol} λ={args.learners} "
                                         f"{MODES[mode]}",
           "arch": args.arch, "protocol": args.protocol, "learners": args.learners,
           "mode": mode, "params": n, "size": 4 * n,
           "bytes_per_op": 4 * n * pushpull_client.PAYLOADS[mode], "repeat": args.repeat}
    for target, blocks in rounds.items():
        lat = common.summary(np.concatenate([b["lat"] for b in blocks]) * 1e6)
        lo, med, hi = common.mmm([b["bytes"] * 8 / b["wall"] / 1e9 for b in blocks])
        mid = sorted(blocks, key=lambda b: b["wall"])[len(blocks) // 2]
        per_client = mid["ops"] // args.learners
        out.update({f"{target}_gbps": med, f"{target}_gbps_min": lo, f"{target}_gbps_max": hi,
                    f"{target}_mean_us": mid["wall"] / per_client * 1e6,
                    f"{target}_p50_us": lat["p50"], f"{target}_p99_us": lat["p99"],
                    f"{target}_ops": mid["ops"], f"{target}_bytes": mid["bytes"],
                    f"{target}_ops_per_s": mid["ops"] / mid["wall"]})
    ps_mid = sorted(rounds["ps"], key=lambda b: b["wall"])[len(rounds["ps"]) // 2]
    out.update(ops=out["ps_ops"], bytes=out["ps_bytes"], gbps=out["ps_gbps"],
               p50_us=out["ps_p50_us"],
               updates=ps_mid["updates"], updates_per_s=ps_mid["updates"] / ps_mid["wall"],
               time_ratio=out["ps_p50_us"] / out["raw_p50_us"],
               goodput_ratio=out["ps_gbps"] / out["raw_gbps"],
               rawc_time_ratio=out["ps_p50_us"] / out["rawc_p50_us"])
    return out


def line(r: dict) -> str:
    return (f"pushpull {r['label']:<28} n={common.fmt_count(r['params']):>7} "
            f"({common.fmt_bytes(r['size']):>10})  PS {r['ps_gbps']:6.2f} Gbps "
            f"[{r['ps_gbps_min']:.2f}-{r['ps_gbps_max']:.2f}] p50 {r['ps_p50_us']:9.1f} p99 "
            f"{r['ps_p99_us']:9.1f} µs {r['ps_ops_per_s']:8.1f} ops/s {r['updates_per_s']:8.1f} "
            f"upd/s | raw {r['raw_gbps']:6.2f} Gbps p50 {r['raw_p50_us']:9.1f} p99 "
            f"{r['raw_p99_us']:9.1f} µs | PS/raw time {r['time_ratio']:.2f}x goodput "
            f"{r['goodput_ratio']:.2f}x | raw fastio p50 {r['rawc_p50_us']:.1f} µs, PS/it "
            f"{r['rawc_time_ratio']:.2f}x | ops {r['ops']} bytes {r['bytes']}")


def add_arguments(p) -> None:
    sides.add_side_args(p, "runs the parameter server, tree nodes and the raw server")
    common.add_size_args(p, "90K", "10M", 10, "model size in float32 parameters")
    p.add_argument("--mode", nargs="+", default=["pushpull"], choices=list(MODES),
                   help="ps-lite's modes (default pushpull = one PUSHPULL round trip)")
    p.add_argument("--learners", "-l", type=int, default=1, help="λ client processes")
    p.add_argument("--protocol", default="async", choices=PROTOCOLS)
    p.add_argument("--softsync-n", type=int, default=1, help="n of n-softsync")
    p.add_argument("--arch", default="base", choices=("base", "adv"),
                   help="adv: a PS tree (--fanout, --depth) between clients and PS")
    p.add_argument("--fanout", type=int, default=2)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--ps-threads", type=int, default=1, help="PS kernel threads (default 1)")
    p.add_argument("--chunk-mib", type=int, default=8, help="runtime.chunk_mib: largest frame")
    p.add_argument("--stream-parts", type=int, default=8,
                   help="runtime.stream_parts: parts of a weights reply streamed during its "
                        "update (1 = one message after the update)")
    p.add_argument("--gradient-parts", default="auto", choices=("auto", "always", "never"),
                   help="runtime.gradient_parts of the clients: push a large gradient in "
                        "--stream-parts GPART parts, so the PS updates during the transfer "
                        "(auto, as a learner: in parts when --connect names another host)")
    p.add_argument("--hot-path", default="on", choices=("on", "off"),
                   help="runtime.hot_path of the PS: off serves every request in Python "
                        "(compare the compiled hot path with the general one)")
    p.add_argument("--io-threads", type=int, default=1,
                   help="ZeroMQ I/O threads of the PS and the raw server (default 1, "
                        "libzmq's default and the PS's)")
    common.add_timing_args(p)
    common.add_output_args(p)


def run(args) -> int:
    if args.bind:
        return sides.serve_agent("pushpull server", args.bind, handlers, args.idle_timeout,
                                 args.exit_with_parent)
    if args.protocol == "hardsync" and "push" in args.mode:
        raise ValueError("push-only under hardsync cannot work: a learner must pull the new "
                         "weights before its next push (use push_then_pull or pushpull)")
    if args.learners < 1:
        raise ValueError(f"--learners must be >= 1, got {args.learners}")
    sizes = common.sizes_from_args(args)
    transport.tune_malloc()
    report = common.Report(args, "bench pushpull (parameter server vs raw ZeroMQ)", notes=[
        "goodput = payload bits moved by all clients / wall time of a round (min-max over "
        "rounds); p50/p99 of single operations; PS/raw time = p50 ratio (lower is better), "
        "goodput = Gbps ratio (higher is better)",
        f"PS: momentum SGD, {args.ps_threads} kernel thread(s), chunk_mib={args.chunk_mib}, "
        f"stream_parts={args.stream_parts}, hot path {args.hot_path}, gradients "
        f"{'in parts' if in_parts(args) else 'whole'} (--gradient-parts {args.gradient_parts}), "
        f"ZeroMQ io_threads={args.io_threads} (PS and raw server); "
        f"other side: {args.connect or 'spawned on this machine'}"],
        plot=("size", [("gbps", "PS goodput (Gbps)"), ("p50_us", "p50 per operation (µs)")],
              "label"))
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
        ctx.destroy(linger=0)   # closes what an error left open, never hangs
    report.close()
    return 0
