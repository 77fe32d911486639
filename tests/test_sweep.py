"""`rudra-zmq sweep`: grid files, point names, up-front validation, and resumable sweeps.

The sweeps here simulate the digits with a tiny budget (a few seconds a point)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from cluster import gone
from rudra_zmq.config import ConfigError
from rudra_zmq.launch.sweep import load_grid, select
from rudra_zmq.run_files import SWEEP_LOG, sim_checkpoint_path
from rudra_zmq.sim import sim_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


def write_grid(tmp_path, **grid):
    path = tmp_path / "grid.yaml"
    path.write_text(
        yaml.safe_dump({"base": str(ROOT / "configs/quickstart.yaml"), **grid}, sort_keys=False)
    )
    return path


def test_points_are_the_explicit_points_times_the_grid_with_the_budget_and_common_keys(tmp_path):
    g = load_grid(
        write_grid(
            tmp_path,
            budget=2,
            set={"sync.learners": 2},
            points=[
                {"name": "hs", "sync.protocol": "hardsync"},
                {"name": "as", "sync.protocol": "async"},
            ],
            grid={"sync.batch_size": [8, 16]},
        )
    )
    assert [p.name for p in g.points] == ["hs-mu8", "hs-mu16", "as-mu8", "as-mu16"]
    first = g.points[0].overrides
    assert "sync.learners=2" in first and 'sync.protocol="hardsync"' in first
    assert "sync.batch_size=8" in first and "train.epochs=2.0" in first


def test_unnamed_points_are_named_after_their_values_and_the_command_line_wins(tmp_path):
    g = load_grid(
        write_grid(tmp_path, budget=2, grid={"sync.protocol": ["softsync"], "sync.n": [1, 2]}),
        budget=0.5,
        extra=["train.seed=3"],
    )
    assert [p.name for p in g.points] == ["softsync-n1", "softsync-n2"]
    assert g.budget == 0.5 and g.points[0].overrides[-2:] == ("train.epochs=0.5", "train.seed=3")
    assert [p.name for p in select(g.points, ["*n2"])] == ["softsync-n2"]
    with pytest.raises(ConfigError, match="'n3' matches no point"):
        select(g.points, ["n3"])


@pytest.mark.parametrize(
    "grid, message",
    [
        ({"points": [{"sync.learners": 0}]}, "point 'l0'.*sync.learners must be >= 1"),
        ({"grid": {"sync.batch_sise": [1]}}, "'batch_sise' is not a key"),
        ({"points": [{"name": "a"}, {"name": "a"}]}, "both named 'a'"),
        ({"budget": -1}, "budget must be a positive number"),
        ({"grid": {"sync.n": 3}}, "needs a non-empty list"),
        ({"sweep": 1}, "unknown key.*sweep"),
    ],
)
def test_a_bad_grid_is_refused_before_anything_runs_naming_the_value(tmp_path, grid, message):
    with pytest.raises(ConfigError, match=message):
        load_grid(write_grid(tmp_path, **grid))


def sweep_command(tmp_path, grid_path, *args):
    return [
        sys.executable,
        "-m",
        "rudra_zmq",
        "sweep",
        str(grid_path),
        "--simulate",
        "--parent",
        str(tmp_path / "out"),
        *args,
    ]


def sweep(tmp_path, grid_path, *args):
    cmd = sweep_command(tmp_path, grid_path, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.mark.slow
def test_a_sweep_runs_each_point_once_and_reruns_only_broken_ones(tmp_path):
    grid = write_grid(
        tmp_path,
        budget=1,
        set={"model.name": "mlp", "train.eval_every_epochs": 1},
        points=[
            {"name": "a"},
            {"name": "b", "data.dataset": "cifar10", "data.root": str(tmp_path / "missing")},
        ],
    )
    first = sweep(tmp_path, grid)
    assert first.returncode == 1, first.stdout + first.stderr  # b has no data
    lines = first.stdout.splitlines()
    assert any(line.startswith("[1/2] a: done  test error") for line in lines), lines
    assert any(line.startswith("[2/2] b: failed") for line in lines), lines
    a = json.loads((tmp_path / "out/a/point.json").read_text())
    assert (
        a["status"] == "done" and a["mode"] == "simulate" and "train.epochs=1.0" in a["overrides"]
    )
    assert (tmp_path / "out/a/metrics.jsonl").is_file()
    assert yaml.safe_load((tmp_path / "out/sweep.yaml").read_text())["points"][1]["name"] == "b"

    again = sweep(
        tmp_path,
        grid,
        "--only",
        "a",  # a finished point is skipped, also when
        "--set",
        "runtime.learners_per_process=2",
    )  # only how it runs differs
    assert again.returncode == 0 and "[1/1] a: done before, skipped" in again.stdout
    listed = yaml.safe_load((tmp_path / "out/sweep.yaml").read_text())["points"]
    assert [p["name"] for p in listed] == ["a", "b"]  # the whole grid, in its order
    (tmp_path / "out/a/point.json").unlink()  # as if it had crashed midway
    (tmp_path / "out/a/stale").write_text("x")
    third = sweep(tmp_path, grid, "--only", "a")
    assert third.returncode == 0 and "[1/1] a: done  test error" in third.stdout
    assert not (tmp_path / "out/a/stale").exists()  # the broken attempt was removed

    changed = sweep(tmp_path, grid, "--only", "a", "--budget", "2")
    assert changed.returncode == 2 and "was run with other settings" in changed.stderr


def test_every_shipped_grid_loads_and_names_its_points_as_the_paper_does():
    grids = sorted((ROOT / "configs/grids").glob("*.yaml"))
    assert [g.stem for g in grids] == ["figure3", "hardsync", "lag", "step_size", "table2"]
    points = {g.stem: [p.name for p in load_grid(g).points] for g in grids}
    assert len(points["table2"]) == 1 + 23  # the baseline and Table 2's 23 rows
    assert {"baseline", "s1-mu4-l30", "s30-mu4-l30", "s1-mu32-l30"} <= set(points["table2"])
    assert points["figure3"] == ["s4-constant", "s4-staleness", "s30-constant", "s30-staleness"]
    assert points["lag"] == ["hs-m09", "hs-m0", "s1-m0", "s30-m0"]  # issue 26's, not the paper's
    assert all(load_grid(g).budget == 140 for g in grids)  # the paper's budget


def test_a_schedule_scale_scales_every_points_budget_and_lr_steps_and_records_it(tmp_path):
    grid = write_grid(
        tmp_path, budget=140, set={"optimizer.lr_steps": [120, 130]}, points=[{"name": "a"}]
    )
    g = load_grid(grid, schedule_scale=0.1)
    over = g.points[0].overrides
    assert over[-3:] == (
        "train.epochs=14.0",
        "optimizer.lr_steps=[12.0, 13.0]",
        "train.schedule_scale=0.1",
    )
    assert g.schedule_scale == 0.1
    assert (
        load_grid(grid, budget=6, schedule_scale=0.5).points[0].overrides[-3] == "train.epochs=3.0"
    )  # --budget is scaled too
    assert load_grid(grid).points[0].overrides[-1] == "train.epochs=140.0"  # unscaled
    for bad in (0, -0.1, 1.5):
        with pytest.raises(
            ConfigError,
            match=f"--schedule-scale must be a fraction in "
            rf"\(0, 1\] of the schedule, got {bad}",
        ):
            load_grid(grid, schedule_scale=bad)


def test_the_command_line_refuses_a_bad_schedule_scale_in_one_line(tmp_path):
    grid = write_grid(tmp_path, budget=1, points=[{"name": "a"}])
    for cmd in (
        [
            "sweep",
            str(grid),
            "--simulate",
            "--schedule-scale",
            "2",
            "--parent",
            str(tmp_path / "p"),
        ],
        ["simulate", "configs/quickstart.yaml", "--schedule-scale", "0"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "rudra_zmq", *cmd],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "--schedule-scale must be a fraction" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def wait_for(what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


@pytest.mark.slow
def test_sigterm_and_sighup_stop_the_points_child_and_the_point_resumes_from_its_checkpoint(
    tmp_path,
):
    """The point's simulation runs in a session of its own, so `timeout` (SIGTERM) or a closed
    terminal (SIGHUP) reaches only the sweep: it must stop the child and keep its checkpoint.
    The sweep starts as a script's background job does (`rudra-zmq sweep ... &`: SIGINT
    ignored), and the child still stops itself on the sweep's SIGINT (its "stopped by
    SIGINT" line) instead of being killed 30 s later: it inherited the ignored SIGINT before
    the sweep set it back to its default for the child."""
    grid = write_grid(tmp_path, budget=500, points=[{"name": "a"}])  # far from done when stopped
    run_dir = tmp_path / "out/a"
    checkpoint = sim_checkpoint_path(run_dir)
    owned = []
    try:
        for stops, (sig, started) in enumerate(
            [
                (signal.SIGTERM, lambda: checkpoint.exists()),  # after its first evaluation
                (signal.SIGHUP, lambda: "resumed from" in (run_dir / SWEEP_LOG).read_text()),
            ],
            start=1,
        ):
            cmd = sweep_command(tmp_path, grid)
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            )
            owned.append(psutil.Process(proc.pid))
            child = wait_for(owned[-1].children, 60)
            assert child, "the sweep started no child"
            owned += child
            assert wait_for(started, 120), (run_dir / SWEEP_LOG).read_text()
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
            assert not psutil.wait_procs(child, timeout=30)[1], f"{child} still running"
            assert proc.returncode == 128 + sig, (out, err)
            assert f"stopped by {sig.name}" in err, err
            said = (run_dir / SWEEP_LOG).read_text()
            assert said.count("rudra-zmq simulate: stopped by SIGINT") == stops, said
            assert sim_checkpoint.describe(checkpoint) is not None  # intact, for the next sweep
            assert not (run_dir / "point.json").exists()
    finally:
        for p in owned:
            if not gone(p.pid):
                p.kill()
