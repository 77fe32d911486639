"""Root ingress of Rudra-base, Rudra-adv and Rudra-adv*: bytes the root PS receives per update,
and time per update, counted at the root's handler (not computed from the tree's shape).

λ torch-free synthetic learners (``rudra_zmq.benchmarks.synthetic_roles``, one process each)
push fixed 10M-parameter gradients back to back (no compute) over tcp loopback to the real
ParameterServer (synthetic model, momentum SGD 0.9, weight decay 0.0005, 1 kernel thread),
directly (base) or through a tree of real TreeNodes (adv: fan-out 4, depth 1; leaves on ipc
beside their learners, as ``rudra-zmq run`` places them), or Rudra-adv* (when available). The
root is a ``CountingPS``: it counts every frame after the routing id that reaches its handler,
the gradient payloads of PUSH/PUSHPULL/RELAY, and the weights it sends, and logs them at each
update. The first ``--warmup-updates`` updates are skipped; figures are over the rest.

Protocols: 1-softsync (c = λ gradients per update, no barrier: a leaf relays whatever is
pending as soon as its previous relay is answered) and hardsync (each update one gradient per
learner: a leaf relays once all its learners contributed, so the root gets λ/fanout messages).

    rudra-zmq bench root-ingress                       # λ=16, 10M, base/adv/advstar x 2 protocols
    rudra-zmq bench root-ingress --quick               # λ=4, 10k parameters, seconds
    rudra-zmq bench root-ingress --archs base adv --protocols softsync --csv out.csv --png out.png
"""

from __future__ import annotations

import tempfile

from . import common
from . import synthetic_cluster as sc
from . import synthetic_roles as sr

LEARNERS = 16
PARAMS = 10_000_000
FANOUT = 4
DEPTH = 1
SOFTSYNC_N = 1
WARMUP_UPDATES = 3
TIMED_UPDATES = 11
ARCHS = ["base", "adv", "advstar"]
PROTOCOLS = ["softsync", "hardsync"]
DEFAULTS = dict(
    learners=LEARNERS,
    params=PARAMS,
    fanout=FANOUT,
    warmup_updates=WARMUP_UPDATES,
    timed_updates=TIMED_UPDATES,
)
QUICK = dict(learners=4, params=10_000, fanout=2, warmup_updates=2, timed_updates=7)
MIB = 2**20


def window(ps: dict, warmup: int) -> dict:
    """Per-update figures between the end of update ``warmup`` and the end of the one before
    the last (the last one ends training: it is answered with STOP instead of weights)."""
    rows = [dict(zip(ps["log_fields"], r)) for r in ps["log"]]
    if len(rows) < warmup + 3:
        raise RuntimeError(
            f"only {len(rows)} updates happened; need more than "
            f"--warmup-updates {warmup} + 2 (raise --timed-updates)"
        )
    a, b = rows[warmup - 1], rows[-2]
    k = len(rows) - 1 - warmup
    d = {
        f: b[f] - a[f]
        for f in (
            "t",
            "grads",
            "rx_bytes",
            "rx_grad_bytes",
            "rx_grad_msgs",
            "tx_bytes",
            "bcast_bytes",
        )
    }
    return {
        "updates": k,
        "s_per_update": d["t"] / k,
        "grads_per_update": d["grads"] / k,
        "root_rx_bytes_per_update": d["rx_bytes"] / k,
        "root_grad_bytes_per_update": d["rx_grad_bytes"] / k,
        "root_grad_msgs_per_update": d["rx_grad_msgs"] / k,
        "root_rx_bytes_per_gradient": d["rx_bytes"] / d["grads"],
        "root_tx_bytes_per_update": (d["tx_bytes"] + d["bcast_bytes"]) / k,
        "root_bcast_bytes_per_update": d["bcast_bytes"] / k,
        "grads_per_root_msg": d["grads"] / d["rx_grad_msgs"],
        "mean_sigma": sum(r["mean_sigma"] for r in rows[warmup:]) / k,
    }


def run_case(arch: str, protocol: str, a, workdir: str) -> dict:
    c = a.learners // SOFTSYNC_N if protocol == "softsync" else a.learners
    ov = sr.overrides(
        arch,
        protocol,
        a.learners,
        (a.warmup_updates + a.timed_updates) * c,
        softsync_n=SOFTSYNC_N,
        fanout=a.fanout,
        depth=DEPTH,
        relay=a.relay,
    )
    r = sc.run(
        arch,
        ov,
        params=a.params,
        learners=a.learners,
        root=sc.Host(),
        hosts=[sc.Host()],
        workdir=workdir,
    )
    ps = r["ps"]
    # consistency: every gradient message the root took carried exactly one model's bytes
    if ps["rx_grad_bytes"] != ps["numel"] * 4 * ps["rx_grad_msgs"]:
        raise RuntimeError(
            f"root counted {ps['rx_grad_bytes']} gradient bytes in "
            f"{ps['rx_grad_msgs']} messages of {ps['numel']} float32"
        )
    procs = [ps] + r["nodes"] + r["learners"]
    steps = [lr["steps"] for p in r["learners"] for lr in p["learners"]]
    return {
        "bench": "root_ingress",
        "arch": arch,
        "protocol": protocol,
        "label": f"{arch} {protocol}"
        + (" gather" if arch != "base" and a.relay == "gather" else ""),
        "relay": a.relay if arch != "base" else "-",
        "learners": a.learners,
        "params": a.params,
        "fanout": a.fanout if arch != "base" else 1,
        "softsync_n": SOFTSYNC_N,
        **window(ps, a.warmup_updates),
        "root_rx_bytes_total": ps["rx_bytes"],
        "root_grad_bytes_total": ps["rx_grad_bytes"],
        "root_grad_msgs_total": ps["rx_grad_msgs"],
        "numel": ps["numel"],
        "grads_total": ps["grads"],
        "updates_total": ps["updates"],
        "learner_steps_min": min(steps),
        "learner_steps_max": max(steps),
        "root_cpu_s": ps["cpu_s"],
        "nodes_cpu_s": sum(n["cpu_s"] for n in r["nodes"]),
        "learners_cpu_s": sum(p["cpu_s"] for p in r["learners"]),
        "processes": len(procs),
        "rss_sum_mib": sum(p["maxrss_kib"] for p in procs) / 1024,
        "rss_root_mib": ps["maxrss_kib"] / 1024,
        "rss_learner_max_mib": max(p["maxrss_kib"] for p in r["learners"]) / 1024,
        "wall_s": r["wall_s"],
    }


def line(r: dict, base: dict | None) -> str:
    ref = ""
    if base is not None and r is not base:
        less = base["root_rx_bytes_per_update"] / r["root_rx_bytes_per_update"]
        less_g = base["root_rx_bytes_per_gradient"] / r["root_rx_bytes_per_gradient"]
        ref = (
            f" | base {base['root_rx_bytes_per_update'] / MIB:8.1f} MiB/upd "
            f"{base['s_per_update']:.3f} s/upd: ingress/upd {less:.2f}x less, per gradient "
            f"{less_g:.2f}x less, time {r['s_per_update'] / base['s_per_update']:.2f}x"
        )
    return (
        f"root_ingress {r['arch']:<7} {r['protocol']:<8} λ={r['learners']} "
        f"n={common.fmt_count(r['params'])} fanout={r['fanout']} relay={r['relay']}  root in "
        f"{r['root_rx_bytes_per_update'] / MIB:8.1f} MiB/upd "
        f"({r['root_grad_msgs_per_update']:.2f} msgs, {r['grads_per_update']:.2f} grads, "
        f"{r['grads_per_root_msg']:.2f} grads/msg) out "
        f"{r['root_tx_bytes_per_update'] / MIB:7.1f} MiB/upd  {r['s_per_update']:.3f} "
        f"s/upd over {r['updates']} upd  <σ> {r['mean_sigma']:.2f}{ref} | RSS sum "
        f"{r['rss_sum_mib'] / 1024:.2f} GiB ({r['processes']} procs) | cpu s root "
        f"{r['root_cpu_s']:.1f} nodes {r['nodes_cpu_s']:.1f} learners "
        f"{r['learners_cpu_s']:.1f} | wall {r['wall_s']:.1f} s"
    )


def write_png(path: str, rows: list[dict]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    width = 0.8 / max(len(archs), 1)
    for ax, (key, scale, label) in zip(
        axes,
        [
            ("root_rx_bytes_per_update", MIB, "root ingress per update (MiB)"),
            ("s_per_update", 1, "time per update (s)"),
        ],
    ):
        for j, arch in enumerate(archs):
            xs, ys = [], []
            for i, p in enumerate(protocols):
                hit = [r for r in rows if r["arch"] == arch and r["protocol"] == p]
                if hit:
                    xs.append(i + j * width)
                    ys.append(hit[0][key] / scale)
            ax.bar(xs, ys, width, label=arch)
        ax.set_xticks([i + width * (len(archs) - 1) / 2 for i in range(len(protocols))], protocols)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    r0 = rows[0]
    title = (
        f"rudra_zmq root ingress: λ={r0['learners']}, "
        f"{common.fmt_count(r0['params'])} parameters, tcp loopback"
    )
    common.save_png(fig, title, path)


def add_arguments(p) -> None:
    p.add_argument("--learners", type=int, help=f"λ (default {LEARNERS}; --quick 4)")
    p.add_argument(
        "--params",
        type=common.parse_size,
        help=f"model size in float32 (default {PARAMS:,}; K/M/Ki/Mi accepted)",
    )
    p.add_argument("--fanout", type=int, help=f"tree fan-out (default {FANOUT})")
    p.add_argument(
        "--relay",
        choices=("eager", "gather"),
        default="eager",
        help="architecture.relay of the tree nodes under softsync (gather: relay "
        "only whole subtrees)",
    )
    p.add_argument("--archs", nargs="+", default=ARCHS, choices=sr.ARCHS)
    p.add_argument("--protocols", nargs="+", default=PROTOCOLS, choices=PROTOCOLS)
    p.add_argument("--warmup-updates", type=int, help=f"default {WARMUP_UPDATES}")
    p.add_argument(
        "--timed-updates",
        type=int,
        help=f"updates after the warm-up (the last one, answered STOP, not timed; "
        f"default {TIMED_UPDATES})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny run (λ=4, 10k parameters, fanout 2) to check the harness",
    )
    common.add_output_args(p)


def run(a) -> int:
    """Run every (protocol, architecture) case in turn; blocks until done."""
    common.resolve_quick(a, DEFAULTS, QUICK)
    if a.warmup_updates < 1 or a.timed_updates < 3:
        raise ValueError("--warmup-updates must be >= 1 and --timed-updates >= 3")
    if a.learners % a.fanout:
        raise ValueError(f"--learners {a.learners} must be a multiple of --fanout {a.fanout}")
    archs = list(a.archs)
    report = common.Report(
        a,
        "root ingress (Rudra-base vs adv vs adv*)",
        notes=[
            f"λ={a.learners} synthetic learners (one process each, no compute), "
            f"{a.params:,} float32 parameters, tcp loopback; adv: fanout {a.fanout}, depth {DEPTH}, "
            "leaves on ipc beside their learners; root: ParameterServer, momentum 0.9, 1 thread",
            f"softsync = {SOFTSYNC_N}-softsync (c = λ/{SOFTSYNC_N} gradients per update); "
            f"figures over the updates after the first {a.warmup_updates}, except the last "
            "(it ends training: answered with STOP, not weights)",
            "root in = bytes of every frame after the routing id reaching the root's handler, per "
            "update (counted in the root); msgs = gradient messages (PUSHPULL or RELAY) per update; "
            "out = weight payload bytes the root sent per update (replies, plus the broadcast for "
            "advstar)",
            "advstar (Rudra-adv*): the adv tree carries the gradients (PUSH, answered ACK), the "
            "weights go from the root down a broadcast chain of the learners "
            "(architecture.broadcast_fanout 1); hardsync is not defined for it (skipped)",
            "ratios: base's figure / this one (ingress: higher = less for the root), time: this / "
            "base",
        ],
    )
    if "advstar" in archs and not sc.advstar_available():
        report.note(
            "advstar skipped: rudra_zmq/broadcast/ (Rudra-adv*) is not available yet",
            skipped="advstar",
        )
        archs.remove("advstar")
    with tempfile.TemporaryDirectory(prefix="rzi-") as workdir:
        for protocol in a.protocols:
            base = None
            for arch in archs:
                if arch == "advstar" and protocol == "hardsync":
                    continue  # the config refuses it: advstar learners never wait
                r = run_case(arch, protocol, a, workdir)
                if arch == "base":
                    base = r
                if base is not None and r is not base:
                    r["ingress_per_update_vs_base"] = (
                        base["root_rx_bytes_per_update"] / r["root_rx_bytes_per_update"]
                    )
                    r["ingress_per_gradient_vs_base"] = (
                        base["root_rx_bytes_per_gradient"] / r["root_rx_bytes_per_gradient"]
                    )
                    r["time_vs_base"] = r["s_per_update"] / base["s_per_update"]
                report.case(r, line(r, base))
    report.close()
    if a.png and report.rows:
        write_png(a.png, report.rows)
    return 0
