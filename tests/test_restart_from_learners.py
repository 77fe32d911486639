"""Each server of K = 1, 2 and 4 killed at start-up, mid-run and in a run's last updates, with
and without checkpoints, under ``rudra-zmq run``: it is restarted, takes its range back from
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


PHASES = {"start-up": lambda n: 2, "mid-run": lambda n: n // 2, "last": lambda n: n - 1}
CASES = [(k, k - 1, phase) for k in (1, 2, 4) for phase in PHASES]  # the last server of K


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no-checkpoints", "checkpoints"])
@pytest.mark.parametrize("servers, killed, phase", CASES, ids=[f"K{k}-{p}" for k, _, p in CASES])
def test_a_killed_server_takes_its_range_back_and_the_run_ends_with_its_result(
    tmp_path, servers, killed, phase, checkpoints
):
    crash_ts = PHASES[phase](total_updates())
    every = CKPT_EVERY if checkpoints else 0
    crash = {"PS_CRASH_AT": "update", "PS_CRASH_TS": str(crash_ts), "PS_CRASH_SHARD": str(killed)}
    r = Run(
        tmp_path,
        "run",
        [*BASE, f"architecture.servers={servers}", f"train.checkpoint_every_updates={every}"],
        crash=crash,
    )
    assert r.finish(timeout=240) == 0, r.out
    final = json.loads((r.dir / "ps_final.json").read_text())
    assert final["done"] and final["epoch"] >= EPOCHS
    (restart,) = final["restarts"]  # one server restarted, once
    assert restart["server"] == killed and restart["incarnation"] == 2, final
    ckpt_ts = crash_ts // CKPT_EVERY * CKPT_EVERY if checkpoints else 0
    if checkpoints and ckpt_ts == crash_ts:  # a checkpoint as fresh as any learner's copy
        assert restart["from"] == "checkpoint" and restart["ts"] == crash_ts, restart
    else:  # the learners' freshest copy: at most the update in flight behind (hardsync)
        assert restart["from"].startswith("learner "), restart
        assert crash_ts - 1 <= restart["ts"] <= crash_ts, restart
    assert 0 <= restart["lost"] <= crash_ts - restart["ts"] <= 1, restart
    if servers > 1:
        assert [f["incarnation"] for f in final["servers"]][killed] == 2
    said = [x for x in records(r.dir, "restart") if x.get("server", 0) == killed]
    assert [x["from"] for x in said] == [restart["from"]], said
    # the run ends with the final weights' evaluation, and every epoch was evaluated
    evals = records(r.dir, "eval")
    assert evals[-1]["epoch"] >= EPOCHS and evals[-1]["ts"] == final["timestamp"], evals[-1]
    assert {int(e["epoch"] + 1e-9) for e in evals} >= set(range(EPOCHS + 1)), evals
    line = next(x for x in r.out.splitlines() if x.startswith("result:"))
    assert f"{100 * evals[-1]['test_error']:.2f}%" in line
    who = f"server {killed}" if servers > 1 else "the parameter server"
    assert f"restarted: {who} from {restart['from']} at ts {restart['ts']}" in line, line
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "compare", str(r.dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert "restarts" in header and f"1 ({restart['lost']} lost)" in row, out.stdout
