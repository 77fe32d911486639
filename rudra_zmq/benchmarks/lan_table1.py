"""The paper's Table 1 on emulated LAN hosts: seconds per epoch of Rudra-base hardsync,
Rudra-base softsync, Rudra-adv softsync and Rudra-adv* softsync, and the root's ingress.

``bench/lan/netns.sh`` builds 1 + HOSTS network namespaces ("hosts"), each with a 1 Gbit/s
full-duplex link (tc tbf both ways) to one bridge. The root PS (``CountingPS``) runs on host 0;
λ = HOSTS x PER_HOST synthetic learners (torch-free; "compute" = sleep COMPUTE_MS ±10 %, then a
PUSHPULL of a PARAMS-float32 gradient) run PER_HOST to a process on hosts 1..HOSTS; tree leaves
(fan-out PER_HOST, depth 1) run on their learners' host, talking to them over ipc. Every process
is ``ip netns exec HOST python -m rudra_zmq.benchmarks.synthetic_roles ...``. An epoch is
EPOCH_GRADIENTS gradients; the first of EPOCHS epochs is a warm-up, the others are timed at the
root (the update that completes the epoch's gradients). softsync = 1-softsync (c = λ).

On success, failure or Ctrl-C every process is stopped and the namespaces are removed.
Needs root and ``ip netns``.

    sudo .venv/bin/rudra-zmq bench lan-table1              # 4 hosts x 4 learners, 2.5M
    rudra-zmq bench lan-table1 --quick --json               # 2 x 2 learners, 10k, seconds

``netns.sh`` is a shell script of the source tree, not of the package: it is found as
``bench/lan/netns.sh`` beside the package or under the current directory, or given with
``--netns-sh``.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import statistics
import sys
import tempfile
from functools import partial

from .. import timeline, wire
from ..config import RuntimeConfig
from ..config_architecture import MAX_PARTS
from . import common, lan_links, lan_shards
from . import synthetic_cluster as sc
from . import synthetic_roles as sr
from .lan_allreduce import run as run_allreduce
from .lan_ddp import FORWARD_SHARE, LAYERS
from .lan_ddp import run as run_ddp
from .lan_hosts import NETNS_SH, Lan, find_netns_sh, lan_available
from .lan_link import (
    ALLREDUCE,
    BASELINES,
    DDP,
    deadline_s,
    parse_rate,
    pushed_in_backward,
    retries,
    row_head,
    traffic,
    wire_bytes,
)
from .lan_report import line, ordering, write_png

HOSTS = 4  # learner hosts (the root is one more)
PER_HOST = 4  # learners per host = the tree's fan-out
PARAMS = 2_500_000  # 10 MB of float32: 80 ms on a 1 Gbit/s link
COMPUTE_MS = 100.0  # emulated forward + backward per gradient
EPOCH_GRADIENTS = 128  # one "epoch" (8 gradients per learner)
EPOCHS = 3  # the first is a warm-up
RATE = "1gbit"
CASES = ["base-hardsync", "base-softsync", "adv-softsync", "advstar-softsync"]
LEARNERS = ["sleep", "model", "model-after", "product"]  # --learner (lan_shards.learner_args)
DEFAULTS = dict(
    hosts=HOSTS,
    per_host=PER_HOST,
    params=PARAMS,
    compute_ms=COMPUTE_MS,
    epoch_gradients=EPOCH_GRADIENTS,
    epochs=EPOCHS,
)
QUICK = dict(hosts=2, per_host=2, params=10_000, compute_ms=5.0, epoch_gradients=16, epochs=2)


def epochs_of(ps: dict, n: int, epochs: int) -> list[dict]:
    """Per epoch: seconds (from the update completing the previous epoch, or the first
    gradient), root ingress and egress bytes, updates, and ⟨σ⟩."""
    rows = [dict(zip(ps["log_fields"], r)) for r in ps["log"]]
    for r in rows:  # what the root sent: replies, and the broadcast (advstar)
        r["out_bytes"] = r["tx_bytes"] + r["bcast_bytes"]
    prev = {"t": ps["t_first_grad"], "rx_bytes": 0, "out_bytes": 0, "grads": 0, "k": 0}
    out = []
    for e in range(1, epochs + 1):
        k = next(i for i, r in enumerate(rows) if r["grads"] >= e * n)
        r = rows[k]
        upd = rows[prev["k"] : k + 1]
        out.append(
            {
                "epoch": e,
                "s": r["t"] - prev["t"],
                "t_end": r["t"],
                "grads": r["grads"] - prev["grads"],
                "rx_bytes": r["rx_bytes"] - prev["rx_bytes"],
                "tx_bytes": r["out_bytes"] - prev["out_bytes"],
                "updates": len(upd),
                "mean_sigma": statistics.fmean(u["mean_sigma"] for u in upd),
            }
        )
        prev = dict(r, k=k + 1)
    return out


def bound_s_per_epoch(case: str, a, wire_dtype: str, parts: int = 1) -> float | None:
    """The link bound of one epoch (payload bytes only, no TCP/IP headers; None where none
    is stated): a hardsync update moves λ gradients in, then λ replies out, through the
    root's link, plus one compute; in P parts (wire.parts) the replies overlap the pushes
    but for the last part's (λ·M·(1 + 1/P)); 1-softsync keeps the root's ingress busy
    (every gradient in once) unless a learner's own round is slower; a ring allreduce moves
    2(λ-1)/λ of the gradient through every link per step, plus one compute."""
    lam = a.hosts * a.per_host
    m = a.params * wire_bytes(wire_dtype) / parse_rate(a.rate)  # one model through a link
    c = a.compute_ms / 1000
    steps = a.epoch_gradients / lam
    if case == "base-hardsync":
        link = (1 + 1 / parts) * lam * m
        if getattr(a, "learner", "sleep") in lan_shards.MODEL_LEARNERS:  # pushes in backward
            return steps * (c * FORWARD_SHARE + max(c * (1 - FORWARD_SHARE), link))
        return steps * (link + c)
    if case == "base-softsync":
        return max(a.epoch_gradients * m, steps * (c + 2 * m * a.per_host))
    if case == ALLREDUCE:
        return steps * (2 * (lam - 1) / lam * m + c)
    if case == DDP:  # the traffic overlaps backward but can end no sooner than it does
        ring = 2 * (lam - 1) / lam * m
        return steps * (c * FORWARD_SHARE + max(c * (1 - FORWARD_SHARE), ring))
    return None


def run_baseline_case(case, a, lan: Lan, workdir: str, wire_dtype: str, timeline=None) -> dict:
    """The gloo allreduce or DDP on the learner hosts, as a row like run_case's (no root)."""
    lam = a.hosts * a.per_host
    steps = a.epoch_gradients // lam
    run_ranks = run_allreduce if case == ALLREDUCE else partial(run_ddp, layers=a.layers)
    rank0 = run_ranks(
        lan.hosts[1 : 1 + a.hosts],
        a.per_host,
        a.params,
        steps * a.epochs,
        a.compute_ms,
        wire_dtype,
        workdir,
        timeline=timeline,
    )
    ends, t0 = rank0["step_ends"], rank0["t0_unix"]
    marks = [0.0] + [ends[(e + 1) * steps - 1] for e in range(a.epochs)]
    epoch_s = [b - x for x, b in zip(marks, marks[1:])]
    timed = epoch_s[1:] or epoch_s
    row = _row(case, a, wire_dtype, statistics.median(timed), epoch_s)
    return {**row, "timed_window": [t0 + marks[1 if a.epochs > 1 else 0], t0 + marks[-1]]}


def _row(case: str, a, wire_dtype: str, s: float, epoch_s: list, parts: int = 1) -> dict:
    name = case if wire_dtype == "float32" else f"{case}-{wire.WIRE_DTYPES[wire_dtype]}"
    name += f"-p{parts}" if parts > 1 else ""
    name += f"-sb{a.sndbuf_kib}" if a.sndbuf_kib else ""
    learner = getattr(a, "learner", "sleep")
    name += "" if case in BASELINES or learner == "sleep" else f"-{learner}"
    bound = bound_s_per_epoch(case, a, wire_dtype, parts)
    return {**row_head(name, a, wire_dtype, s, epoch_s, bound), "parts": parts}


def run_case(
    case: str, a, lan: Lan, workdir: str, wire_dtype: str = "float32", parts: int = 1,
    timeline: str | None = None,
) -> dict:  # fmt: skip
    """One case with the root alone: its row. ``timeline``: the roles record their parts of
    it there (``timeline.start_from_env``). Blocks."""
    if case in BASELINES:
        return run_baseline_case(case, a, lan, workdir, wire_dtype, timeline)
    arch, protocol = case.split("-")
    lam = a.hosts * a.per_host
    ov = sr.overrides(
        arch,
        protocol,
        lam,
        a.epoch_gradients,
        epochs=a.epochs,
        softsync_n=1,
        fanout=a.per_host,
        depth=1,
        retry_s=a.retry_s,
        wire_dtype=wire_dtype,
        parts=parts,
        sndbuf_kib=a.sndbuf_kib,
    )
    learner = getattr(a, "learner", "sleep")
    r = sc.run(
        arch,
        ov,
        params=a.params,
        learners=lam,
        root=lan.hosts[0],
        hosts=lan.hosts[1 : 1 + a.hosts],
        workdir=workdir,
        compute_ms=a.compute_ms,
        per_process=a.per_host,
        timeout_s=deadline_s(bound_s_per_epoch(case, a, wire_dtype, parts), a.epochs)
        + (120 if learner == "product" else 0),  # 2λ+1 processes import torch first
        timeline=timeline,
        **lan_shards.learner_args(a),
    )
    ps = r["ps"]
    per = wire_bytes(wire_dtype)
    if ps["rx_grad_bytes"] != ps["numel"] * per * ps["rx_grad_msgs"]:
        raise RuntimeError(f"root gradient bytes != numel x {per} x gradient messages")
    ep = epochs_of(ps, a.epoch_gradients, a.epochs)
    timed = ep[1:] or ep
    s = statistics.median(e["s"] for e in timed)
    return {
        **_row(case, a, wire_dtype, s, [e["s"] for e in ep], parts),
        "arch": arch,
        "protocol": protocol,
        **traffic(timed, sum(e["grads"] for e in timed)),
        "root_grad_msgs_total": ps["rx_grad_msgs"],
        "grads_total": ps["grads"],
        "numel": ps["numel"],
        "root_grad_bytes_total": ps["rx_grad_bytes"],
        "root_cpu_s": ps["cpu_s"],
        "wall_s": r["wall_s"],
        "timed_window": [ep[0]["t_end"] if len(ep) > 1 else ps["t_first_grad"], ep[-1]["t_end"]],
        **pushed_in_backward(r["learners"]),
        **retries([ps], r["learners"]),
    }


def _interrupt(*_):
    raise KeyboardInterrupt


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int, help=f"learner hosts, +1 for the root (default {HOSTS})")
    p.add_argument(
        "--per-host",
        type=int,
        help=f"learners per host, and the tree's fan-out (default {PER_HOST})",
    )
    p.add_argument("--params", type=common.parse_size, help=f"default {PARAMS:,}")
    p.add_argument("--compute-ms", type=float, help=f"default {COMPUTE_MS:g}")
    p.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help=f"{DDP}: the synthetic model's layers (default {LAYERS}; a third of the compute "
        "is their forward, the rest their backward)",
    )
    p.add_argument(
        "--learner",
        nargs="+",
        choices=LEARNERS,
        default=["sleep"],
        help="the base cases' learners (and adv's with K > 1 servers), each side by side: "
        "sleep, then push (default); model: train the synthetic model of --layers sleeping "
        "layers (the module the ddp case runs) through the learner's exchange, each part "
        "pushed as backward finishes it; model-after: the same, every part pushed after "
        "backward; product: the product's own learner (learner/learner.py, its hooks and a "
        "data server) on that module, given as a user model (model.name)",
    )
    p.add_argument("--epoch-gradients", type=int, help=f"default {EPOCH_GRADIENTS}")
    p.add_argument("--epochs", type=int, help=f"the first is a warm-up (default {EPOCHS})")
    p.add_argument("--rate", default=RATE, help="each host link's rate, both ways (tc units)")
    p.add_argument(
        "--cases",
        nargs="+",
        default=CASES,
        choices=[*CASES, *BASELINES],
        help=f"default: Table 1's; {DDP}: DistributedDataParallel (gloo, its default buckets) on "
        "the synthetic model of sleeping layers (lan_ddp.py; float16: its fp16_compress_hook); "
        f"{ALLREDUCE}: torch.distributed's ring allreduce (gloo) on "
        "the learner hosts, DDP's step (float16: its fp16_compress_hook's traffic)",
    )
    p.add_argument(
        "--wire-dtypes",
        nargs="+",
        default=["float32"],
        choices=list(wire.WIRE_DTYPES),
        help="run every case with gradients and weights as each of these on the wire "
        "(wire.gradient_dtype/weights_dtype), side by side (default float32)",
    )
    p.add_argument(
        "--retry-s",
        type=float,
        default=RuntimeConfig.retry_s,
        help="runtime.retry_s: after this long unanswered a learner asks the root whether it "
        f"got the request (default {RuntimeConfig.retry_s:g}, the config's)",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        type=int,
        default=[1],
        metavar="K",
        help="base and adv cases: also with K sharded servers, each over one range (adv: one "
        "tree per range; default 1: the root alone); the other cases run with the root",
    )
    p.add_argument(
        "--server-placement",
        nargs="+",
        default=["colocated"],
        choices=lan_shards.PLACEMENTS,
        help="K > 1: servers on the learner hosts (colocated), or on K extra hosts",
    )
    p.add_argument(
        "--parts",
        nargs="+",
        type=int,
        default=[1],
        metavar="P",
        help="base-hardsync: also with each range in P parts, each answered as soon as every "
        "learner's part is in (wire.parts; default 1: whole messages)",
    )
    p.add_argument(
        "--stripes",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="K > 1 servers in P > 1 parts: each server's parts striped over the vector "
        "(wire.stripes, on: the default), or one contiguous range each (off: rows ...-ranges), "
        "side by side",
    )
    p.add_argument(
        "--priority",
        nargs="+",
        default=[],
        choices=["on", "off"],
        help="K servers in P > 1 parts: the lowest offsets first and the next forward layer "
        "by layer as its weights come (wire.priority; rows ...-prio / ...-noprio), side by "
        "side (default: the config's default, no suffix)",
    )
    p.add_argument(
        "--netns-sh",
        metavar="PATH",
        help=f"the LAN script (default: {NETNS_SH} of the source tree or the current directory)",
    )
    p.add_argument("--quick", action="store_true", help="2 hosts x 2 learners, 10k, seconds")
    p.add_argument(
        "--sndbuf-kib",
        nargs="+",
        type=int,
        default=[0],
        metavar="KIB",
        help="runtime.sndbuf_kib: run the PS cases with each of these kernel send buffers on "
        "the learner-server connections, side by side (default 0: the kernel sizes them)",
    )
    p.add_argument(
        "--local",
        nargs="+",
        default=["tcp"],
        choices=["tcp", "ipc"],
        help="servers beside the learners (colocated): how a learner reaches the server on "
        "its own host, each side by side (default tcp, as launch does; ipc: rows ...-ipc)",
    )
    p.add_argument(
        "--timeline",
        metavar="FILE",
        help="write each case's Chrome/Perfetto trace (compute spans, every part sent and "
        "received, each host link's use) to FILE, and a PNG of the links beside it; with "
        "several cases FILE-CASE.json and FILE-CASE.png",
    )
    common.add_output_args(p)


def _variants(case: str, a) -> list[tuple]:
    """(K servers, placement, parts) of each run of ``case``: --servers for base and adv,
    each K > 1 in each --server-placement; --parts for base-hardsync."""
    ks = a.servers if case.startswith(("base-", "adv-")) else [1]
    parts = a.parts if case == "base-hardsync" else [1]
    return [
        (k, where, p) for k in ks for where in (a.server_placement if k > 1 else [None])
        for p in parts
    ]  # fmt: skip


def _transports(case: str, a, k: int, where, parts: int = 1) -> list[tuple]:
    """(runtime.sndbuf_kib, local, learner, stripes, priority) of each run of one variant:
    --sndbuf-kib for the PS cases, each with every --local for servers beside the learners,
    every --learner with K > 1 servers or a base case (else sleeping learners), every
    --stripes with K > 1 servers in parts, and every --priority in parts (None: the
    config's)."""
    if case in BASELINES:
        return [(0, "tcp", "sleep", "on", None)]
    return [
        (sb, local, learner, st, pr)
        for sb in a.sndbuf_kib
        for local in (a.local if where == "colocated" else ["tcp"])
        for learner in (a.learner if k > 1 or case.startswith("base-") else ["sleep"])
        for st in (getattr(a, "stripes", ["on"]) if k > 1 and parts > 1 else ["on"])
        for pr in (getattr(a, "priority", None) or [None] if parts > 1 else [None])
    ]


def _n_runs(a) -> int:
    return len(a.wire_dtypes) * sum(
        len(_transports(c, a, k, where, p)) for c in a.cases for k, where, p in _variants(c, a)
    )


def _sampled(a, lan, workdir, case, dtype, k, where, parts, traces) -> dict:
    """One case's row, run with its links and the CPU sampled (``lan_links``): the row gets
    each host's link use and the CPU's idle share over the timed epochs; with ``traces``
    (``--timeline``) its trace and PNG are written. Blocks."""
    trace = None if traces is None else traces.base()
    namespaces = [h.ns for h in lan.hosts] + [f"{lan.prefix}-br"]
    tcp0 = lan_links.tcp_counters(namespaces)
    sampler = lan_links.LinkSampler(lan.prefix, len(lan.hosts)).start()
    try:
        r = (
            run_case(case, a, lan, workdir, dtype, parts, trace)
            if k == 1
            else lan_shards.run_case(case, a, lan, workdir, dtype, k, where, parts, trace)
        )
    finally:
        sampler.stop()
    t0, t1 = (int(t * 1e6) for t in r["timed_window"])
    servers = (
        [0] if k == 1 else [lan.hosts.index(h) for h in lan_shards.server_hosts(lan, a, k, where)]
    )
    busy = sampler.busy(parse_rate(a.rate), t0, t1)
    r.update(
        lan_links.summary(busy, list(range(1, 1 + a.hosts)), [] if case in BASELINES else servers)
    )
    r["cpu_idle"], r["cpu_niced"] = sampler.cpu_idle(t0, t1), sampler.cpu_niced(t0, t1)
    tcp1 = lan_links.tcp_counters(namespaces)  # the whole case's, warm-up included
    r.update({f"tcp_{key}": tcp1[key] - tcp0[key] for key in tcp0})
    if traces is not None:
        names = [f"host {i}" for i in range(len(lan.hosts))]
        path, other = traces.finish(trace, r["case"], sampler.counter_events(names, pid=0))
        png = traces.paths(r["case"])[1]
        title = f"{r['case']}: each host link's use ({a.rate}; host 0 the root)"
        series = lan_links.series_of(sampler, names)
        lan_links.write_png(str(png), series, parse_rate(a.rate), title, spans=[(t0, t1, "timed")])
        r.update(timeline=str(path), timeline_png=str(png), timeline_dropped=other["dropped"])
    return r


def run(a) -> int:
    """Build the LAN, run every case, remove the LAN (also on error, SIGTERM or Ctrl-C);
    blocks until done. Exit code 2 where the LAN cannot be built."""
    common.resolve_quick(a, DEFAULTS, QUICK)
    lam = a.hosts * a.per_host
    if a.epoch_gradients % lam:
        raise ValueError(
            f"--epoch-gradients {a.epoch_gradients} must be a multiple of λ = "
            f"{lam} (hardsync updates take one gradient per learner)"
        )
    parse_rate(a.rate)  # a bad rate stops here, not after a case ran (each row's bound)
    if min(a.servers) < 1 or max(a.servers) > a.params:
        raise ValueError(f"--servers {a.servers}: each K must be 1 to --params")
    if min(a.parts) < 1 or max(a.parts) > MAX_PARTS:
        raise ValueError(f"--parts {a.parts}: each P must be 1 to {MAX_PARTS} (wire.parts)")
    sndbufs = a.sndbuf_kib
    if min(sndbufs) < 0:
        raise ValueError(f"--sndbuf-kib {sndbufs}: each must be >= 0 (0: the kernel sizes it)")
    if "product" in a.learner and a.params // a.layers < 10:
        raise ValueError(f"--learner product: --params {a.params} in --layers {a.layers} "
                         "leave fewer than 10 parameters a layer")  # fmt: skip
    traces = timeline.Output(a.timeline, _n_runs(a)) if a.timeline else None
    netns_sh = a.netns_sh or find_netns_sh()
    why = lan_available() or (None if netns_sh else f"{NETNS_SH} not found (--netns-sh)")
    if why:
        print(f"table1: cannot build the emulated LAN: {why}", file=sys.stderr)
        return 2
    cases = list(a.cases)
    report = common.Report(
        a,
        "Table 1 on emulated LAN hosts (netns + tbf)",
        notes=[
            f"hosts: root on host 0; λ={lam} learners, {a.per_host} per host on {a.hosts} hosts; "
            f"each host link {a.rate} both ways (tc tbf); adv: fanout {a.per_host}, depth 1, "
            "leaves on their learners' host (ipc)",
            *(
                [
                    f"learners --learner product: the product's learner (learner/learner.py, "
                    f"pushing each part as backward finishes it) training the synthetic model "
                    f"of {a.layers} layers sleeping {a.compute_ms:g} ms in all, a third forward "
                    "(synthetic_model.py, given as model.name); the ddp case runs the same module"
                ]
                if "product" in a.learner
                else []
            ),
            f"learners: sleep {a.compute_ms:g} ms ±10 % then push {a.params:,} parameters as "
            f"{'/'.join(a.wire_dtypes)} (gradients and weights; PUSHPULL; "
            "advstar: PUSH, weights by broadcast); "
            f"epoch = {a.epoch_gradients} gradients; {a.epochs} epochs, the first a warm-up; "
            "softsync = 1-softsync; root: ParameterServer, momentum 0.9, 1 thread",
            "s/epoch = median over the timed epochs, at the root; root in = bytes of every frame "
            "reaching the root's handler; out = weights it sent (replies, and advstar's broadcast "
            "chain of the learners); expected order (slowest first): " + " > ".join(CASES),
        ],
    )
    if "advstar-softsync" in cases and not sc.advstar_available():
        report.note(
            "advstar-softsync skipped: rudra_zmq/broadcast/ (Rudra-adv*) is not available yet",
            skipped="advstar-softsync",
        )
        cases.remove("advstar-softsync")
    old = signal.signal(signal.SIGTERM, _interrupt)  # `kill` cleans up like Ctrl-C
    # ... and SIGINT is Ctrl-C even where it was inherited ignored (a shell starts background
    # jobs that way, and Python then installs no handler): the namespaces must go either way
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    workdir = tempfile.mkdtemp(prefix="rzt-")  # removed unless a case fails: its logs stay
    kept = False
    try:
        with Lan(a.hosts + 1 + lan_shards.extra_hosts(a), a.rate, netns_sh) as lan:
            os.chmod(workdir, 0o755)
            if "product" in a.learner:  # the module every role builds: a user model
                from .synthetic_model import write_module  # torch: for this learner only

                ms = a.compute_ms
                fwd, bwd = ms * FORWARD_SHARE, ms * (1 - FORWARD_SHARE)
                a.model = (write_module(workdir, a.params, a.layers, fwd, bwd), workdir)
            for case in cases:
                for dtype in a.wire_dtypes:
                    if case in BASELINES and dtype == "bfloat16":
                        report.note(f"{case} bfloat16 skipped: DDP's hook is float16 here")
                        continue
                    for k, where, parts in _variants(case, a):
                        for sb, local, learner, st, pr in _transports(case, a, k, where, parts):
                            b = copy.copy(a)
                            b.sndbuf_kib, b.local, b.learner, b.stripes = sb, local, learner, st
                            b.priority = pr
                            r = _sampled(b, lan, workdir, case, dtype, k, where, parts, traces)
                            report.case(r, line(r))
    except Exception:  # a case failed (Ctrl-C and SIGTERM leave nothing behind)
        kept = True
        print(f"table1: the roles' logs of the failed case are kept in {workdir}", file=sys.stderr)
        raise
    finally:
        if not kept:
            shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    table1 = [r for r in report.rows if r["wire_dtype"] == "float32" and r["case"] in CASES]
    if len(table1) >= 2:
        order, ok = ordering(table1, CASES)
        report.note(
            f"measured order (slowest first): {order}; expected order "
            f"{'reproduced' if ok else 'NOT reproduced'}",
            order=order,
            reproduced=ok,
        )
    else:  # one case (or none) has no order to reproduce
        report.note("Table 1's order: not measured (it takes two of its cases on float32)")
    report.close()
    if a.png and report.rows:
        write_png(a.png, report.rows)
    return 0
