"""The Python API: ``rudra_zmq.train`` runs every role as ``rudra-zmq run`` does, with the
user's own model and data named by import path, and fails with every role stopped.

The runs start the real roles as processes (~25 s each on 2 busy cores, mostly importing
torch in every process)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

import rudra_zmq
from cluster import gone
from rudra_zmq.server.start import initial_model

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import sys
import numpy as np
from torch import nn

def small_cnn(num_classes, input_shape):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))

def fails_in_the_learner(num_classes, input_shape):
    if "learner" in sys.argv:   # python -m rudra_zmq learner ...
        raise RuntimeError("no model in the learner")
    return small_cnn(num_classes, input_shape)

def blobs():
    rng = np.random.default_rng(7)
    means = rng.uniform(40, 215, (3, 1, 6, 6))
    y = rng.integers(0, 3, 320)
    x = np.clip(means[y] + rng.normal(0, 40, (320, 1, 6, 6)), 0, 255).astype(np.uint8)
    return x[:256], y[:256], x[256:], y[256:]
"""

CONFIG = {
    "name": "api",
    "model": {"name": "api_user_code:small_cnn", "seed": 1},
    "data": {"dataset": "api_user_code:blobs", "num_classes": 3},
    "sync": {"protocol": "hardsync", "learners": 2, "batch_size": 8},
    "optimizer": {"lr": 0.05, "momentum": 0.9},
    "train": {"epochs": 1.0, "eval_every_epochs": 1.0, "checkpoint_every_s": 0.0},
    "runtime": {"threads_per_learner": 1, "timeout_s": 60.0},
}


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """``api_user_code``, a module in a folder of its own, importable here (as a script's
    own folder is) but not installed: train() must hand the folder to the roles."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "api_user_code.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield folder
    sys.modules.pop("api_user_code", None)


def pids(run_dir: Path) -> list[int]:
    return [row["pid"] for row in json.loads((run_dir / "processes.json").read_text())]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_and_rudra_zmq_run_give_the_same_weights_for_the_same_seed(tmp_path, user_code):
    result = rudra_zmq.train(CONFIG, run_dir=tmp_path / "api", quiet=True)
    assert result.run_dir == tmp_path / "api" and result.epochs == pytest.approx(1.0)
    assert result.final_error is not None and result.best_error <= result.final_error
    assert result.mean_sigma == 0.0 and result.wall_s > 0  # hardsync: σ is always 0
    assert all(gone(pid) for pid in pids(result.run_dir))

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "run",
            str(tmp_path / "config.yaml"),
            "--run-dir",
            str(tmp_path / "cli"),
        ],
        env={**os.environ, "PYTHONPATH": str(user_code)},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert (tmp_path / "api/config.yaml").read_text() == (tmp_path / "cli/config.yaml").read_text()
    w_api, w_cli = result.weights(), np.load(tmp_path / "cli/weights.npy")
    w0 = initial_model(rudra_zmq.load_config(CONFIG))[0]
    moved = np.linalg.norm(w_api - w0) / np.linalg.norm(w0)
    assert moved > 1e-2
    np.testing.assert_array_equal(w_api, w_cli)  # bit for bit

    # the simulator builds the same model from the same path, in this process
    sim = rudra_zmq.simulate(CONFIG, train=True, run_dir=tmp_path / "sim", quiet=True)
    rel = np.linalg.norm(sim.weights() - w_api) / np.linalg.norm(w_api)
    print(
        f"{w_api.size} weights; training moved them by {moved:.3f} (relative L2); API vs "
        f"CLI max |difference| {np.abs(w_api - w_cli).max():.1e}; simulator vs API {rel:.1e}"
    )
    assert sim.epochs == pytest.approx(1.0) and rel <= 1e-5, rel


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_role_that_fails_raises_training_error_naming_it_with_nothing_left_running(
    tmp_path, user_code
):
    with pytest.raises(rudra_zmq.TrainingError) as err:
        rudra_zmq.train(
            CONFIG,
            {
                "model.name": "api_user_code:fails_in_the_learner",
                "sync.learners": 1,
                "runtime.restart": False,
            },
            run_dir=tmp_path / "run",
            quiet=True,
        )
    e = err.value
    assert e.role == "learner0" and e.exit_code not in (0, None)
    assert e.log == tmp_path / "run/logs/learner0.log"
    assert "learner0" in str(e) and str(e.log) in str(e) and "no model in the learner" in str(e)
    assert all(gone(pid) for pid in pids(e.run_dir))


def test_a_bad_import_path_is_a_config_error_before_anything_starts(tmp_path, user_code):
    with pytest.raises(rudra_zmq.ConfigError, match="model.name 'api_user_code:nope'"):
        rudra_zmq.train(
            CONFIG, {"model.name": "api_user_code:nope", "runtime.run_dir": str(tmp_path / "runs")}
        )
    assert not (tmp_path / "runs").exists()


def test_the_config_loader_takes_a_path_a_dict_or_a_config_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sync:\n  learners: 3\n")
    from_path = rudra_zmq.load_config(path, {"sync.batch_size": 4, "data.root": None})
    from_dict = rudra_zmq.load_config({"sync": {"learners": 3}}, ["sync.batch_size=4"])
    again = rudra_zmq.load_config(from_dict)
    assert from_path == from_dict == again and isinstance(again, rudra_zmq.Config)
    assert (again.sync.learners, again.sync.batch_size) == (3, 4)
    assert rudra_zmq.load_config({"name": "yes"}).name == "yes"  # a string, not YAML's true
    with pytest.raises(rudra_zmq.ConfigError, match="'lerners' is not a key of sync"):
        rudra_zmq.load_config(None, {"sync.lerners": 8})
    with pytest.raises(rudra_zmq.ConfigError, match="a config is a YAML path, a dict or a Config"):
        rudra_zmq.load_config(42)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_trains_a_user_model_on_user_data_through_the_api(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples/custom_model.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test error" in proc.stdout.splitlines()[-1]
    assert list((tmp_path / "runs").glob("custom_model-*/weights.npy"))
