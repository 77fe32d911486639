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


def test_run_on_a_network_address_plans_curve_unless_told_false_and_then_says_so(tmp_path):
    """`run` decides security.curve as `launch` across hosts does: unset is on once a server
    listens beyond loopback (runtime.host), off on loopback; an explicit false stands and is
    named in one terminal line."""
    import yaml

    from rudra_zmq.config import load_config
    from rudra_zmq.launch.run_plan import make_plan, plaintext_warning, summary

    quickstart = ROOT / "configs/quickstart.yaml"
    lan = make_plan(load_config(quickstart, ["runtime.host=0.0.0.0"]), tmp_path / "lan")
    assert lan.cfg.security.curve is True and plaintext_warning("run", lan) is None
    assert "security: CurveZMQ on every socket" in summary(lan)
    saved = yaml.safe_load((tmp_path / "lan" / "config.yaml").read_text())
    assert saved["security"]["curve"] is True  # what --resume goes on with
    sharded = ["runtime.host=0.0.0.0", "architecture.servers=2"]
    two = make_plan(load_config(quickstart, sharded), tmp_path / "two")
    assert two.cfg.security.curve is True and plaintext_warning("run", two) is None
    local = make_plan(load_config(quickstart), tmp_path / "local")
    assert not local.cfg.security.curve and plaintext_warning("run", local) is None
    told = ["runtime.host=0.0.0.0", "security.curve=false"]
    plain = make_plan(load_config(quickstart, told), tmp_path / "plain")
    line = plaintext_warning("run", plain)
    assert (
        line.startswith("rudra-zmq run: warning: security.curve is false") and "PLAINTEXT" in line
    )
    assert "security: PLAINTEXT beyond this machine" in summary(plain)


@pytest.mark.parametrize("curve", [None, False])
def test_run_bound_to_every_interface_trains_encrypted_or_names_false_once(tmp_path, curve):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    sets = ["runtime.host=0.0.0.0", "train.epochs=1", "runtime.learners_per_process=2"]
    sets += [] if curve is None else ["security.curve=false"]
    proc = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs/quickstart.yaml")]
        + ["--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: test error" in proc.stdout
    roles_said = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "without encryption" not in roles_said  # said once by `run`, or not at all
    if curve is None:
        assert {k.name for k in keys.list_keys(run_dir / "keys")} >= {"ps", "learner-0"}
        assert "PLAINTEXT" not in proc.stderr
    else:
        assert not (run_dir / "keys").exists()
        assert proc.stderr.count("PLAINTEXT") == 1 and "security.curve is false" in proc.stderr
