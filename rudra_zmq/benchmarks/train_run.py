"""One measured ``rudra-zmq run`` of the training-throughput benchmark, and two checkouts
compared: the run started as a user would (a temporary run directory, its own processes,
optionally another checkout's rudra_zmq), its steady-state images/s read from the PS's
``update`` records in ``metrics.jsonl`` (the learners' ``samples_per_s`` as a cross check),
and the A B B A order that pools two runs of each checkout. What to run and the verdict are
``train_throughput.py``'s."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from ..run_files import config_path, metrics_path


def distributed(name, config, overrides, env, skip_s, trim_s, keep, tree=None):
    """Run one ``rudra-zmq run`` of ``config(root)`` (the config dict for a run under the
    temporary ``root``) with ``--set overrides`` and ``env`` added to the environment (blocks
    until it ends) and measure its steady-state throughput. ``tree``: run the rudra_zmq of that
    checkout instead (built in place)."""
    root = tempfile.mkdtemp(prefix=f"bench-train-{name}-")
    cfg_path = os.path.join(root, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(config(root), f)
    run_dir = os.path.join(root, "run")
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "run",
        cfg_path,
        "--run-dir",
        run_dir,
        *(a for o in overrides for a in ("--set", o)),
    ]
    t0 = time.time()
    with open(os.path.join(root, "launcher.log"), "w") as log:
        extra = {} if tree is None else {"PYTHONPATH": os.path.abspath(tree)}
        rc = subprocess.call(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env={**os.environ, **env, **extra}
        )
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {rc}; see {root}/launcher.log and {run_dir}/logs"
        )
    recs = [json.loads(line) for line in open(metrics_path(run_dir))]
    ups = sorted((r for r in recs if r["type"] == "update"), key=lambda r: r["t"])
    t_first, t_last = ups[0]["t"], ups[-1]["t"]
    win = [r for r in ups if t_first + skip_s <= r["t"] <= t_last - trim_s]
    if len(win) < 10:
        raise RuntimeError(
            f"case {name}: only {len(win)} updates in the steady-state window "
            f"({len(ups)} in all over {t_last - t_first:.1f} s); raise --epochs"
        )
    resolved = yaml.safe_load(open(config_path(run_dir)))
    samples = sum(r["n_grads"] for r in win[1:]) * resolved["sync"]["batch_size"]
    rate = samples / (win[-1]["t"] - win[0]["t"])
    lrn = {}
    for r in recs:
        if r["type"] == "learner" and win[0]["t"] <= r["t"] <= win[-1]["t"]:
            lrn.setdefault(r["learner"], []).append(r["samples_per_s"])
    lrn_rate = sum(statistics.median(v) for v in lrn.values()) if lrn else float("nan")
    if not keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {
        "images_per_s": rate,
        "learner_records_images_per_s": lrn_rate,
        "updates": len(ups),
        "window_updates": len(win),
        "window_s": win[-1]["t"] - win[0]["t"],
        "startup_s": t_first,
        "wall_s": wall,
        "learners": resolved["sync"]["learners"],
        "threads_per_learner": resolved["runtime"]["threads_per_learner"],
        "ps_threads": resolved["runtime"]["ps_threads"],
        "root": root,
    }


def compare_runs(name, config, sets, env, args):
    """Run case ``name`` (as :func:`distributed`) with this checkout and with ``args.against``,
    A B B A; returns the two pooled results (images/s over both windows; the rest from the
    first run)."""
    got = {"this": [], "other": []}
    for who in ("this", "other", "other", "this"):
        r = distributed(
            name,
            config,
            sets,
            env,
            args.skip_s,
            args.trim_s,
            args.keep,
            tree=args.against if who == "other" else None,
        )
        got[who].append(r)
        print(
            f"# {name} [{who}] {r['images_per_s']:.1f} images/s over {r['window_s']:.1f} s, "
            f"loadavg {os.getloadavg()[0]:.2f}",
            flush=True,
        )

    def pool(rs):
        rate = sum(r["images_per_s"] * r["window_s"] for r in rs) / sum(r["window_s"] for r in rs)
        return {
            **rs[0],
            "images_per_s": rate,
            "runs": "(" + ", ".join(f"{r['images_per_s']:.1f}" for r in rs) + ")",
        }

    return pool(got["this"]), pool(got["other"])
