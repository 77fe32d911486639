"""Shipped configs, grids and examples are found by name from any folder (rudra_zmq.shipped);
the installed-wheel side of the same is in test_packaging.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from rudra_zmq import shipped
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.launch.sweep import load_grid

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "rudra_zmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "text", ["table2", "grids/table2", "grids/table2.yaml", "configs/grids/table2.yaml"]
)
def test_a_grid_is_found_by_name_or_by_its_repository_path_from_any_folder(
    text, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    grid = load_grid(text)
    assert grid.name == "table2"
    assert {p.name for p in grid.points} >= {"baseline", "s1-mu4-l30", "s30-mu4-l30"}


def test_a_config_is_found_by_its_repository_path_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/quickstart.yaml") == load_config(
        str(REPO / "configs" / "quickstart.yaml")
    )


def test_a_grid_file_in_the_current_folder_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "table2").write_text(f"name: mine\nbase: {REPO / 'configs/quickstart.yaml'}\n")
    assert load_grid("table2").name == "mine"


def test_an_unknown_grid_name_is_refused_with_the_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"grid 'tabel2' is not a file and not a built-in "
        r"grid; .*figure3, hardsync, lag, step_size, table2",
    ):
        load_grid("tabel2")
    with pytest.raises(FileNotFoundError, match="grid file 'elsewhere/table2.yaml' does not exist"):
        load_grid("elsewhere/table2.yaml")


def test_sweep_lists_a_builtin_grid_by_name_from_an_empty_folder(tmp_path):
    res = _cli("sweep", "table2", "--list", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("baseline: "), res.stdout


def test_examples_are_listed_printed_and_copied_by_name(tmp_path):
    listed = _cli("examples", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    for name in ("slurm.sbatch", "mpirun_mpmd.sh", "hostfile", "custom_model.py"):
        assert name in shipped.names("example")
        assert name in listed.stdout

    printed = _cli("examples", "slurm.sbatch", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == (REPO / "examples" / "slurm.sbatch").read_text()

    copied = _cli("examples", "--copy", "mine", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == shipped.names("example")
    (tmp_path / "mine" / "hostfile").write_text("edited\n")
    again = _cli("examples", "--copy", "mine", cwd=tmp_path)
    assert "hostfile: exists, left as it is" in again.stdout
    assert (tmp_path / "mine" / "hostfile").read_text() == "edited\n"


def test_an_unknown_example_exits_2_naming_the_examples(tmp_path):
    res = _cli("examples", "slurm", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith(
        "rudra-zmq: error: no example 'slurm'; the examples are: custom_model.py, hostfile"
    ), res.stderr
