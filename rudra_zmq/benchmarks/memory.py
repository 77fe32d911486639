"""Memory of whole runs: peaks beside the machine's RAM, and (``--drift``) each role over time.

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

``--drift MINUTES`` asks instead whether a long run stays flat: one ``rudra-zmq run`` of the
case (default ``K=2, parts, float16``: the quickstart model with two servers, hardsync in 4
parts, half precision on the wire, epochs enough for any length) is sampled every ``--every``
seconds (default 60) for MINUTES, then stopped as Ctrl-C would (SIGINT: the run's result is
not the point, and none is printed). Each role's process, named as the launcher names it in
``RUN/processes.json`` (a restarted one keeps its name), gives its RSS, its open file
descriptors and its sockets (``/proc/PID/fd`` links to ``socket:``: TCP, IPC, and libzmq's
own). ``--out DIR`` gets ``drift.csv`` (one row per role and sample), ``drift.png`` (the three
against minutes) and the run directory; one line per role says whether it was flat after
``--warmup`` minutes: RSS within ``--flat-pct`` percent (default 5) of its first sample
after warm-up, descriptors and sockets within 2.

    rudra-zmq bench memory --drift 30 --out bench/out/drift      # ~31 minutes
"""

from __future__ import annotations

import contextlib
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
LONG = [  # --drift's default case: every moving part of a sharded, half-precision run
    "architecture.servers=2",
    "sync.protocol=hardsync",
    "wire.parts=4",
    "wire.gradient_dtype=float16",
    "wire.weights_dtype=float16",
    "train.epochs=1000000",  # stopped by the bench, never by running out
]
PEAK_CASES = list(CASES)  # the peak cases, run by default (LONG trains until stopped)
CASES["K=2, parts, float16"] = LONG
DRIFT_EVERY_S = 60.0
WARMUP_MIN = 5.0
FLAT_PCT = 5.0
FLAT_COUNT = 2  # descriptors and sockets may differ by this much (a reconnect in flight)
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


def role_sample(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open file descriptors, sockets) of process ``pid``, None once it is gone.
    Sockets are the descriptors that link to ``socket:[inode]``. Reads /proc."""
    import psutil

    try:
        p = psutil.Process(pid)
        rss, fds = p.memory_info().rss, p.num_fds()
        sockets = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed between the listing and the link
                sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, OSError):
        return None
    return rss, fds, sockets


def drift(overrides, minutes: float, every: float, config: str, out_dir: str) -> tuple:
    """Run one ``rudra-zmq run`` (its directory ``OUT/run``) for ``minutes`` and sample each
    role every ``every`` seconds (module docstring); then stop it with SIGINT. Returns (rows:
    dicts of minute, role, pid, rss, fds, sockets; the launcher's exit code). Blocks."""
    import json
    import signal

    run_dir = os.path.join(out_dir, "run")
    cmd = [
        sys.executable, "-m", "rudra_zmq", "run", config, "--run-dir", run_dir,
        *(a for o in overrides for a in ("--set", o)),
    ]  # fmt: skip
    rows = []
    with open(os.path.join(out_dir, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        try:
            for k in range(int(minutes * 60 / every) + 1):
                time.sleep(max(0.0, t0 + k * every - time.monotonic()))
                if proc.poll() is not None:
                    break
                try:
                    with open(os.path.join(run_dir, "processes.json")) as f:
                        roles = [(p["role"], p["pid"]) for p in json.load(f)]
                except (OSError, ValueError, KeyError, TypeError):
                    roles = []  # not written yet, or being rewritten
                minute = (time.monotonic() - t0) / 60
                for role, pid in [("launcher", proc.pid), *roles]:
                    got = role_sample(pid)
                    if got is not None:
                        rss, fds, sockets = got
                        rows.append(dict(minute=round(minute, 3), role=role, pid=pid, rss=rss,
                                         fds=fds, sockets=sockets))  # fmt: skip
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the launcher stops its roles, as on Ctrl-C
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return rows, proc.returncode


def flatness(rows, warmup: float, flat_pct: float) -> list[dict]:
    """Per role, after ``warmup`` minutes: its first and last sample and the largest RSS,
    descriptors and sockets seen, and whether it stayed flat (RSS within ``flat_pct``
    percent of the first sample after warm-up, descriptors and sockets within
    ``FLAT_COUNT``). Pure."""
    out = []
    for role in dict.fromkeys(r["role"] for r in rows):
        mine = [r for r in rows if r["role"] == role and r["minute"] >= warmup]
        if len(mine) < 2:
            continue
        first, last = mine[0], mine[-1]
        top = {k: max(r[k] for r in mine) for k in ("rss", "fds", "sockets")}
        low = {k: min(r[k] for r in mine) for k in ("rss", "fds", "sockets")}
        rss_pct = 100 * (top["rss"] - first["rss"]) / first["rss"]
        flat = (
            rss_pct <= flat_pct
            and top["fds"] - low["fds"] <= FLAT_COUNT
            and top["sockets"] - low["sockets"] <= FLAT_COUNT
        )
        out.append(dict(role=role, first=first, last=last, top=top, low=low, rss_pct=rss_pct,
                        samples=len(mine), pids=len({r["pid"] for r in mine}), flat=flat))  # fmt: skip
    return out


def write_drift(rows, out_dir: str, warmup: float) -> tuple[str, str]:
    """``drift.csv`` and ``drift.png`` (each role's RSS as a change from its first sample
    after warm-up, its descriptors and sockets, against minutes; the warm-up shaded) in
    ``out_dir``; returns their paths."""
    from pathlib import Path

    from ..results.plots import _figure, _save

    path_csv = os.path.join(out_dir, "drift.csv")
    with open(path_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["minute", "role", "pid", "rss", "fds", "sockets"])
        w.writeheader()
        w.writerows(rows)
    fig, ax = _figure(nrows=3, size=(8.0, 3.0), sharex=True)
    for role in dict.fromkeys(r["role"] for r in rows):
        mine = [r for r in rows if r["role"] == role]
        x = [r["minute"] for r in mine]
        base = next((r["rss"] for r in mine if r["minute"] >= warmup), mine[-1]["rss"])
        label = f"{role} ({base / 2**20:.0f} MiB)"
        ax[0, 0].plot(x, [100 * (r["rss"] - base) / base for r in mine], ".-", lw=1, label=label)
        ax[1, 0].plot(x, [r["fds"] for r in mine], ".-", lw=1)
        ax[2, 0].plot(x, [r["sockets"] for r in mine], ".-", lw=1)
    ax[0, 0].set_ylim(-10, 10)
    labels = ("RSS change after warm-up (%)", "open descriptors", "sockets")
    for a, label in zip(ax[:, 0], labels):
        a.set_ylabel(label)
        a.axvspan(0, warmup, color="0.9")
        a.grid(True, alpha=0.3)
    ax[0, 0].legend(fontsize="small", ncol=3)
    ax[0, 0].set_title(f"each role over a long run (warm-up shaded: first {warmup:g} min)")
    ax[-1, 0].set_xlabel("minutes")
    return path_csv, str(_save(fig, Path(out_dir) / "drift.png"))


def run_drift(args) -> int:
    """``--drift``: one long run of ``args.cases[0]``, sampled; the table of roles."""
    case = args.cases[0] if args.cases else "K=2, parts, float16"
    os.makedirs(args.out, exist_ok=True)
    facts = common.machine_facts()
    print(
        common.header_text(
            "memory drift",
            facts,
            notes=[
                f"case {case!r}: {os.path.relpath(args.config)} --set {' '.join(CASES[case])}",
                f"sampled every {args.every:g} s for {args.drift:g} min; flat = RSS within "
                f"{args.flat_pct:g} % of its first sample after {args.warmup:g} min of warm-up, "
                f"descriptors and sockets within {FLAT_COUNT}",
            ],
        ),
        flush=True,
    )
    rows, rc = drift(CASES[case], args.drift, args.every, args.config, args.out)
    paths = write_drift(rows, args.out, args.warmup) if rows else ()
    flat_all = True
    for r in flatness(rows, args.warmup, args.flat_pct):
        f, la, t = r["first"], r["last"], r["top"]
        flat_all &= r["flat"]
        print(
            f"drift {r['role']:<12} RSS {f['rss'] / 2**20:7.1f} -> {la['rss'] / 2**20:7.1f} MiB "
            f"(max {t['rss'] / 2**20:7.1f}, {r['rss_pct']:+5.1f} %)  fds {f['fds']} -> "
            f"{la['fds']} (max {t['fds']})  sockets {f['sockets']} -> {la['sockets']} (max "
            f"{t['sockets']})  {r['samples']} samples"
            + (f", {r['pids']} processes" if r["pids"] > 1 else "")
            + f"  {'FLAT' if r['flat'] else 'GROWS'}",
            flush=True,
        )
    print(f"# launcher exit {rc} (130: stopped by the bench with SIGINT); " + ", ".join(paths))
    return 0 if flat_all and rows else 1


def add_arguments(ap) -> None:
    ap.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASES),
        help=f"default: {', '.join(PEAK_CASES)}; with --drift, 'K=2, parts, float16'",
    )
    ap.add_argument("--config", help=f"the run's config (default {CONFIG} of the source tree)")
    ap.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    ap.add_argument("--csv", metavar="PATH", help="also write one row per case here")
    ap.add_argument(
        "--drift",
        type=float,
        metavar="MINUTES",
        help="one long run of the first case given (default 'K=2, parts, float16'), each "
        "role sampled every --every s: RSS, descriptors, sockets (drift.csv, drift.png)",
    )
    ap.add_argument(
        "--every", type=float, default=DRIFT_EVERY_S, help="--drift: seconds per sample"
    )
    ap.add_argument("--warmup", type=float, default=WARMUP_MIN, help="--drift: minutes left out")
    ap.add_argument("--flat-pct", type=float, default=FLAT_PCT, help="--drift: RSS tolerance, %%")
    ap.add_argument("--out", default=os.path.join("bench", "out", "drift"), help="--drift: where")


def run(args) -> int:
    """Run and sample every case in turn, then the verdict; blocks until done."""
    import psutil

    args.config = find_config(args.config)
    if args.drift:
        return run_drift(args)
    args.cases = args.cases or PEAK_CASES
    if "K=2, parts, float16" in args.cases:
        raise ValueError("the case 'K=2, parts, float16' trains until stopped: give --drift")
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
