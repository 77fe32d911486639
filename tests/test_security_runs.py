"""Whole runs with ``security.curve: true`` train as before (``docs/security.md``).

- Under ``rudra-zmq run`` (real processes: stats, data, PS, learners) the quickstart trains
  with per-run keys the launcher made, and the result line is printed.
- With every role as a thread of this process (``tests/inproc.py``), Rudra-adv (tree nodes)
  and Rudra-adv* (the broadcast through the learners) train with CURVE on every socket: the
  authenticator admitted each learner's, each tree node's and the PS's own key, and nothing
  else was asked.
"""

import json
import os
import stat

import numpy as np
import pytest

from rudra_zmq import transport
from rudra_zmq.security import auth, keys
from test_system import DIGITS, ROOT, rudra_run, threaded_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_the_quickstart_under_rudra_zmq_run_trains_with_curve(tmp_path):
    run_dir, out = rudra_run(tmp_path, "curve", ["security.curve=true", "train.epochs=3"])
    assert "result: test error" in out
    kdir = run_dir / "keys"
    names = {k.name for k in keys.list_keys(kdir)}
    assert names == {"learner-0", "learner-1", "learner-2", "learner-3", "ps"}
    assert stat.S_IMODE(os.stat(kdir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(kdir / "server.key_secret").st_mode) == 0o600
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"type": "eval"' in line or '"type":"eval"' in line
    ]
    # EVALs got through CURVE: the final weights' EVAL always does (the PS waits for it);
    # the per-epoch ones may be skipped by a busy statistics server, so their count is not
    # checked (CI once saw epochs 1 and 3 only).
    final = json.loads((run_dir / "ps_final.json").read_text())
    assert evals and evals[-1]["ts"] == final["timestamp"]
    assert np.isfinite(np.load(run_dir / "weights.npy")).all()


class Counting:
    """Wraps a Curve's allow-list so the test sees every key the authenticator was asked
    about (by name; None for a key not in the list)."""

    def __init__(self, curve):
        self.asked, self._allow = [], curve.allow
        self._callback = curve.allow.callback
        curve.allow.callback = self.callback

    def callback(self, domain, key):
        self.asked.append(self._allow.name_of(key))
        return self._callback(domain, key)


@pytest.mark.parametrize(
    "arch,config,extra",
    [
        (
            "adv",
            None,
            [
                *DIGITS,
                "sync.protocol=softsync",
                "sync.n=2",
                "sync.learners=4",
                "sync.batch_size=8",
                "train.epochs=0.5",
                "architecture.kind=adv",
                "architecture.fanout=2",
            ],
        ),
        (
            "advstar",
            ROOT / "configs/quickstart_advstar.yaml",
            ["train.epochs=0.5", "train.eval_every_epochs=0"],
        ),
    ],
)
def test_tree_and_broadcast_runs_use_curve_on_every_socket(tmp_path, arch, config, extra):
    names = [f"learner-{i}" for i in range(4)] + ["ps", "node-0", "node-1"]
    keys.make_run_keys(tmp_path / "keys", names)
    curve = auth.Curve(tmp_path / "keys")
    seen = Counting(curve)
    transport.set_security(curve)
    try:
        run_dir, _ = threaded_run(tmp_path, arch, ["security.curve=true", *extra], config=config)
    finally:
        transport.set_security(None)
    updates = [
        line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"update"' in line
    ]
    assert updates, "no update was recorded"
    assert None not in seen.asked  # only allow-listed keys ever knocked
    # every learner (PS or leaf, data server; adv*: the broadcast) and both tree nodes (to
    # the root) connected with their own keys
    assert {f"learner-{i}" for i in range(4)} | {"node-0", "node-1"} <= set(seen.asked)
    assert np.isfinite(np.load(run_dir / "weights.npy")).all()
