"""Soak: one `rudra-zmq run` of the quickstart (restarts on) with a role SIGKILLed every few
seconds at random (the PS, the data server, the statistics server or a learner process) for the
first KILL_WINDOW_S of training or until the run ends. It must end well, its result line must
be the evaluation of the PS's final weights, and none of its processes may outlive it.

The kill schedule comes from a seed, printed with the schedule (pytest -s shows it; a failure
repeats both): ``RUDRA_SOAK_SEED=<seed> pytest tests/test_soak.py`` draws the same schedule.
Without it every run draws a new seed. 20 s to 3 min on 2 cores, depending on the load."""

import contextlib
import json
import os
import random
import re
import signal
import time

import numpy as np
import psutil
import pytest

from cluster import gone
from fault_runs import FAST, Run, newest_ts, pid_of, records, role_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEARNERS = ["learner0-1", "learner2-3"]  # 4 learners, 2 per process
TARGETS = ["ps", "data", "stats", "learner"]
GAP_S = (2.0, 5.0)  # at most this many seconds between two kills, uniform
MIN_GAP_S = 1.0  # at least this many
KILLS_PER_RUN = 12  # on a fast machine: a kill every 1/12 of training's updates
UPDATES = 1572  # the run's: 70 epochs of the 1,437 digits at µλ = 64
KILL_WINDOW_S = 60  # no kill later than this after training started
RUN_LIMIT_S = 300  # the run must have ended this long after training started
OVERRIDES = [
    *FAST,
    "train.epochs=70",
    "train.eval_every_epochs=20",
    "train.checkpoint_every_updates=20",
    "runtime.learners_per_process=2",
    "runtime.restart=true",
    "runtime.max_restarts=100",
]


def kill_schedule(seed: int) -> list[tuple[float, str]]:
    """(longest gap in seconds, label) of each SIGKILL in turn: a kind drawn uniformly among
    the PS, data server, statistics server and learners, then one learner process; gaps
    uniform in GAP_S. A kill comes after its gap, or sooner (after MIN_GAP_S) once training
    went 1/KILLS_PER_RUN further, so that a fast machine gets as many kills as a slow one."""
    rng = random.Random(seed)
    plan = []
    for _ in range(int(KILL_WINDOW_S / MIN_GAP_S)):
        gap, kind = round(rng.uniform(*GAP_S), 2), rng.choice(TARGETS)
        plan.append((gap, rng.choice(LEARNERS) if kind == "learner" else kind))
    return plan


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


def result_line(out: str) -> tuple[str, str]:
    """The test error (%) and epochs that the launcher's result line reports; asserts that it
    reports a test error."""
    line = next((x for x in out.splitlines() if x.startswith("result: ")), "(none)")
    m = re.match(r"result: test error ([\d.]+)% \(best [\d.]+%\) after ([\d.]+) epochs", line)
    assert m, f"the result line reports no test error: {line}"
    return m.groups()


def test_a_run_with_a_role_killed_every_few_seconds_ends_with_its_final_weights_evaluated(tmp_path):
    seed = int(os.environ.get("RUDRA_SOAK_SEED") or random.SystemRandom().randrange(10**6))
    schedule = kill_schedule(seed)
    print(f"soak seed {seed}; planned kills (longest gap in s, role): {schedule}")
    run = Run(tmp_path, "soak", OVERRIDES)
    seen = {}  # pid -> create_time of every process of the run ever seen
    done = []  # the kills made: (s, label, pid, newest timestamp in the metrics)

    def watch():
        try:
            for p in psutil.Process(run.proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    try:
        run.wait_ts(1, timeout=180)
        t0 = last_t = time.monotonic()
        last_ts, pending = newest_ts(run.dir), list(schedule)
        while run.proc.poll() is None and time.monotonic() - t0 < RUN_LIMIT_S:
            watch()
            now, ts = time.monotonic(), newest_ts(run.dir)
            if (
                pending
                and now - t0 < KILL_WINDOW_S
                and now - last_t >= MIN_GAP_S
                and (now - last_t >= pending[0][0] or ts - last_ts >= UPDATES / KILLS_PER_RUN)
            ):
                _, label = pending.pop(0)
                last_t, last_ts = now, ts
                pid = pid_of(run.dir, label)
                if gone(pid):  # exited, or not restarted yet
                    done.append((round(now - t0, 1), label, pid, "not running"))
                else:
                    os.kill(pid, signal.SIGKILL)
                    done.append((round(now - t0, 1), label, pid, ts))
            time.sleep(0.25)
        if run.proc.poll() is None:  # past RUN_LIMIT_S: the launcher stops its roles
            run.proc.terminate()
        rc = run.finish(timeout=30)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
        left = leftovers(run.dir, seen)
        for pid in left:  # never leave them to the next test
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    print(f"soak seed {seed}: kills made (s, role, pid, newest ts): {done}")
    out = getattr(run, "out", None) or ""
    (tmp_path / "launcher.out").write_text(out)
    why = (
        f"seed {seed}, kills made {done}; the launcher's output is in "
        f"{tmp_path / 'launcher.out'}, its last lines:\n" + "\n".join(out.splitlines()[-40:])
    )
    assert rc == 0, why
    assert sum(1 for k in done if k[3] != "not running") >= 3, (
        f"fewer than 3 kills landed: raise train.epochs for this machine; {why}"
    )

    # the result line is the evaluation of the weights the PS ended with
    final = json.loads((run.dir / "ps_final.json").read_text())
    assert final["done"], why
    at_end = [r for r in records(run.dir, "eval") if r.get("ts") == final["timestamp"]]
    assert at_end, f"no evaluation at the PS's final timestamp {final['timestamp']}; {why}"
    error, epochs = result_line(out)
    assert error == f"{100 * at_end[-1]['test_error']:.2f}", why
    assert epochs == f"{final['epoch']:.2f}", why
    assert np.isfinite(np.load(run.dir / "weights.npy")).all(), why

    # nothing of the run left: no role process it recorded, no descendant it had
    assert not left, f"still running: {left}; {why}"
