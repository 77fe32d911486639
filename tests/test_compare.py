"""`rudra-zmq compare`: the table and plot of several run directories, from what runs write."""

import csv
import json

import pytest

from rudra_zmq import cli

pytestmark = pytest.mark.timeout(60)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, name, protocol, n, lr_policy, evals, updates):
    """A run directory as `rudra-zmq run` leaves it: config.yaml and metrics.jsonl."""
    path.mkdir()
    (path / "config.yaml").write_text(
        f"name: {name}\nsync:\n  protocol: {protocol}\n  n: {n}\n  learners: 4\n"
        f"  batch_size: 16\noptimizer:\n  lr: 0.05\n  lr_policy: {lr_policy}\n"
        "architecture:\n  kind: base\n"
    )
    recs = [
        {
            "type": "update",
            "t": t,
            "ts": ts,
            "sigmas": s,
            "mean_sigma": sum(s) / len(s),
            "n_grads": len(s),
        }
        for t, ts, s in updates
    ]
    recs += [
        {"type": "eval", "t": t, "ts": ts, "epoch": ep, "test_error": err, "test_loss": 1.0}
        for t, ts, ep, err in evals
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_compare_prints_a_row_per_run_and_writes_the_plot_and_csv(tmp_path, capsys):
    a = make_run(
        tmp_path / "a",
        "quick",
        "softsync",
        2,
        "staleness",
        evals=[(0.0, 0, 0.0, 0.9), (4.0, 2, 1.0, 0.2), (8.0, 4, 2.0, 0.3)],
        updates=[(1.0, 1, [0, 1]), (2.0, 2, [2, 2]), (3.0, 3, [1, 1]), (4.0, 4, [3, 1])],
    )
    b = make_run(
        tmp_path / "b",
        "quick",
        "hardsync",
        1,
        "constant",
        evals=[(0.0, 0, 0.0, 0.9), (5.0, 1, 0.5, 0.5)],
        updates=[(5.0, 1, [0, 0, 0, 0])],
    )
    png, table = tmp_path / "cmp.png", tmp_path / "t.csv"
    assert cli.main(["compare", str(a), str(b), "-o", str(png), "--csv", str(table)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["run", "protocol", "learners"]
    # same config name twice: the folder tells them apart
    assert out[1].startswith("quick (a)") and "softsync n=2" in out[1]
    assert out[2].startswith("quick (b)") and "hardsync" in out[2]
    rows = list(csv.DictReader(table.open()))
    ra, rb = rows
    assert float(ra["final_error"]) == 0.3 and float(ra["best_error"]) == 0.2
    assert float(ra["mean_sigma"]) == pytest.approx(11 / 8)  # every gradient's σ, averaged
    assert float(ra["wall_s"]) == 8.0 and float(ra["s_per_epoch"]) == 4.0
    assert ra["lr_policy"] == "staleness" and ra["learners"] == "4" and ra["batch"] == "16"
    assert float(rb["mean_sigma"]) == 0.0 and float(rb["s_per_epoch"]) == 10.0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_compare_reports_start_up_apart_from_the_training_time(tmp_path, capsys):
    """A real run's start-up (processes starting until the PS's first update) is its own
    column; wall time and seconds per epoch count from the start of training."""
    a = make_run(
        tmp_path / "a",
        "quick",
        "softsync",
        1,
        "staleness",
        evals=[(6.4, 0, 0.0, 0.9), (18.5, 2, 1.0, 0.2), (20.5, 4, 2.0, 0.1)],
        updates=[(16.5, 1, [0]), (17.5, 2, [1]), (18.5, 3, [1]), (19.5, 4, [1])],
    )
    with open(a / "metrics.jsonl", "r+") as f:  # as the statistics server writes it
        recs = f.read()
        f.seek(0)
        f.write(json.dumps({"type": "start", "t": 0.0, "unix": 1.78e9}) + "\n" + recs)
    sim = make_run(
        tmp_path / "sim",
        "sim",
        "softsync",
        1,
        "staleness",
        evals=[(0.0, 0, 0.0, 0.9), (4.0, 4, 2.0, 0.1)],
        updates=[(1.0, 1, [0])],
    )
    table = tmp_path / "t.csv"
    assert (
        cli.main(["compare", str(a), str(sim), "-o", str(tmp_path / "c.png"), "--csv", str(table)])
        == 0
    )
    header, row_a, row_sim = capsys.readouterr().out.splitlines()[:3]
    assert header.split()[-3:] == ["startup_s", "wall_s", "s_per_epoch"]
    assert row_a.split()[-3:] == ["16.5", "4.0", "2.00"]
    assert row_sim.split()[-3:] == ["-", "4.0", "2.00"]
    ra, rs = csv.DictReader(table.open())
    assert (float(ra["startup_s"]), float(ra["wall_s"]), float(ra["s_per_epoch"])) == (
        16.5,
        4.0,
        2.0,
    )
    assert rs["startup_s"] == ""  # a simulation has no start-up


def test_compare_names_a_directory_that_is_not_a_run(tmp_path, capsys):
    a = make_run(
        tmp_path / "a",
        "quick",
        "async",
        4,
        "staleness",
        evals=[(1.0, 1, 1.0, 0.5)],
        updates=[(1.0, 1, [3])],
    )
    assert cli.main(["compare", str(a), str(tmp_path / "nope"), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope'}: no metrics.jsonl here" in err
    assert not (tmp_path / "c.png").exists()  # nothing written on a bad argument


def test_a_run_whose_final_weights_were_never_evaluated_says_so(tmp_path, capsys):
    """ps_final.json says training ended at ts 30; the last evaluation is of ts 10: the
    table leaves final_error out and says why, and the result line says it plainly."""
    from rudra_zmq.results.compare import result_line

    a = make_run(
        tmp_path / "a",
        "quick",
        "softsync",
        1,
        "staleness",
        evals=[(1.0, 0, 0.0, 0.9), (3.0, 10, 1.0, 0.0472)],
        updates=[(1.0, 1, [0]), (3.0, 10, [1]), (6.0, 30, [1])],
    )
    (a / "ps_final.json").write_text(json.dumps({"timestamp": 30, "epoch": 3.0, "done": True}))
    assert cli.main(["compare", str(a), "-o", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[8] == "-"  # final_error
    assert out[2] == (
        "quick: final_error -: its final weights were never evaluated (the last "
        "evaluation, 4.72% at epoch 1.00, is not of them)"
    )
    line = result_line(a)
    assert line.startswith(
        "result: the final weights were not evaluated (see logs/stats.log); "
        "the last test error measured was 4.72% at epoch 1.00 (best 4.72%) "
        "after 3.00 epochs in 6.0 s of training"
    ), line
    # evaluated after all (from weights.npy): the usual line
    with open(a / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "type": "eval",
                    "t": 6.0,
                    "ts": 30,
                    "epoch": 3.0,
                    "test_error": 0.025,
                    "test_loss": 0.1,
                    "weights": "weights.npy",
                }
            )
            + "\n"
        )
    assert result_line(a).startswith(
        "result: test error 2.50% (best 2.50%) after 3.00 epochs in 6.0 s of training"
    )


def test_the_protocol_label_says_what_changes_it_during_the_run():
    from rudra_zmq.results.compare import protocol_name

    def sync(**kw):
        return {"sync": {"protocol": "async", "n": 1, **kw}}

    assert protocol_name(sync()) == "async"
    assert protocol_name(sync(schedule=["2 hardsync", "3 softsync 2"])) == (
        "async, then hardsync@2, then softsync n=2@3"
    )
    target = {"sync": {"protocol": "softsync", "n": 1, "target_staleness": 2.0}}
    assert protocol_name(target) == "softsync n=1, n for <σ>≈2"
    assert protocol_name(target, paper=True) == "1-softsync, n for <σ>≈2"
    assert protocol_name(sync(max_staleness=4)) == "async, σ≤4"
