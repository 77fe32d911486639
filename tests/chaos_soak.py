"""The chaos soak at scale: `rudra-zmq run` of the quickstart with four parameter servers
(``architecture.servers=4``) and float16 on the wire, a role SIGKILLed every few seconds, drawn
from a seed; and the same run without kills, to say what spread a fault-free run has.

Two shapes, one per seed's parity (``wire.parts`` needs hardsync and whole-vector servers,
the trees need softsync's relays, so no one run has both):

- ``parts`` (even seeds): base, hardsync, ``wire.parts=2``, float16 gradients and weights;
- ``adv`` (odd seeds): Rudra-adv, one tree of two leaves per range, 1-softsync, float16.

Each kill picks a kind uniformly among those the shape has -- a server (any of the four), a
tree node (adv: any of the eight), a learner process, the data server, the statistics
server -- then one process of that kind. Servers checkpoint every ``CKPT_EVERY`` updates, so a
restarted server resumes from its range's checkpoint (without one it would start its range
over: issue 45 item 1). A chaos run passes when it exits 0 with at least 3 kills landed, its
result line is the evaluation of the final weights (``ps_final.json``'s timestamp), the
weights are finite, no process outlives it, every kill is in the records (the launcher's
``processes.json`` holds the killed pid with exit -9 and a newer process of its label; each
restart of a server is a "resumed from CHECKPOINT" line in its log), its final test error is
at most the fault-free runs' mean + 3 standard deviations (over its shape's seeds), and its
weights' norm lies within 3 of those runs' standard deviations of its own seed's fault-free
norm (the norm depends on the seed: at 9f2f8ad a fault-free run of seed 5 ended at 13.39,
of seeds 1, 3 and 11 at 10.4-11.2, so a bound centred on the seeds' mean failed seed 5 for
its seed, not its faults).

As a script (``bench/chaos_soak.sh`` runs the 20 seeds, 5 at a time)::

    python tests/chaos_soak.py run 0-4 --out runs/soak          # chaos runs of seeds 0..4
    python tests/chaos_soak.py run 0-4 --out runs/soak --calm   # the same seeds, no kills
    python tests/chaos_soak.py summary runs/soak                # spread, verdict per seed

Each run leaves ``OUT/{chaos,calm}-SEED.json`` (what was checked) beside its run directory.
``tests/test_soak.py`` runs one seed of this as the suite's smoke test."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fault_runs import newest_ts, pid_of, records, role_pids  # noqa: E402

K = 4  # parameter servers
EPOCHS = 40  # of the 1,437 digits at µλ = 64: ~900 updates per server
CKPT_EVERY = 20  # updates between two checkpoints of a server's range
GAP_S = (2.0, 5.0)  # seconds between two kills, uniform
KILL_WINDOW_S = 150  # no kill later than this after training started
RUN_LIMIT_S = 420  # the run must have ended this long after training started
SPREAD_SIGMAS = 3.0
COMMON = [
    f"architecture.servers={K}",
    "wire.gradient_dtype=float16",
    "wire.weights_dtype=float16",
    "train.eval_every_epochs=10",
    f"train.checkpoint_every_updates={CKPT_EVERY}",
    "runtime.learners_per_process=2",
    "runtime.timeout_s=60",
    "runtime.retry_s=1",
    "runtime.restart=true",
    "runtime.max_restarts=100",
]
SHAPES = {
    "parts": ("quickstart.yaml", ["sync.protocol=hardsync", "wire.parts=2"]),
    "adv": ("quickstart_adv.yaml", []),  # kind adv, two leaves of two learners per range
}
SERVERS = ["ps", *(f"ps{i}" for i in range(1, K))]
NODES = [f"node{leaf}{f's{i}' if i else ''}" for i in range(K) for leaf in (0, 1)]
LEARNERS = ["learner0-1", "learner2-3"]


def shape_of(seed: int) -> str:
    return "parts" if seed % 2 == 0 else "adv"


def overrides(seed: int, epochs: float = EPOCHS) -> list[str]:
    """The run's --set list: the shape's, the soak's, and the seed as model and data seed."""
    seeds = [f"model.seed={seed}", f"train.seed={seed}", f"train.epochs={epochs}"]
    return [*SHAPES[shape_of(seed)][1], *COMMON, *seeds]


def kill_schedule(seed: int, count: int = 60) -> list[tuple[float, str]]:
    """(gap in seconds, label) of each SIGKILL in turn: a kind uniformly among the shape's
    (server, node, learner, data, stats), then one process of that kind. Pure."""
    rng = random.Random(seed)
    kinds = {"server": SERVERS, "learner": LEARNERS, "data": ["data"], "stats": ["stats"]}
    if shape_of(seed) == "adv":
        kinds["node"] = NODES
    names = sorted(kinds)
    return [
        (round(rng.uniform(*GAP_S), 2), rng.choice(kinds[rng.choice(names)])) for _ in range(count)
    ]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def leftovers(run_dir, seen: dict) -> list[int]:
    """Pids still running of the run's processes: those in RUN_DIR/processes.json and those
    in ``seen`` (pid -> create time, so a reused pid is not taken for ours)."""
    try:
        left = {p for p in role_pids(run_dir) if not gone(p)}
    except (OSError, ValueError):  # the launcher wrote no processes.json
        left = set()
    for pid, created in seen.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).create_time() == created and not gone(pid):
                left.add(pid)
    return sorted(left)


def result_line(out: str) -> tuple[str, str] | None:
    """(test error %, epochs) of the launcher's result line, or None if it reports none."""
    line = next((x for x in out.splitlines() if x.startswith("result: ")), "")
    m = re.match(r"result: test error ([\d.]+)% \(best [\d.]+%\) after ([\d.]+) epochs", line)
    return m.groups() if m else None


def run_once(
    seed: int, out_dir: Path, calm: bool = False, log=print, epochs: float = EPOCHS
) -> dict:
    """One run of ``seed`` (``calm``: no kills) of ``epochs`` under OUT_DIR; returns what was checked
    (``problems`` empty when it passed everything but the spread). Blocks until it ended
    (at most RUN_LIMIT_S after training started); kills whatever of it is left."""
    name = f"{'calm' if calm else 'chaos'}-{seed}"
    run_dir, out_file = out_dir / name, out_dir / f"{name}.out"
    config = ROOT / "configs" / SHAPES[shape_of(seed)][0]
    cmd = [sys.executable, "-m", "rudra_zmq", "run", str(config), "--run-dir", str(run_dir)]
    cmd += [a for o in overrides(seed, epochs) for a in ("--set", o)]
    schedule = [] if calm else kill_schedule(seed)
    seen, done, problems = {}, [], []
    began = time.monotonic()
    with open(out_file, "w") as sink:  # a file, not a pipe: the launcher never blocks on us
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            while newest_ts(run_dir) < 1 and proc.poll() is None:
                if time.monotonic() - began > 240:
                    problems.append("training did not start in 240 s")
                    break
                time.sleep(0.2)
            t0 = last = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < RUN_LIMIT_S:
                with contextlib.suppress(psutil.Error):
                    for p in psutil.Process(proc.pid).children(recursive=True):
                        seen.setdefault(p.pid, p.create_time())
                now = time.monotonic()
                if schedule and now - t0 < KILL_WINDOW_S and now - last >= schedule[0][0]:
                    _, label = schedule.pop(0)
                    last = now
                    try:
                        pid = pid_of(run_dir, label)
                    except (OSError, ValueError, IndexError):
                        pid = None
                    if pid is None or gone(pid):
                        done.append((round(now - t0, 1), label, pid, None))
                    else:
                        ts = newest_ts(run_dir)
                        os.kill(pid, signal.SIGKILL)
                        done.append((round(now - t0, 1), label, pid, ts))
                time.sleep(0.25)
            if proc.poll() is None:
                problems.append(f"still running {RUN_LIMIT_S} s after training started")
                proc.terminate()
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                problems.append("the launcher did not stop in 60 s after SIGTERM")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            left = leftovers(run_dir, seen)
            for pid in left:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
    res = {
        "seed": seed,
        "shape": shape_of(seed),
        "calm": calm,
        "rc": rc,
        "wall_s": round(time.monotonic() - began, 1),
        "kills": done,
        "left": left,
        "run_dir": str(run_dir),
        "early": problems,  # found while it ran
    }
    res["problems"] = evaluate(res)
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    problems = res["problems"]
    log(
        f"{name} ({res['shape']}): rc {rc}, {res['landed']} kills landed, "
        f"error {res.get('error')}, {res['wall_s']} s, "
        + ("ok" if not problems else "PROBLEMS: " + "; ".join(problems))
    )
    return res


def evaluate(res: dict) -> list[str]:
    """The problems of the run ``res`` describes (what ``run_once`` saw), read again from its
    run directory and launcher output; fills ``res`` with what was measured. Reads files."""
    run_dir = Path(res["run_dir"])
    out = (run_dir.parent / f"{run_dir.name}.out").read_text(errors="replace")
    landed = [k for k in res["kills"] if k[3] is not None]
    res["landed"] = len(landed)
    problems = list(res.get("early", []))
    if res["rc"] != 0:
        problems.append(f"exit {res['rc']}")
    if not res["calm"] and len(landed) < 3:
        problems.append(f"only {len(landed)} kills landed")
    if res["left"]:
        problems.append(f"processes left: {res['left']}")
    problems += check_result(run_dir, out, res)
    if not res["calm"]:
        problems += check_kills_recorded(run_dir, landed, res)
    return problems


def check_result(run_dir: Path, out: str, res: dict) -> list[str]:
    """The run's end: the result line is the evaluation of the final weights. Fills ``res``
    with the error, epochs and the weights' norm; returns the problems."""
    problems = []
    try:
        final = json.loads((run_dir / "ps_final.json").read_text())
        w = np.load(run_dir / "weights.npy")
        evals = records(run_dir, "eval")
    except (OSError, ValueError) as exc:
        return [f"no final files: {exc}"]
    if not final.get("done"):
        problems.append("ps_final.json says not done")
    at_end = [r for r in evals if r.get("ts") == final.get("timestamp")]
    line = result_line(out)
    res["epoch"] = final.get("epoch")
    res["norm"] = float(np.linalg.norm(w.astype(np.float64)))
    res["finite"] = bool(np.isfinite(w).all())
    if not res["finite"]:
        problems.append("weights not finite")
    if not at_end:
        problems.append(f"no evaluation at the final timestamp {final.get('timestamp')}")
    if line is None:
        problems.append("no result line with a test error")
    if at_end and line:
        res["error"] = float(line[0])
        if line[0] != f"{100 * at_end[-1]['test_error']:.2f}":
            problems.append(f"result {line[0]}% is not the final weights' evaluation")
        if line[1] != f"{final['epoch']:.2f}":
            problems.append(f"result after {line[1]} epochs, ps_final.json {final['epoch']}")
    return problems


def check_kills_recorded(run_dir: Path, landed: list, res: dict) -> list[str]:
    """Every kill that landed is in the records: processes.json has the killed pid with exit
    -9 (SIGKILL) and, unless the role had finished its part, a newer process of its label; a
    killed server's log says which checkpoints it resumed from, and never that it started
    from the initial weights.
    Returns the problems."""
    problems = []
    try:
        rows = json.loads((run_dir / "processes.json").read_text())
        restarts = records(run_dir, "restart")
    except (OSError, ValueError) as exc:
        return [f"records unreadable: {exc}"]
    # informative: a restart whose record never came is read from its server's restarts.json
    # (stats/missed_records.py), but one after the statistics server finished (a server killed in
    # its shutdown) is in ps_final.json only, so they are not counted against the run
    res["restart_records"] = len(restarts)
    for _, label, pid, _ in landed:
        mine = [r for r in rows if r["role"] == label]
        row = next((r for r in mine if r["pid"] == pid), None)
        if row is None:
            problems.append(f"{label} pid {pid} is not in processes.json")
            continue
        if row.get("exit") == 0 and done_before(run_dir, label):  # it was ending as the
            res.setdefault("raced", []).append([label, pid])  # kill came: it never landed
            continue
        if row.get("exit") != -9:
            problems.append(f"{label} pid {pid}: processes.json says exit {row.get('exit')}")
        if mine[-1] is row and not done_before(run_dir, label):
            problems.append(f"{label} killed (pid {pid}) but never restarted")
    for label in SERVERS:  # its restarts resumed from its range's checkpoints, says its log
        n = sum(1 for r in rows if r["role"] == label) - 1
        try:
            log = (run_dir / "logs" / f"{label}.log").read_text(errors="replace")
        except OSError:
            log = ""
        resumed = log.count("parameter server: resumed from ")
        # a restart that lost its range (a tree's root said the first up to 3eb0059)
        if any(w in log for w in ("starting from the initial", "starts over from the initial")):
            problems.append(f"{label} restarted from the initial weights, not a checkpoint")
        elif n and not resumed:  # one killed in its start-up says nothing: not counted
            problems.append(f"{label} restarted {n} times, never said which checkpoint")
    return problems


def done_before(run_dir: Path, label: str) -> bool:
    """Whether ``label``'s part of the run was over, so the launcher rightly let it go
    unrestarted: a learner told STOP, a server whose training ended (its ``ps_final.json``)."""
    if label.startswith("learner") or label.startswith("node") or label == "data":
        return (run_dir / "ps_final.json").exists()
    if label in SERVERS:
        i = SERVERS.index(label)
        return (run_dir / "servers" / f"server-{i}" / "ps_final.json").exists()
    return False


def spread(calm: list[dict]) -> dict:
    """Per shape: the fault-free runs' mean and standard deviation of the final test error
    and the weights' norm, the error's bound and the norm's half-width a chaos run must keep
    (around its own seed's fault-free norm: ``norm_problem``)."""
    out = {}
    for shape in SHAPES:
        runs = [r for r in calm if r["shape"] == shape and "error" in r and not r["problems"]]
        if len(runs) < 2:
            continue
        e = np.array([r["error"] for r in runs])
        n = np.array([r["norm"] for r in runs])
        out[shape] = {
            "runs": len(runs),
            "error_mean": float(e.mean()),
            "error_sd": float(e.std(ddof=1)),
            "error_max": float(e.mean() + SPREAD_SIGMAS * e.std(ddof=1)),
            "norm_mean": float(n.mean()),
            "norm_sd": float(n.std(ddof=1)),
            "norm_half": float(SPREAD_SIGMAS * n.std(ddof=1)),
        }
    return out


def norm_problem(chaos: dict, twin: dict | None, bounds: dict) -> str | None:
    """What is wrong with the chaos run's weights' norm, or None: it must lie within
    ``bounds["norm_half"]`` (3 standard deviations of its shape's fault-free norms) of the
    fault-free run of its own seed (``twin``; none: say so)."""
    if twin is None or "norm" not in twin or twin.get("problems"):
        return f"no sound fault-free run of seed {chaos['seed']} to centre its norm on (--calm)"
    lo, hi = twin["norm"] - bounds["norm_half"], twin["norm"] + bounds["norm_half"]
    if lo <= chaos["norm"] <= hi:
        return None
    return (
        f"weights' norm {chaos['norm']:.3f} outside [{lo:.3f}, {hi:.3f}] (its fault-free "
        f"twin's {twin['norm']:.3f} +- {bounds['norm_half']:.3f})"
    )


def verdicts(*out_dirs: Path) -> tuple[dict, list[tuple[int, str, list[str]]], list[dict]]:
    """(spread per shape, [(seed, shape, problems)] of every chaos run in OUT_DIRS, every
    run's record)."""
    load = [json.loads(p.read_text()) for d in out_dirs for p in sorted(d.glob("*-*.json"))]
    rows = []
    for r in load:
        r["problems"] = evaluate(r)
    bounds = spread([r for r in load if r["calm"]])
    for r in sorted((r for r in load if not r["calm"]), key=lambda r: r["seed"]):
        problems = list(r["problems"])
        b = bounds.get(r["shape"])
        twin = next((c for c in load if c["calm"] and c["seed"] == r["seed"]), None)
        if b is None:
            problems.append("no fault-free spread for its shape (run --calm)")
        elif "error" in r:
            if r["error"] > b["error_max"]:
                problems.append(f"error {r['error']}% above the spread's {b['error_max']:.2f}%")
            if (bad := norm_problem(r, twin, b)) is not None:
                problems.append(bad)
        r["twin"] = twin_distance(r, twin)
        rows.append((r["seed"], r["shape"], problems))
    return bounds, rows, load


def twin_distance(chaos: dict, calm: dict | None) -> dict:
    """The chaos run's final error and weights beside its fault-free twin's (same seed):
    the twin's error and ||w - w_twin|| / ||w_twin||. Informative, not a verdict."""
    if calm is None or "error" not in chaos or "error" not in calm:
        return {}
    try:
        w = np.load(Path(chaos["run_dir"]) / "weights.npy").astype(np.float64)
        v = np.load(Path(calm["run_dir"]) / "weights.npy").astype(np.float64)
    except (OSError, ValueError):
        return {}
    return {"error": calm["error"], "dist": float(np.linalg.norm(w - v) / np.linalg.norm(v))}


def seeds_of(text: str) -> list[int]:
    """``0-4`` or ``0,3,7`` or ``5``."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="chaos (or --calm) runs of some seeds")
    r.add_argument("seeds", type=seeds_of)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--calm", action="store_true", help="no kills: the fault-free runs")
    s = sub.add_parser("summary", help="spread and verdict of every chaos run in OUT")
    s.add_argument("out", type=Path, nargs="+", help="folders of chaos and --calm runs")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        # SIGTERM (bench/chaos_soak.sh's LIMIT) ends the run in progress through run_once's
        # `finally`, which kills the launcher and whatever of the run is left
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        a.out.mkdir(parents=True, exist_ok=True)
        for seed in a.seeds:
            print(f"seed {seed} ({shape_of(seed)}): kills {kill_schedule(seed)[:12]} ...")
            run_once(seed, a.out, calm=a.calm, log=lambda m: print(m, flush=True))
        return 0
    bounds, rows, load = verdicts(*a.out)
    chaos = {r["seed"]: r for r in load if not r["calm"]}
    for shape, b in bounds.items():
        print(
            f"{shape}: fault-free over {b['runs']} seeds: error {b['error_mean']:.2f} "
            f"+- {b['error_sd']:.2f} % (bound {b['error_max']:.2f} %), norm "
            f"{b['norm_mean']:.3f} +- {b['norm_sd']:.3f} (a chaos run's: its seed's "
            f"fault-free norm +- {b['norm_half']:.3f})"
        )
    for seed, shape, problems in rows:
        r, kinds = chaos[seed], {}
        for k in r["kills"]:
            if k[3] is not None:
                kind = re.sub(r"\d.*", "", k[1]).replace("ps", "server")
                kinds[kind] = kinds.get(kind, 0) + 1
        twin = r.get("twin") or {}
        print(
            f"seed {seed:2d} {shape:5s} kills {r['landed']:2d} "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); error "
            f"{r.get('error')}% (fault-free {twin.get('error')}%), weights {twin.get('dist', 0):.3f} "
            f"from the fault-free run's, {r['wall_s']} s: "
            + ("pass" if not problems else "; ".join(dict.fromkeys(problems)))
        )
    passed = sum(1 for *_, p in rows if not p)
    print(f"{passed} of {len(rows)} seeds passed")
    return 0 if rows and passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
