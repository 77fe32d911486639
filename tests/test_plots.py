"""rudra_zmq.results.plots on synthetic metrics.jsonl files: parsing, summary.csv, PNGs, comparisons."""

import csv
import json
import math
import subprocess
import sys

import pytest

from rudra_zmq.results import compare, plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two evals bracket six updates: ts 1-3 (σ 0,1,2 | 1,1 | 3) then ts 4-6 (σ 2 | 4,0 | 1,1,1).
UPDATES = [(1, [0, 1, 2]), (2, [1, 1]), (3, [3]), (4, [2]), (5, [4, 0]), (6, [1, 1, 1])]


def _records():
    recs = [{"type": "eval", "ts": 0, "t": 0.5, "epoch": 0.0, "test_error": 0.9, "test_loss": 2.3}]
    for ts, sig in UPDATES:
        recs.append(
            {
                "type": "update",
                "ts": ts,
                "t": 1.0 + ts,
                "epoch": ts / 6,
                "mean_sigma": sum(sig) / len(sig),
                "sigmas": sig,
                "lr": 0.01,
                "n_grads": len(sig),
            }
        )
        if ts == 3:
            recs.append(
                {
                    "type": "eval",
                    "ts": 3,
                    "t": 4.5,
                    "epoch": 0.5,
                    "test_error": 0.4,
                    "test_loss": 1.2,
                }
            )
    recs.append(
        {"type": "eval", "ts": 6, "t": 8.5, "epoch": 1.0, "test_error": 0.25, "test_loss": 0.8}
    )
    for i, t in enumerate([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]):
        for learner in (0, 1):
            recs.append(
                {
                    "type": "learner",
                    "learner": learner,
                    "t": t + 0.1 * learner,
                    "step": i,
                    "samples_per_s": 100.0 + 10 * learner + i,
                    "loss": 2.0 / t,
                }
            )
        recs.append(
            {
                "type": "ps",
                "t": t,
                "ts": i,
                "updates_per_s": 1.0 + i,
                "gradients_per_s": 2.0 + i,
                "invalid": 0,
            }
        )
    return recs


def _write_run(path, records, tail="", name=None):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    if name is not None:
        (path / "config.yaml").write_text(f"name: {name}\nsync:\n  learners: 2\n")
    return path


def _assert_png(path):
    from matplotlib.image import imread

    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC), path
    h, w = imread(path).shape[:2]
    assert h > 100 and w > 100, (path, h, w)


@pytest.fixture
def run(tmp_path):
    # A crash mid-write leaves half a record and no newline at the end of the file.
    return _write_run(
        tmp_path / "run1", _records(), tail='{"type": "update", "ts": 7, "t"', name="softsync_n2"
    )


def test_read_metrics_groups_records_by_type_and_skips_a_truncated_last_line(run):
    m = plots.read_metrics(run / "metrics.jsonl")
    assert [len(m[k]) for k in ("update", "eval", "learner", "ps")] == [6, 3, 12, 6]
    assert m.truncated and m.malformed == 1
    assert m["update"][-1]["ts"] == 6
    assert plots.read_metrics(run)["eval"] == m["eval"]  # a run directory works too


def test_read_metrics_counts_malformed_lines_and_keeps_going(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(
        '{"type": "eval", "ts": 1, "t": 1.0, "epoch": 0.1, "test_error": 0.5}\n'
        'not json\n[1, 2]\n{"no_type": 1}\n\n'
        '{"type": "batch", "items": [{"type": "ps", "t": 2.0, "ts": 1}, 5]}\n'
        '{"type": "done", "t": 3.0}'
    )
    m = plots.read_metrics(p)
    assert m.malformed == 4 and not m.truncated
    assert len(m["eval"]) == 1 and len(m["ps"]) == 1 and m["update"] == []
    assert m["done"] == [{"type": "done", "t": 3.0}]  # unknown types are kept, last line too


def test_summary_csv_has_one_row_per_eval_with_window_mean_sigma_and_update_rate(run, tmp_path):
    out = plots.write_summary_csv(plots.read_metrics(run), tmp_path / "out" / "summary.csv")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(plots.SUMMARY_FIELDS)
    assert [r["ts"] for r in rows] == ["0", "3", "6"]
    assert [float(r["test_error"]) for r in rows] == [0.9, 0.4, 0.25]
    assert [float(r["epoch"]) for r in rows] == [0.0, 0.5, 1.0]
    # since training started: the first update, at t 2.0; the first eval was before it
    assert [float(r["wall_s"]) for r in rows] == [0.0, 2.5, 6.5]
    # No update before the first eval: no σ, and no time for a rate.
    assert rows[0]["mean_sigma"] == "" and rows[0]["updates_per_s"] == ""
    assert math.isclose(float(rows[1]["mean_sigma"]), 8 / 6)  # σ 0,1,2,1,1,3
    assert math.isclose(float(rows[2]["mean_sigma"]), 9 / 6)  # σ 2,4,0,1,1,1
    assert math.isclose(float(rows[1]["updates_per_s"]), 3 / 2.5)
    assert math.isclose(float(rows[2]["updates_per_s"]), 3 / 4.0)


def test_summary_shifts_absolute_unix_times_to_seconds_since_training_started(tmp_path):
    start = 1_780_000_000.0
    recs = [dict(r, t=r["t"] + start) for r in _records()]
    m = plots.read_metrics(_write_run(tmp_path / "abs", recs))
    assert plots.startup_s(m) == pytest.approx(1.5)  # earliest t 0.5, first update 2.0
    assert [r["wall_s"] for r in plots.summary_rows(m)] == pytest.approx([0.0, 2.5, 6.5])


def test_plot_run_writes_the_four_plots_as_valid_pngs(run):
    written = plots.plot_run(run)
    assert sorted(p.name for p in written) == sorted(
        [
            "test_error_vs_epoch.png",
            "test_error_vs_time.png",
            "staleness_hist.png",
            "throughput.png",
        ]
    )
    for p in written:
        assert p.parent == run
        _assert_png(p)
    assert not list(run.glob("*.tmp"))


def test_plot_run_skips_the_plots_whose_data_is_missing(tmp_path):
    evals_only = [r for r in _records() if r["type"] == "eval"]
    written = plots.plot_run(_write_run(tmp_path / "evals", evals_only), tmp_path / "png")
    assert sorted(p.name for p in written) == ["test_error_vs_epoch.png", "test_error_vs_time.png"]
    assert all(p.parent == tmp_path / "png" for p in written)
    ps_only = [r for r in _records() if r["type"] == "ps"]
    assert [p.name for p in plots.plot_run(_write_run(tmp_path / "ps", ps_only))] == [
        "throughput.png"
    ]
    assert plots.plot_run(_write_run(tmp_path / "empty", [], tail="{trunc")) == []


def test_run_label_is_the_config_name_or_else_the_folder_name(tmp_path):
    assert plots.run_label(_write_run(tmp_path / "a", [], name="hardsync_n4")) == "hardsync_n4"
    assert plots.run_label(_write_run(tmp_path / "b", [])) == "b"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.yaml").write_text("name: [unclosed\n")
    assert plots.run_label(tmp_path / "c") == "c"


def test_compare_runs_overlays_runs_and_leaves_out_runs_without_evals(run, tmp_path):
    slower = [
        dict(r, t=2 * r["t"], test_error=min(1.0, 1.2 * r["test_error"]))
        if r["type"] == "eval"
        else r
        for r in _records()
    ]
    other = _write_run(tmp_path / "run2", slower)
    no_evals = _write_run(tmp_path / "run3", [r for r in _records() if r["type"] != "eval"])
    out = compare.compare_runs([run, other, no_evals], tmp_path / "cmp" / "compare.png")
    assert out == tmp_path / "cmp" / "compare.png"
    _assert_png(out)
    assert compare.compare_runs([no_evals], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plotting_leaves_pyplot_and_the_global_backend_alone(run):
    code = (
        "import sys, matplotlib\n"
        "before = dict.__getitem__(matplotlib.rcParams, 'backend')\n"
        "from rudra_zmq.results import plots\n"
        f"assert len(plots.plot_run({str(run)!r})) == 4\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "assert dict.__getitem__(matplotlib.rcParams, 'backend') == before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# A quickstart as the statistics server records it: 16.5 s of start-up (the initial weights
# evaluated at 6.4 s, the PS reporting from 7.4 s), then 4 s of training.
def _quickstart():
    recs = [
        {"type": "start", "t": 0.0, "unix": 1_780_000_000.0},
        {"type": "eval", "ts": 0, "t": 6.4, "epoch": 0.0, "test_error": 0.92, "test_loss": 2.3},
        {"type": "ps", "t": 7.4, "ts": 0, "updates_per_s": 0.0, "gradients_per_s": 0.0},
    ]
    for ts in range(1, 41):
        recs.append(
            {
                "type": "update",
                "ts": ts,
                "t": 16.5 + 0.1 * (ts - 1),
                "epoch": ts / 10,
                "mean_sigma": 1.0,
                "sigmas": [1, 1],
                "lr": 0.05,
                "n_grads": 2,
            }
        )
        if ts % 10 == 0:
            recs.append(
                {
                    "type": "eval",
                    "ts": ts,
                    "t": 16.5 + 0.1 * ts,
                    "epoch": ts / 10,
                    "test_error": 0.5 / ts,
                    "test_loss": 1.0,
                }
            )
            recs.append(
                {
                    "type": "ps",
                    "t": 16.5 + 0.1 * ts,
                    "ts": ts,
                    "updates_per_s": 10.0,
                    "gradients_per_s": 20.0,
                }
            )
            recs.append(
                {
                    "type": "learner",
                    "learner": 0,
                    "t": 16.5 + 0.1 * ts,
                    "step": ts,
                    "samples_per_s": 600.0,
                    "loss": 1.0,
                }
            )
    return recs + [{"type": "done", "t": 20.6, "ts": 40, "epoch": 4.0, "evals_sent": 5}]


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots would save, by file name (nothing is written)."""
    saved = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.setdefault(path.name, fig) and path)
    return saved


def test_time_counts_from_the_first_update_and_start_up_is_reported_apart(tmp_path, figures):
    run = _write_run(tmp_path / "q", _quickstart(), name="quickstart")
    m = plots.read_metrics(run)
    assert plots.startup_s(m) == 16.5 and plots.time_origin(m) == 16.5
    x, y = plots.eval_series(m, "t")  # the initial weights' evaluation at 0
    assert list(x) == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.0]) and y[0] == 0.92
    assert [r["wall_s"] for r in plots.summary_rows(m)] == pytest.approx([0, 1, 2, 3, 4])
    plots.plot_run(run)
    ax = figures["test_error_vs_time.png"].axes[0]
    assert list(ax.get_lines()[0].get_xdata()) == pytest.approx(list(x))
    assert ax.get_xlabel() == "time since training started (s)"
    assert ax.get_title() == "quickstart: test error vs time (last 1.25 %, start-up 16.5 s)"
    learners, ps = figures["throughput.png"].axes
    assert learners.get_title() == "quickstart: throughput (start-up 16.5 s)"
    xs = [v for a in (learners, ps) for line in a.get_lines() for v in line.get_xdata()]
    assert min(xs) == pytest.approx(1.0) and ps.get_xlim()[0] == 0  # no start-up records


def test_a_run_without_start_records_still_has_its_start_up_left_out(tmp_path):
    old = [r for r in _quickstart() if r["type"] != "start"]  # written before they existed
    m = plots.read_metrics(_write_run(tmp_path / "old", old))
    assert plots.startup_s(m) == 16.5
    assert plots.summary_rows(m)[-1]["wall_s"] == pytest.approx(4.0)


def test_a_simulation_has_no_start_up_and_a_run_that_never_trained_keeps_its_clock(tmp_path):
    sim = [r for r in _quickstart() if r["type"] in ("update", "eval")]
    m = plots.read_metrics(_write_run(tmp_path / "sim", sim))
    assert plots.startup_s(m) is None and plots.time_origin(m) == 0.0
    assert list(plots.eval_series(m, "t")[0]) == pytest.approx([6.4, 17.5, 18.5, 19.5, 20.5])
    stuck = [r for r in _quickstart() if r["type"] in ("start", "ps") or r.get("ts") == 0]
    m = plots.read_metrics(_write_run(tmp_path / "stuck", stuck))
    assert plots.startup_s(m) is None and list(plots.eval_series(m, "t")[0]) == [6.4]


def test_compare_runs_labels_each_run_with_its_start_up(tmp_path, figures):
    quick = _write_run(tmp_path / "q", _quickstart(), name="quickstart")
    sim = _write_run(
        tmp_path / "s",
        [r for r in _quickstart() if r["type"] in ("update", "eval")],
        name="simulated",
    )
    compare.compare_runs([quick, sim], tmp_path / "cmp.png")
    by_epoch, by_time = figures["cmp.png"].axes
    assert [t.get_text() for t in by_time.get_legend().get_texts()] == [
        "quickstart (start-up 16.5 s)",
        "simulated",
    ]
    assert by_time.get_xlabel() == "time since training started (s)"
    assert list(by_time.get_lines()[0].get_xdata()) == pytest.approx([0, 1, 2, 3, 4])


def _resumed():
    """The quickstart above (16.5 s of start-up, 4 s of training, done at 20.6 s), resumed at
    600 s (an idle gap of 579.4 s), training again from 610 s (10 s of start-up) to 612 s."""
    recs = _quickstart() + [
        {"type": "resume", "t": 600.0},
        {
            "type": "eval",
            "ts": 40,
            "t": 605.0,
            "epoch": 4.0,
            "test_error": 0.0125,
            "test_loss": 1.0,
        },
    ]
    for ts in range(41, 61):
        recs.append(
            {
                "type": "update",
                "ts": ts,
                "t": 610.0 + 0.1 * (ts - 41),
                "epoch": ts / 10,
                "mean_sigma": 1.0,
                "sigmas": [1, 1],
                "lr": 0.05,
                "n_grads": 2,
            }
        )
    recs.append(
        {"type": "eval", "ts": 60, "t": 612.0, "epoch": 6.0, "test_error": 0.01, "test_loss": 1.0}
    )
    recs.append(
        {"type": "learner", "learner": 0, "t": 607.0, "step": 1, "samples_per_s": 9.0, "loss": 1.0}
    )  # during the resume's start-up
    return recs + [{"type": "done", "t": 612.5, "ts": 60, "epoch": 6.0, "evals_sent": 3}]


def test_a_resumed_run_counts_only_its_training_time_and_marks_the_gap(tmp_path, figures):
    run = _write_run(tmp_path / "r", _resumed(), name="quickstart")
    m = plots.read_metrics(run)
    clock = plots.TrainingClock(m)
    assert clock.trained_s == pytest.approx(4.0 + 2.0)  # 16.5-20.5 and 610-612
    assert plots.startup_s(m) == pytest.approx(16.5 + 10.0)
    ((at, idle, startup),) = clock.breaks
    assert (at, idle, startup) == pytest.approx((4.0, 600.0 - 20.5, 10.0))
    x, _ = plots.eval_series(m, "t")  # the restored weights' evaluation at the break
    assert list(x) == pytest.approx([0, 1, 2, 3, 4, 4, 6])
    assert [r["wall_s"] for r in plots.summary_rows(m)][-2:] == pytest.approx([4.0, 6.0])
    plots.plot_run(run)
    ax = figures["test_error_vs_time.png"].axes[0]
    (mark,) = [line for line in ax.get_lines() if line.get_label().startswith("run resumed")]
    assert list(mark.get_xdata()) == [4.0, 4.0]
    assert mark.get_label() == "run resumed (579.5 s idle + 10.0 s start-up left out)"
    learners, ps = figures["throughput.png"].axes
    assert max(v for line in learners.get_lines() for v in line.get_xdata()) <= 6.0
    r = compare.run_summary(run)
    assert (r["wall_s"], r["s_per_epoch"]) == pytest.approx((6.0, 1.0))
    assert (r["resumes"], r["between_runs_s"]) == (1, pytest.approx(579.5))
