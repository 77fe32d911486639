"""What `rudra-zmq run --resume RUN_DIR` may change about a run (resume.resume_config) and
the command line around it. No processes."""

import json

import pytest

from rudra_zmq import cli
from rudra_zmq import config as config_mod
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.launch.resume import resumable, resume_config


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    config_mod.save(load_config(None, ["sync.learners=3", "train.epochs=5"]), d / "config.yaml")
    return d


def test_resuming_without_changes_gives_the_saved_config(run_dir):
    assert resume_config(run_dir) == load_config(run_dir / "config.yaml")


def test_training_longer_and_runtime_keys_may_change_with_set(run_dir):
    cfg = resume_config(run_dir, None, ["train.epochs=9", "runtime.learner_timeout_s=5"])
    assert cfg.train.epochs == 9 and cfg.runtime.learner_timeout_s == 5
    assert resumable("runtime.timeout_s") and resumable("train.epochs")
    assert not resumable("train.seed") and not resumable("sync.learners")


@pytest.mark.parametrize(
    "key",
    [
        "sync.learners=4",
        "optimizer.lr=0.5",
        "model.seed=3",
        "train.seed=1",
        "architecture.kind=adv",
    ],
)
def test_a_key_that_defines_the_training_is_refused_naming_it(run_dir, key):
    name = key.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{name} is .* a resumed run cannot change it"):
        resume_config(run_dir, None, [key])


def test_a_config_file_that_differs_without_set_is_refused_naming_the_key(run_dir, tmp_path):
    other = tmp_path / "other.yaml"
    config_mod.save(load_config(None, ["sync.learners=3", "train.epochs=8"]), other)
    with pytest.raises(ConfigError, match="train.epochs changed from 5.0 to 8.0 without --set"):
        resume_config(run_dir, other)
    assert resume_config(run_dir, other, ["train.epochs=8"]).train.epochs == 8


def test_a_run_saved_with_curve_false_resumes_with_its_file_that_leaves_curve_unset(tmp_path):
    original = tmp_path / "c.yaml"
    original.write_text("sync:\n  learners: 3\n")  # security.curve unset
    run = tmp_path / "run"
    run.mkdir()
    saved = load_config(original)
    saved.security.curve = False  # what runs saved before unset was the default
    config_mod.save(saved, run / "config.yaml")
    assert load_config(original).security.curve is None
    assert not resume_config(run, original).security.curve
    with pytest.raises(ConfigError, match="security.curve"):  # on is still a change
        resume_config(run, original, ["security.curve=true"])


def test_a_directory_without_a_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no run to resume"):
        resume_config(tmp_path)


def test_the_run_command_needs_a_config_or_resume_and_not_both_dirs(capsys):
    assert cli.main(["run"]) == 2
    assert "give a CONFIG to start a run, or --resume RUN_DIR" in capsys.readouterr().err
    assert cli.main(["run", "--resume", "a", "--run-dir", "b"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_a_finished_run_has_nothing_to_do_unless_it_trains_longer(run_dir):
    from rudra_zmq.launch.resume import finished_note

    cfg = resume_config(run_dir)
    assert finished_note(run_dir, cfg) is None  # no final state: resume
    (run_dir / "ps_final.json").write_text(
        json.dumps({"timestamp": 80, "epoch": 5.02, "done": True})
    )
    assert finished_note(run_dir, cfg) == (
        f"rudra-zmq: nothing to do: {run_dir} already trained 5.02 epochs of train.epochs=5; "
        "to train on, resume with --set train.epochs=N (N > 5.02)"
    )
    assert finished_note(run_dir, resume_config(run_dir, None, ["train.epochs=9"])) is None
    (run_dir / "ps_final.json").write_text(
        json.dumps({"timestamp": 80, "epoch": 5.02, "done": False})
    )  # stopped early
    assert finished_note(run_dir, cfg) is None
