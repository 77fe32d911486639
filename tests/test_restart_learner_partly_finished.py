"""Learners of a partly finished sharded run restarted: K = 2, server 0 finished training and
has exited while server 1 trains on (it started its range over: it was killed together with
every learner, so no copy and no checkpoint was left), and then every learner is killed (chaos
soak seed 10, at K = 4). A learner restarted as before would say HELLO to server 0, which is
gone, and wait ``runtime.timeout_s`` for its range's weights, fail, and be restarted again
(before b324105 for ever; since, it was left out and the last one stopped the run, exit 1);
the launcher restarts it with ``--finished-in RUN`` (``launch/restarts.on_failure``), it takes
server 0's range from its final weights, server 1 trains on with the restarted learners and
the run ends with the final weights' result (docs/fault-tolerance.md, "Restarts under
rudra-zmq run")."""

import json
import os
import signal
import time

import pytest

from fault_runs import Run, pid_of, records

pytestmark = pytest.mark.timeout(300)

SETTINGS = [
    "sync.protocol=softsync",
    "sync.n=1",
    "sync.learners=2",
    "sync.batch_size=16",
    "train.epochs=8",
    "train.eval_every_epochs=0",
    "train.checkpoint_every_s=0",
    "train.checkpoint_every_updates=0",
    "architecture.servers=2",
    "runtime.timeout_s=20",
    "runtime.retry_s=1",
    "runtime.max_restarts=2",
]
RESTART_AT = 100  # of ~360 updates: server 1 starts over here, 100 behind server 0
# (with 4 epochs, ~180 updates, an idle CI machine trained 180 in 4 s: the metrics, which lag
# the servers by up to a second, said 100 only after both had finished, and the kills came late)


def wait_for(condition, what, run, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert run.proc.poll() is None, run.proc.communicate()[0]
        assert time.time() < deadline, f"{what}: not in {timeout} s"
        time.sleep(0.05)


def test_learners_failing_after_one_of_two_servers_finished_come_back_and_the_run_ends(tmp_path):
    r = Run(tmp_path, "run", SETTINGS)
    r.wait_ts(RESTART_AT, timeout=180)
    for label in ("ps1", "learner0", "learner1"):  # no copy of range 1 survives
        os.kill(pid_of(r.dir, label), signal.SIGKILL)
    first = r.dir / "servers" / "server-0" / "ps_final.json"
    wait_for(first.exists, "server 0 finished", r, timeout=180)
    assert not (r.dir / "servers" / "server-1" / "ps_final.json").exists()  # still training
    killed = {label: pid_of(r.dir, label) for label in ("learner0", "learner1")}
    for pid in killed.values():
        os.kill(pid, signal.SIGKILL)
    assert r.finish(timeout=200) == 0, r.out
    for label in killed:
        assert f"restarting {label} with ps's final weights (ps finished)" in r.out, r.out
    rows = json.loads((r.dir / "processes.json").read_text())
    for label, pid in killed.items():
        mine = [x for x in rows if x["role"] == label]
        gone = next(x for x in mine if x["pid"] == pid)
        assert gone["exit"] == -9 and mine[-1]["pid"] != pid, mine  # restarted
        assert "--finished-in" in mine[-1]["command"], mine[-1]
    final = json.loads((r.dir / "ps_final.json").read_text())
    assert final["done"] and {f["epoch"] >= 8 for f in final["servers"]} == {True}, final
    evals = records(r.dir, "eval")
    assert evals[-1]["ts"] == final["timestamp"], evals[-1]
    line = next(x for x in r.out.splitlines() if x.startswith("result:"))
    assert f"{100 * evals[-1]['test_error']:.2f}%" in line, line
