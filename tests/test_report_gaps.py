"""`rudra-zmq report`'s gap to the baseline: seeds grouped, schedule lengths apart, the step
per epoch of each setting against the baseline's (results/gaps.py)."""

import csv

import pytest

from rudra_zmq import cli
from rudra_zmq.results import gaps
from test_report import make_run, png_width

pytestmark = pytest.mark.timeout(60)
BASE = ["sync.protocol=hardsync", "sync.learners=1", "sync.batch_size=128", "optimizer.lr=0.001"]
S1 = [
    "sync.protocol=softsync",
    "sync.n=1",
    "sync.learners=30",
    "sync.batch_size=4",
    "optimizer.lr=0.001",
    "optimizer.lr_policy=staleness",
]
S2 = [
    "sync.protocol=softsync",
    "sync.n=2",
    "sync.learners=2",
    "sync.batch_size=64",
    "optimizer.lr_policy=staleness",
]


def point(parent, name, overrides, error, scale=0.1, seed=0, sigmas=((0,),)):
    seeds = [f"model.seed={seed}", f"train.seed={seed}", f"train.schedule_scale={scale}"]
    return make_run(parent / name, overrides + seeds, [(31, error)], sigmas=sigmas, point={})


def rows_of(path):
    return list(csv.DictReader(path.open()))


def test_seeds_are_one_setting_and_the_gap_is_the_difference_of_their_means(tmp_path, capsys):
    parent = tmp_path / "runs"
    for seed, err in enumerate((0.27, 0.28, 0.29)):
        point(parent, f"base-{seed}", BASE, err, seed=seed)
    for seed, err in enumerate((0.31, 0.32, 0.33)):
        point(parent, f"s1-{seed}", S1, err, seed=seed, sigmas=((1,),))
    assert cli.main(["report", str(parent)]) == 0
    out = capsys.readouterr().out
    rows = {r["setting"]: r for r in rows_of(parent / "gaps.csv")}
    assert list(rows) == ["hardsync, µ=128, λ=1", "1-softsync, µ=4, λ=30"]
    s1 = rows["1-softsync, µ=4, λ=30"]
    assert s1["seeds"] == "3" and s1["errors"] == "31.00 32.00 33.00"
    assert float(s1["gap_points"]) == pytest.approx(4.0)
    # sd 1 point on each side, 3 seeds each: sqrt(1/3 + 1/3)
    assert float(s1["gap_se_points"]) == pytest.approx((2 / 3) ** 0.5)
    # c = 30 gradients of 4 at α0 (⟨σ⟩ = 1): 128/120 of the baseline's step per epoch
    assert float(s1["relative_step"]) == pytest.approx(128 / 120)
    assert float(s1["paper_gap_points"]) == pytest.approx(18.09 - 18.0)
    assert "| 1-softsync, µ=4, λ=30 | ×0.1 | 3 | 3 | 31.00 32.00 33.00 |" in out
    assert png_width(parent / "gap_vs_length.png") > 0 and png_width(parent / "gap_vs_step.png")
    assert "## The gap to the baseline" in (parent / "report.md").read_text()


def test_a_scaled_rate_is_another_setting_and_its_step_counts_it(tmp_path, capsys):
    parent = tmp_path / "runs"
    point(parent, "base", BASE, 0.27)
    point(parent, "s2", S2 + ["optimizer.lr=0.001"], 0.28, sigmas=((1,),))
    point(parent, "s2-eqstep", S2 + ["optimizer.lr=0.0005"], 0.29, sigmas=((1,),))
    assert cli.main(["report", str(parent)]) == 0
    capsys.readouterr()
    rows = {r["setting"]: r for r in rows_of(parent / "gaps.csv")}
    # 2-softsync at λ = 2: c = 1, µ = 64, ⟨σ⟩ = 1: twice the baseline's step; half α0: equal
    assert float(rows["2-softsync, µ=64, λ=2"]["relative_step"]) == pytest.approx(2.0)
    assert float(rows["2-softsync, µ=64, λ=2, α0=0.0005"]["relative_step"]) == pytest.approx(1.0)
    assert rows["2-softsync, µ=64, λ=2"]["gap_se_points"] == ""  # one seed: no error bar


def test_each_schedule_length_is_read_against_the_baseline_of_its_own_length(tmp_path, capsys):
    parent = tmp_path / "runs"
    point(parent, "base-01", BASE, 0.27, scale=0.1)
    point(parent, "s1-01", S1, 0.31, scale=0.1, sigmas=((1,),))
    point(parent, "base-025", BASE, 0.22, scale=0.25)
    point(parent, "s1-025", S1, 0.24, scale=0.25, sigmas=((1,),))
    point(parent, "s1-05", S1, 0.20, scale=0.5, sigmas=((1,),))  # no baseline at ×0.5
    assert cli.main(["report", str(parent)]) == 0
    capsys.readouterr()
    s1 = [r for r in rows_of(parent / "gaps.csv") if r["learners"] == "30"]
    assert [(r["schedule"], round(float(r["gap_points"]), 6)) for r in s1] == [
        ("0.1", 4.0),
        ("0.25", 2.0),
    ]


def test_runs_without_a_baseline_write_no_gaps(tmp_path, capsys):
    parent = tmp_path / "runs"
    point(parent, "s1", S1, 0.31, sigmas=((1,),))
    point(parent, "s2", S2, 0.30, sigmas=((1,),))
    assert cli.main(["report", str(parent)]) == 0
    assert "gap to the baseline" not in capsys.readouterr().out
    assert not (parent / "gaps.csv").exists()


def test_the_setting_leaves_out_seeds_schedule_length_and_runtime_but_not_momentum():
    a = {"model": {"seed": 1}, "train": {"seed": 1, "epochs": 14}, "runtime": {"x": 1}}
    b = {"model": {"seed": 2}, "train": {"seed": 2, "epochs": 35}, "runtime": {"x": 2}}
    assert gaps.setting_key(a) == gaps.setting_key(b)
    m = {"optimizer": {"momentum": 0.9}}
    assert gaps.setting_key(m) != gaps.setting_key({"optimizer": {"momentum": 0.0}})


def test_the_gap_over_training_is_read_at_the_epochs_both_sides_evaluated(tmp_path, capsys):
    parent = tmp_path / "runs"
    make_run(parent / "base", BASE, [(10, 0.5), (20, 0.4), (31, 0.3)], sigmas=((0,),))
    make_run(parent / "s1-0", S1 + ["model.seed=0"], [(10, 0.6), (20, 0.5), (31, 0.32)])
    make_run(parent / "s1-1", S1 + ["model.seed=1"], [(10, 0.7), (31, 0.34)])  # no eval at 20
    assert cli.main(["report", str(parent)]) == 0
    capsys.readouterr()
    from rudra_zmq.results.report import load_runs, table_row

    runs = load_runs(sorted(p for p in parent.iterdir() if p.is_dir()))
    curves = gaps.gap_curves(gaps.group_runs(runs, [table_row(r, None) for r in runs]))
    ((group, epochs, gap),) = curves
    assert group.setting == "1-softsync, µ=4, λ=30" and len(group.curves) == 2
    assert len(epochs) == 2  # epoch of ts 20 is left out: seed 1 did not evaluate there
    assert gap == pytest.approx([15.0, 3.0])  # (0.6+0.7)/2-0.5, (0.32+0.34)/2-0.3
    assert png_width(parent / "gap_over_training.png") > 0


def test_a_setting_that_needs_twice_the_epochs_has_an_epoch_factor_of_two(tmp_path, capsys):
    parent = tmp_path / "runs"
    steps = ["train.epochs=3", "optimizer.lr_steps=[2.5]", "train.eval_every_epochs=0.1"]
    # evaluations at ts 1..31 are at epochs ts x 0.0995 (test_report); the baseline's
    # error falls as 1/epoch, the setting's is the baseline's at half its epoch
    per = 0.0995
    base = [(ts, 0.05 / (ts * per)) for ts in range(1, 32)]
    slow = [(ts, min(1.0, 0.05 / (ts * per / 2))) for ts in range(1, 32)]
    make_run(parent / "base", BASE + steps, base, sigmas=((0,),))
    make_run(parent / "s1", S1 + steps, slow)
    hs = [BASE[0], BASE[3], "sync.learners=30", "sync.batch_size=4"]
    make_run(parent / "hs", hs + steps, base)
    assert cli.main(["report", str(parent)]) == 0
    capsys.readouterr()
    rows = {r["setting"]: r for r in rows_of(parent / "gaps.csv")}
    assert float(rows["1-softsync, µ=4, λ=30"]["epoch_factor"]) == pytest.approx(2.0, rel=0.05)
    assert float(rows["hardsync, µ=4, λ=30"]["epoch_factor"]) == pytest.approx(1.0, rel=0.05)
    assert rows["hardsync, µ=128, λ=1"]["epoch_factor"] == ""


def test_a_setting_with_another_rate_or_momentum_has_no_paper_gap(tmp_path, capsys):
    parent = tmp_path / "runs"
    point(parent, "base", BASE, 0.27)
    point(parent, "s2", S2 + ["optimizer.lr=0.001"], 0.28, sigmas=((1,),))
    point(parent, "s2-eqstep", S2 + ["optimizer.lr=0.0005"], 0.29, sigmas=((1,),))
    point(parent, "s2-m0", S2 + ["optimizer.lr=0.001", "optimizer.momentum=0"], 0.3, sigmas=((1,),))
    assert cli.main(["report", str(parent)]) == 0
    capsys.readouterr()
    rows = {r["setting"]: r for r in rows_of(parent / "gaps.csv")}
    assert float(rows["2-softsync, µ=64, λ=2"]["paper_gap_points"]) == pytest.approx(-0.04)
    assert rows["2-softsync, µ=64, λ=2, α0=0.0005"]["paper_gap_points"] == ""
    assert rows["2-softsync, µ=64, λ=2, momentum 0"]["paper_gap_points"] == ""
