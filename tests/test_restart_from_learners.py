"""Servers of K = 1, 2 and 4 killed at start-up, mid-run and in a run's last update (each
server of K at least once, some twice), with and without checkpoints, in one run per K under
``rudra-zmq run``: each is restarted, takes its range back from
the freshest copy its learners hold (or from its checkpoint when that is as fresh), and the run
ends with the final weights' result; the updates lost are at most the freshest learner's
staleness plus the update in flight when it died (hardsync: one); the evaluations go on through
the restart; ps_final.json, the result line and ``compare`` say which server restarted, from
what, and what it lost (docs/fault-tolerance.md, "A server restarted without a checkpoint")."""

import json
import math
import subprocess
import sys

import pytest

from fault_runs import ROOT, Run, records

pytestmark = pytest.mark.timeout(300)

EPOCHS = 2
LEARNERS, BATCH = 2, 16
CKPT_EVERY = 10
BASE = [
    "sync.protocol=hardsync",
    f"sync.learners={LEARNERS}",
    f"sync.batch_size={BATCH}",
    f"train.epochs={EPOCHS}",
    "train.eval_every_epochs=1",
    "train.checkpoint_every_s=0",
    "runtime.timeout_s=60",
    "runtime.retry_s=1",
]


def total_updates() -> int:
    from rudra_zmq.config import load_config
    from rudra_zmq.data.datasets import dataset_size

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", BASE)
    return math.ceil(EPOCHS * dataset_size(cfg.data) / (LEARNERS * BATCH))


def kills(servers: int, n: int) -> list[tuple[int, int]]:
    """(server, timestamp) of each kill in a run of ``n`` updates: at start-up, mid-run (at a
    checkpoint's timestamp) and in the last update, and every server of K killed once at
    least (K = 4: a fourth, at three quarters)."""
    points = [2, n // 2 // CKPT_EVERY * CKPT_EVERY, n - 1, 3 * n // 4][: max(3, servers)]
    return [(i % servers, ts) for i, ts in enumerate(points)]


CASES = [  # (servers, checkpoints, extra): K = 2 with parts is striped (shape.Share)
    pytest.param(k, c, [], id=f"K{k}-{'checkpoints' if c else 'no-checkpoints'}")
    for k in (1, 2, 4)
    for c in (False, True)
] + [pytest.param(2, False, ["wire.parts=4"], id="K2-striped-no-checkpoints")]


@pytest.mark.parametrize(("servers", "checkpoints", "extra"), CASES)
def test_killed_servers_take_their_range_back_and_the_run_ends_with_its_result(
    tmp_path, servers, checkpoints, extra
):
    plan = sorted(kills(servers, total_updates()), key=lambda k: k[1])
    every = CKPT_EVERY if checkpoints else 0
    crash = {"PS_CRASH_AT": "update", "PS_CRASH_PLAN": ",".join(f"{s}:{t}" for s, t in plan)}
    r = Run(
        tmp_path,
        "run",
        [*BASE, f"architecture.servers={servers}", f"train.checkpoint_every_updates={every}"]
        + ["runtime.max_restarts=4", *extra],
        crash=crash,
    )
    assert r.finish(timeout=280) == 0, r.out
    final = json.loads((r.dir / "ps_final.json").read_text())
    assert final["done"] and final["epoch"] >= EPOCHS
    restarts = sorted(final["restarts"], key=lambda x: x["ts"])
    assert [x["server"] for x in restarts] == [s for s, _ in plan], (plan, restarts)
    for k, ((server, crash_ts), restart) in enumerate(zip(plan, restarts)):
        # its checkpoint is as fresh as any copy when it died right after writing it: at a
        # multiple of CKPT_EVERY, before any restart of it (one taken back from a copy
        # writes a checkpoint at once, and the next ones follow from there)
        first = all(s != server for s, _ in plan[:k])
        if checkpoints and first and crash_ts % CKPT_EVERY == 0:
            assert restart["from"] == "checkpoint" and restart["ts"] == crash_ts, restart
        else:  # the learners' freshest copy (or a checkpoint as fresh): at most the update
            # in flight behind (hardsync)
            fresh = restart["from"] == "checkpoint" and checkpoints
            assert restart["from"].startswith("learner ") or fresh, restart
            assert crash_ts - 1 <= restart["ts"] <= crash_ts, restart
        assert 0 <= restart["lost"] <= crash_ts - restart["ts"] <= 1, restart
    starts = {s: 1 + sum(k == s for k, _ in plan) for s in range(servers)}
    if servers > 1:
        assert [f["incarnation"] for f in final["servers"]] == [starts[s] for s in range(servers)]
    said = sorted((x.get("server", 0), x["from"]) for x in records(r.dir, "restart") if "from" in x)
    assert said == sorted((x["server"], x["from"]) for x in restarts), said
    # the run ends with the final weights' evaluation, and every epoch was evaluated
    evals = records(r.dir, "eval")
    assert evals[-1]["epoch"] >= EPOCHS and evals[-1]["ts"] == final["timestamp"], evals[-1]
    assert {int(e["epoch"] + 1e-9) for e in evals} >= set(range(EPOCHS + 1)), evals
    line = next(x for x in r.out.splitlines() if x.startswith("result:"))
    assert f"{100 * evals[-1]['test_error']:.2f}%" in line
    for x in restarts:
        who = f"server {x['server']}" if servers > 1 else "the parameter server"
        assert f"{who} from {x['from']} at ts {x['ts']}, {x['lost']} updates lost" in line, line
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "compare", str(r.dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    header, row = out.stdout.splitlines()[:2]
    lost = sum(x["lost"] for x in restarts)
    assert "restarts" in header and f"{len(restarts)} ({lost} lost)" in row, out.stdout


def test_under_softsync_a_restart_loses_at_most_the_freshest_learners_staleness(tmp_path):
    """1-softsync, λ = 4, two servers, no checkpoints: server 1 killed mid-run resumes at
    the freshest copy's timestamp, at most the largest staleness any gradient had behind
    the timestamp it died at."""
    crash = {"PS_CRASH_AT": "update", "PS_CRASH_PLAN": "1:20"}
    r = Run(
        tmp_path,
        "soft",
        [*BASE, "sync.protocol=softsync", "sync.n=1", "sync.learners=4"]
        + ["architecture.servers=2", "train.checkpoint_every_updates=0"],
        crash=crash,
    )
    assert r.finish(timeout=280) == 0, r.out
    final = json.loads((r.dir / "ps_final.json").read_text())
    (restart,) = final["restarts"]
    assert restart["server"] == 1 and restart["from"].startswith("learner "), restart
    sigmas = [s for u in records(r.dir, "update") if u["server"] == 1 for s in u["sigmas"]]
    assert 0 <= restart["lost"] <= 20 - restart["ts"] <= max(sigmas) + 1, (restart, max(sigmas))
    assert records(r.dir, "eval")[-1]["ts"] == final["timestamp"]
    assert "restarted: server 1 from learner" in r.out


@pytest.mark.parametrize("servers", [1, 2])
def test_a_tree_root_restarted_without_a_checkpoint_takes_its_range_back_through_its_nodes(
    tmp_path, servers
):
    """Rudra-adv (a tree of two leaves of two learners per range), 1-softsync, no
    checkpoints: the root of range 0 killed mid-run resumes at the freshest copy its leaves
    pass up from their first rejoining learners (each leaf fails on the new root's "rejoin" and
    is restarted), not at the initial weights: it loses at most the largest staleness a
    gradient had, plus the update in flight."""
    crash_ts = total_updates() // 4  # mid-run: µλ = 64 here, twice BASE's
    r = Run(
        tmp_path,
        "adv",
        [*BASE, "sync.protocol=softsync", "sync.n=1", "sync.learners=4"]
        + [f"architecture.servers={servers}", "train.checkpoint_every_updates=0"]
        + ["runtime.restart=true", "runtime.max_restarts=4"],
        config="quickstart_adv.yaml",
        crash={"PS_CRASH_AT": "update", "PS_CRASH_PLAN": f"0:{crash_ts}"},
    )
    assert r.finish(timeout=280) == 0, r.out
    final = json.loads((r.dir / "ps_final.json").read_text())
    (restart,) = final["restarts"]
    assert restart["server"] == 0 and restart["from"].startswith("tree node "), restart
    sigmas = [s for u in records(r.dir, "update") if u.get("server", 0) == 0 for s in u["sigmas"]]
    assert 0 <= crash_ts - restart["ts"] <= max(sigmas) + 1, (restart, max(sigmas))
    assert 0 <= restart["lost"] <= crash_ts - restart["ts"], restart
    evals = records(r.dir, "eval")
    assert evals[-1]["ts"] == final["timestamp"] and final["epoch"] >= EPOCHS, evals[-1]
    assert "from tree node" in next(x for x in r.out.splitlines() if x.startswith("result:"))
