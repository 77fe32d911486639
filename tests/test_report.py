"""`rudra-zmq report`: Table 2's layout and Figures 3-4 from run directories made by hand."""

import csv
import json
import struct

import pytest

from rudra_zmq import cli
from rudra_zmq.config import load_config, save
from rudra_zmq.results import paper, report

pytestmark = pytest.mark.timeout(60)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPOCHS_PER_UPDATE = 0.0995  # so the update that reaches 3 epochs (ts 31) goes past them


def make_run(path, overrides, evals=(), sigmas=((1,),), updates=31, point=None, real=False):
    """A run directory as `run`, `simulate` or `sweep` leaves it: the resolved config.yaml,
    metrics.jsonl with `updates` update records (σ lists cycled from `sigmas`; epoch and t
    grow by EPOCHS_PER_UPDATE and 2 s per update) and an eval (ts, test error) per `evals`;
    point.json when `point` is given, processes.json when `real`."""
    path.mkdir(parents=True)
    save(load_config(None, ["train.epochs=3", *overrides]), path / "config.yaml")
    recs = [
        {
            "type": "update",
            "ts": ts,
            "t": 2.0 * ts,
            "epoch": ts * EPOCHS_PER_UPDATE,
            "sigmas": list(s),
            "mean_sigma": sum(s) / len(s),
            "n_grads": len(s),
            "lr": 0.01,
        }
        for ts, s in zip(range(1, updates + 1), sigmas * updates)
    ]
    recs += [
        {
            "type": "eval",
            "ts": ts,
            "t": 2.0 * ts,
            "epoch": ts * EPOCHS_PER_UPDATE,
            "test_error": err,
            "test_loss": 1.0,
        }
        for ts, err in evals
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if point is not None:
        (path / "point.json").write_text(
            json.dumps(
                {
                    "point": path.name,
                    "overrides": list(overrides),
                    "mode": "simulate",
                    "status": "done",
                    "exit_code": 0,
                    "wall_s": 1.5,
                    "started": "2025-01-01T00:00:00",
                    "finished": "2025-01-01T00:00:02",
                    **point,
                }
            )
        )
    if real:
        (path / "processes.json").write_text("[]")
    return path


EVALS = [(10, 0.5), (20, 0.3), (31, 0.35)]  # epochs 0.995, 1.99 and 3.08


@pytest.fixture
def sweep(tmp_path):
    """A sweep directory whose grid lists its points out of name order, one of them failed."""
    parent = tmp_path / "sweep"
    make_run(
        parent / "soft30",
        [
            "sync.protocol=softsync",
            "sync.n=30",
            "sync.learners=30",
            "sync.batch_size=4",
            "optimizer.lr_policy=staleness",
        ],
        EVALS,
        sigmas=((29, 30),),
        point={},
    )
    make_run(
        parent / "base",
        [
            "sync.protocol=softsync",
            "sync.n=1",
            "sync.learners=1",
            "sync.batch_size=128",
            "optimizer.lr=0.001",
        ],
        [(10, 0.4), (31, 0.2)],
        sigmas=((0,),),
        point={},
    )
    make_run(
        parent / "async8",
        ["sync.protocol=async", "sync.learners=8", "sync.batch_size=16"],
        [],
        sigmas=((6,), (8,)),
        updates=4,
        point={"status": "failed", "exit_code": 1},
    )
    (parent / "sweep.yaml").write_text(  # as `rudra-zmq sweep` writes it
        "name: grid\nbase: configs/quickstart.yaml\nbudget: 3\nmode: simulate\npoints:\n"
        "- name: soft30\n  overrides: [sync.n=30]\n- name: base\n  overrides: [sync.n=1]\n"
        "- name: async8\n  overrides: [sync.protocol=async]\n"
    )
    (parent / "notes").mkdir()  # not a run: left out
    return parent


def read_csv(path):
    return {r["run"]: r for r in csv.DictReader(path.open())}


def png_width(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">I", data[16:20])[0]


def test_report_on_a_sweep_writes_table_2_rows_beside_the_paper(sweep, capsys):
    assert cli.main(["report", str(sweep)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table] == [
        "| run",
        "| soft30",
        "| base",
        "| async8",
    ]  # sweep.yaml's order
    assert (sweep / "report.md").read_text().count("| soft30 |") == 1
    rows = read_csv(sweep / "report.csv")
    soft, base, failed = rows["soft30"], rows["base"], rows["async8"]
    assert soft["protocol"] == "30-softsync" and soft["mode"] == "simulated"
    assert (soft["sigma"], soft["batch"], soft["learners"], soft["mu_lambda"]) == (
        "30",
        "4",
        "30",
        "120",
    )
    assert float(soft["mean_sigma"]) == 29.5
    # budget 3 epochs: the eval of the update that reached them (ts 31, 3.08 epochs) counts
    assert float(soft["error_at_budget"]) == 0.35 and float(soft["best_error"]) == 0.3
    assert float(soft["time"]) == 62.0 and soft["time_unit"] == "sim"
    assert float(soft["paper_error"]) == 0.1841  # Table 2: ≈128, σ 30, µ 4, λ 30
    assert base["sigma"] == "1" and base["paper_error"] == ""  # µ 128, λ 1 is no Table 2 row
    assert float(base["error_at_budget"]) == 0.2 and float(base["mean_sigma"]) == 0.0
    assert (failed["sigma"], failed["status"]) == ("8", "failed (exit 1), no eval")
    assert failed["error_at_budget"] == "" and float(failed["mean_sigma"]) == 7.0
    assert "| 30-softsync | 30 | 4 | 30 | 120 | α0/⟨σ⟩ |" in out
    assert "| 35.00 % | 30.00 % | 62.0 sim | 29.50 | 18.41 % |" in out
    for name in ("fig3_error_vs_epoch.png", "fig4_error_vs_time.png"):
        assert (sweep / name).stat().st_size > 0 and png_width(sweep / name) > 0


def test_a_budget_cuts_the_evals_after_it(sweep, tmp_path):
    assert cli.main(["report", str(sweep), "--budget", "2", "--out", str(tmp_path / "r")]) == 0
    soft = read_csv(tmp_path / "r" / "report.csv")["soft30"]
    assert (float(soft["budget"]), float(soft["error_at_budget"])) == (2.0, 0.3)
    assert float(soft["time"]) == 40.0
    runs = report.load_runs([sweep / "soft30"])
    assert report.table_row(runs[0], budget=1.5)["error_at_budget"] == 0.5
    assert report.table_row(runs[0], budget=0.5)["error_at_budget"] is None


def test_records_kept_as_evaluations_only_still_count_the_eval_that_reached_the_budget(tmp_path):
    # docs/reproduction keeps a run's evaluations without its updates: the run stopped at the
    # update a little past 3 epochs, whose eval is the final one; the next would be a whole
    # interval later and must not count.
    run = tmp_path / "evals-only"
    make_run(run, [], evals=[(0, 0.9), (10, 0.5), (20, 0.4), (31, 0.3)], updates=0)
    assert EPOCHS_PER_UPDATE * 31 > 3.0 > EPOCHS_PER_UPDATE * 20
    row = report.table_row(report.load_runs([run])[0])
    assert (row["error_at_budget"], row["best_error"]) == (0.3, 0.3)
    assert report.table_row(report.load_runs([run])[0], budget=2.5)["error_at_budget"] == 0.4


def test_records_with_every_nth_update_still_count_the_eval_that_reached_the_budget(tmp_path):
    # docs/reproduction keeps every 50th update record: the update a little past the budget
    # (ts 31) may be among those left out, and its eval is still the final one.
    run = make_run(tmp_path / "thinned", [], evals=[(0, 0.9), (10, 0.5), (20, 0.4), (31, 0.3)])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    kept = [x for x in lines if json.loads(x)["type"] == "eval" or json.loads(x)["ts"] % 10 == 0]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in kept))
    row = report.table_row(report.load_runs([run])[0])
    assert row["error_at_budget"] == 0.3


def test_a_run_whose_servers_restarted_says_so_in_its_status(tmp_path):
    from types import SimpleNamespace

    from rudra_zmq.server.end_files import write_final

    run = make_run(tmp_path / "restarted", ["architecture.servers=2"], evals=EVALS, real=True)
    engine = SimpleNamespace(timestamp=31, epoch=3.08, updates=31)
    state = SimpleNamespace(engine=engine, done=True, incarnations=[1], parts=None)
    restart = {"server": 1, "from": "learner 2", "ts": 12, "lost": 3, "incarnation": 2}
    write_final(run, state, restarts=[restart], incarnation=1)
    row = report.table_row(report.load_runs([run])[0])
    assert row["status"] == "restarted: server 1 from learner 2 at ts 12, 3 updates lost"


def test_runs_without_a_sweep_are_ordered_by_name_and_typed_by_processes_json(tmp_path):
    parent = tmp_path / "runs"
    make_run(parent / "b-real", ["sync.protocol=hardsync"], [(31, 0.4)], real=True)
    make_run(parent / "a-sim", ["sync.protocol=hardsync"], [(31, 0.5)])
    (parent / "c-crashed").mkdir()
    (parent / "c-crashed" / "point.json").write_text(
        json.dumps({"point": "c-crashed", "mode": "run", "status": "failed", "exit_code": 2})
    )
    runs = report.load_runs(report.expand_run_dirs([parent], report.RUN_MARKERS))
    # the config names repeat ("run"), so the folder tells the runs apart
    assert [(r.label, r.mode) for r in runs] == [
        ("run (a-sim)", "simulated"),
        ("run (b-real)", "real"),
        ("c-crashed", "real"),
    ]
    rows = [report.table_row(r) for r in runs]
    assert [r["status"] for r in rows] == ["", "", "failed (exit 2), no metrics"]
    assert rows[1]["sigma"] == 0 and rows[1]["time_unit"] == "s"
    # real and simulated runs together: Figure 4 has a panel for each
    one = report.write_figures(runs[:1], rows[:1], tmp_path)[1]
    one_width = png_width(one)
    both = report.write_figures(runs, rows, tmp_path)[1]
    assert png_width(both) == 2 * one_width


def test_runs_that_differ_only_in_lr_policy_share_a_colour_in_figure_3(tmp_path):
    common = ["sync.protocol=softsync", "sync.n=4", "sync.learners=30", "sync.batch_size=128"]
    dirs = [
        make_run(tmp_path / name, common + extra, [(31, 0.5)])
        for name, extra in (
            ("stale", ["optimizer.lr_policy=staleness"]),
            ("const", ["optimizer.lr_policy=constant", "runtime.run_dir=elsewhere"]),
            ("mu64", ["sync.batch_size=64"]),
        )
    ]
    runs = report.load_runs(dirs)
    stale, const, mu64 = report.line_styles(runs, [report.table_row(r) for r in runs])
    assert stale["color"] == const["color"] != mu64["color"]
    assert (stale["linestyle"], const["linestyle"]) == ("-", "--")
    assert stale["label"] == "4-softsync, µ=128, λ=30, α0/⟨σ⟩"


def test_the_paper_table_matches_by_group_sigma_mu_and_lambda():
    assert len(paper.TABLE2) == 23
    assert paper.table2_row(4, 30, 1).test_error_pct == 18.09
    assert paper.table2_row(128, 10, 10).test_error_pct == 29.90
    assert paper.table2_row(128, 1, 1) is None and paper.table2_row(4, 30, 4) is None
    assert paper.mu_lambda_group(120) == 128 and paper.mu_lambda_group(32) is None


def test_compare_takes_a_sweep_directory(sweep, tmp_path, capsys):
    png = tmp_path / "c.png"
    assert cli.main(["compare", str(sweep), "-o", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the config names repeat ("run"), so compare tells the runs apart by folder
    assert [line.split()[1] for line in lines[1:4]] == ["(soft30)", "(base)", "(async8)"]
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_path_that_holds_no_runs_is_named_and_exits_2(tmp_path, capsys, command):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    assert cli.main([command, str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"{empty}: no metrics.jsonl" in err and "nor in any subdirectory" in err
    assert cli.main([command, str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no metrics.jsonl" in capsys.readouterr().err
    assert list(empty.iterdir()) == [empty / "sub"]  # nothing written


def test_a_real_runs_time_counts_from_the_start_of_training(tmp_path):
    run = make_run(tmp_path / "real", ["sync.protocol=hardsync"], [(31, 0.4)], real=True)
    metrics = run / "metrics.jsonl"  # as the statistics server writes it: its clock first
    metrics.write_text(
        json.dumps({"type": "start", "t": 0.0, "unix": 1.78e9}) + "\n" + metrics.read_text()
    )
    row = report.table_row(report.load_runs([run])[0])
    assert row["time"] == 60.0  # at 62 s; the first update, at 2 s, ended start-up
    assert "since training started" in report.format_markdown([row])


def test_a_scaled_schedule_is_marked_in_a_column_and_a_line_above_the_table(tmp_path, capsys):
    parent = tmp_path / "sweep"
    make_run(
        parent / "scaled",
        [
            "sync.protocol=softsync",
            "sync.n=30",
            "sync.learners=30",
            "sync.batch_size=4",
            "train.schedule_scale=0.1",
        ],
        EVALS,
    )
    make_run(
        parent / "plain",
        ["sync.protocol=softsync", "sync.n=1", "sync.learners=30", "sync.batch_size=4"],
        EVALS,
    )
    assert cli.main(["report", str(parent)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**Schedule scaled ×0.1 in some runs — not the paper's budget**")
    rows = read_csv(parent / "report.csv")
    assert rows["run (scaled)"]["schedule"] == "0.1" and rows["run (plain)"]["schedule"] == ""
    assert "| 3 | ×0.1 | 35.00 % |" in out and "| 3 |  | 35.00 % |" in out
    make_run(tmp_path / "alone", ["sync.n=1"], EVALS)
    assert cli.main(["report", str(tmp_path / "alone"), "--out", str(tmp_path / "o")]) == 0
    assert "Schedule scaled" not in capsys.readouterr().out  # unscaled: no such line
