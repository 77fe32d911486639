"""Peak memory of whole runs: ``rudra-zmq run`` sampled every 0.2 s, beside the machine's RAM.

Each case launches ``rudra-zmq run`` as a subprocess (a user's command, in a temporary run
directory) and samples the launcher and all its descendants with psutil every ``--interval``
seconds: the sum of RSS (counts shared pages once per process, so it overstates), the sum of
PSS (shared pages split fairly between the processes that map them: the honest total) and of
USS (private pages only), and the machine's used memory (``total - available`` from
``psutil.virtual_memory``) relative to just before the launch (includes other users' jobs on
this shared box, so it is an upper bound of ours plus noise). One line per case shows the
peaks beside the machine's total RAM (the baseline: it must fit) and the run's wall time.

    rudra-zmq bench memory                              # defaults below, ~4-6 minutes
    rudra-zmq bench memory --cases quickstart --csv bench/out/memory.csv
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time

from . import common

# ----------------------------------------------------------------------------- defaults
CONFIG = os.path.join("configs", "quickstart.yaml")  # in the source tree
INTERVAL_S = 0.2
THIRTY = ["sync.learners=30", "sync.batch_size=4", "train.epochs=2"]
CASES = {  # name -> --set overrides on configs/quickstart.yaml
    "quickstart": [],
    "30 learners, 1/process": THIRTY,
    "30 learners, 5/process": THIRTY + ["runtime.learners_per_process=5"],
    "30 learners, 10/process": THIRTY + ["runtime.learners_per_process=10"],
}
GOAL_GIB = 24.0  # must fit in the machine's 24 GiB
GIB = 2**30


def role_of(cmdline):
    """'launcher', 'ps', 'learner', 'data', 'stats' or 'other' from a process's command line."""
    if "rudra_zmq" in " ".join(cmdline[:3]) or any(c.endswith("rudra-zmq") for c in cmdline[:2]):
        for role in ("run", "ps", "learner", "data", "stats"):
            if role in cmdline[1:4]:
                return "launcher" if role == "run" else role
    return "other"


def find_config(path: str | None) -> str:
    """``path``, else ``configs/quickstart.yaml`` of the source tree this package runs from or
    of the current directory; ValueError if none exists."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for p in [path] if path else [os.path.join(repo, CONFIG), CONFIG]:
        if os.path.isfile(p):
            return p
    raise ValueError(f"config {path or CONFIG} not found (give --config)")


def sample(root_pid, roles):
    """(rss, pss, uss, n) summed over root_pid and its descendants; updates ``roles`` with
    each role's largest single-process PSS. Processes that vanish mid-sample are skipped."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = pss = uss = n = 0
    for p in procs:
        try:
            m = p.memory_full_info()
            # a child caught between fork and exec still shows the launcher's command line
            if p.pid not in roles or (p.pid != root_pid and roles[p.pid][0] == "launcher"):
                roles[p.pid] = [role_of(p.cmdline()), *roles.get(p.pid, [None, 0, 0])[1:]]
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        rss, pss, uss, n = rss + m.rss, pss + m.pss, uss + m.uss, n + 1
        r = roles[p.pid]
        r[1], r[2] = max(r[1], m.pss), max(r[2], m.rss)
    return rss, pss, uss, n


def used():
    import psutil

    vm = psutil.virtual_memory()
    return vm.total - vm.available


def measure(name, overrides, interval, config, keep):
    """Launch one ``rudra-zmq run`` and sample it until it exits (blocks); its peaks."""
    root = tempfile.mkdtemp(prefix="bench-memory-")
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "run",
        config,
        "--run-dir",
        os.path.join(root, "run"),
        *(a for o in overrides for a in ("--set", o)),
    ]
    used0 = used()
    peak = {"rss": 0, "pss": 0, "uss": 0, "n": 0, "sys": 0}
    roles, sample_s = {}, []
    t0 = time.time()
    with open(os.path.join(root, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            ts = time.perf_counter()
            s = sample(proc.pid, roles)
            sample_s.append(time.perf_counter() - ts)
            if s is not None:
                for k, v in zip(("rss", "pss", "uss", "n"), s):
                    peak[k] = max(peak[k], v)
            peak["sys"] = max(peak["sys"], used() - used0)
            time.sleep(max(0.0, interval - (time.perf_counter() - ts)))
    wall = time.time() - t0
    by_role = {}
    for role, p_pss, p_rss in roles.values():
        cnt, mx_pss, mx_rss = by_role.get(role, (0, 0, 0))
        by_role[role] = (cnt + 1, max(mx_pss, p_pss), max(mx_rss, p_rss))
    if not keep and proc.returncode == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {
        "case": name,
        "rc": proc.returncode,
        "wall_s": wall,
        "samples": len(sample_s),
        "sample_ms_median": sorted(sample_s)[len(sample_s) // 2] * 1e3 if sample_s else 0,
        "peak_rss": peak["rss"],
        "peak_pss": peak["pss"],
        "peak_uss": peak["uss"],
        "peak_procs": peak["n"],
        "peak_sys_delta": peak["sys"],
        "used_before": used0,
        "by_role": by_role,
        "root": root,
    }


def add_arguments(ap) -> None:
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--config", help=f"the run's config (default {CONFIG} of the source tree)")
    ap.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    ap.add_argument("--csv", metavar="PATH", help="also write one row per case here")


def run(args) -> int:
    """Run and sample every case in turn, then the verdict; blocks until done."""
    import psutil

    args.config = find_config(args.config)
    mem = psutil.virtual_memory()
    total = mem.total
    facts = common.machine_facts(psutil=psutil.__version__)
    print(
        common.header_text(
            "memory benchmark",
            facts,
            notes=[
                f"RAM total {total / GIB:.1f} GiB, available {mem.available / GIB:.1f} GiB",
                f"config {os.path.relpath(args.config)}; sampled every {args.interval:g} s: launcher "
                f"+ all descendants; sys = peak (total - available) minus its value before launch",
            ],
        ),
        flush=True,
    )
    rows = []
    for name in args.cases:
        r = measure(name, CASES[name], args.interval, args.config, args.keep)
        rows.append(r)
        roles = "  ".join(
            f"{role} x{c} {p / 2**20:.0f}/{rs / 2**20:.0f}"
            for role, (c, p, rs) in sorted(r["by_role"].items())
        )
        print(
            f"memory {name:<24} peak sum RSS {r['peak_rss'] / GIB:6.2f} GiB  PSS "
            f"{r['peak_pss'] / GIB:6.2f} GiB  USS {r['peak_uss'] / GIB:6.2f} GiB  sys +"
            f"{r['peak_sys_delta'] / GIB:6.2f} GiB | machine {total / GIB:5.1f} GiB | PSS/RAM "
            f"{r['peak_pss'] / total:5.1%}  procs {r['peak_procs']}  wall {r['wall_s']:5.1f} s"
            f"  rc {r['rc']}  loadavg {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print(
            f"#   per role (processes, max MiB PSS/RSS of one): {roles}; {r['samples']} samples,"
            f" one every {r['wall_s'] / max(r['samples'], 1):.2f} s, each took "
            f"{r['sample_ms_median']:.1f} ms (median)"
            + ("" if r["rc"] == 0 else f"; logs kept in {r['root']}"),
            flush=True,
        )
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        keys = [k for k in rows[0] if k not in ("by_role",)]
        with open(args.csv, "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows)
    print(
        f"# goal: every case fits in {GOAL_GIB:g} GiB (judged on peak PSS sum and on the "
        f"system delta)  (loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})"
    )
    for r in rows:
        worst = max(r["peak_pss"], r["peak_sys_delta"]) / GIB
        ok = r["rc"] == 0 and worst < GOAL_GIB and worst * GIB < total
        print(
            f"{'PASS' if ok else 'MISS'}  {r['case']:<24} want < {GOAL_GIB:g} GiB  got "
            f"{worst:.2f} GiB" + ("" if r["rc"] == 0 else f" (run failed, rc {r['rc']})")
        )
    return 0
