"""What a real `rudra-zmq run` prints agrees with what it records: each progress line's ⟨σ⟩
and samples/s are those of the updates since the previous line (summary.csv, metrics.jsonl),
lines come in the order things happen, a resumed run counts only its training time, and a
finished run resumed with nothing to do starts nothing. Real processes, ~1-2 min on 2 cores."""

import csv
import json
import re

import pytest

from fault_runs import Run, records
from rudra_zmq.results.compare import run_summary
from rudra_zmq.stats.progress import duration

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

COMMON = ["runtime.timeout_s=60", "runtime.retry_s=1"]
MU = 16  # configs/quickstart.yaml's sync.batch_size
LINE = re.compile(
    r"^epoch +([\d.]+) +ts +(\d+) +test error +([\d.]+)% +loss \S+ +<σ> (\S+) +"
    r"samples/s (\S+) +elapsed (.+?) +ETA (.+)$"
)


def progress_lines(out):
    return [m.groups() for m in map(LINE.match, out.splitlines()) if m]


def expected_columns(updates, lines):
    """(⟨σ⟩, samples/s) each line should show, computed here from the update records: the
    updates since the previous line's ts; the rate over the time from the previous line's last
    update (the first update, for the first line) to this line's last update."""
    out, prev_ts, anchor = [], -1, None
    for _, ts, *_ in lines:
        ts = int(ts)
        mine = [u for u in updates if prev_ts < u["ts"] <= ts]
        sigmas = [s for u in mine for s in u["sigmas"]]
        sigma = f"{sum(sigmas) / len(sigmas):.2f}" if sigmas else "-"
        rate = "-"
        if mine:
            anchor = anchor or mine[0]
            last = max(mine, key=lambda u: u["t"])
            grads = sum(u["n_grads"] for u in mine if u["ts"] > anchor["ts"])
            if last["t"] > anchor["t"]:
                rate = f"{grads * MU / (last['t'] - anchor['t']):.0f}"
            anchor = last
        out.append((sigma, rate))
        prev_ts = ts
    return out


def test_progress_lines_agree_with_the_records_and_resumes_count_training_time_only(tmp_path):
    run = Run(tmp_path, "q", [*COMMON, "train.epochs=4"])
    assert run.finish() == 0, run.out
    out = run.out.splitlines()

    # in the order things happen: start-up (the PS listening, the learners started), then
    # training starts, then the evaluations
    first_epoch = next(i for i, line in enumerate(out) if line.startswith("epoch "))
    started = out.index(next(line for line in out if line.startswith("training started")))
    start_up = [i for i, line in enumerate(out) if line.startswith("start-up: ")]
    ps_up = [i for i in start_up if re.match(r"start-up: .*\bps\b.* listening", out[i])]
    assert ps_up and start_up[-1] < started < first_epoch, run.out
    assert "learner0" in out[start_up[-1]], run.out

    lines = progress_lines(run.out)
    summary = list(csv.DictReader((run.dir / "summary.csv").open()))
    assert [int(ts) for _, ts, *_ in lines] == [int(r["ts"]) for r in summary]
    for (_, ts, err, sigma, _, elapsed, _), row in zip(lines, summary):
        assert f"{100 * float(row['test_error']):.2f}" == err
        assert sigma == ("-" if row["mean_sigma"] == "" else f"{float(row['mean_sigma']):.2f}")
        assert elapsed == duration(float(row["wall_s"])), (ts, elapsed, row)
    updates = records(run.dir, "update")
    assert [(s, r) for _, _, _, s, r, _, _ in lines] == expected_columns(updates, lines)
    assert sum(r != "-" for _, _, _, _, r, _, _ in lines) >= len(lines) - 1

    # resumed with nothing to do: one line, nothing started
    processes = (run.dir / "processes.json").read_text()
    idle = Run(tmp_path, "q", [], resume=True)
    assert idle.finish() == 0, idle.out
    epoch = json.loads((run.dir / "ps_final.json").read_text())["epoch"]
    assert idle.out.strip() == (
        f"rudra-zmq: nothing to do: {run.dir} already trained "
        f"{epoch:.2f} epochs of train.epochs=4; to train on, resume "
        f"with --set train.epochs=N (N > {epoch:.2f})"
    )
    assert (run.dir / "processes.json").read_text() == processes
    assert records(run.dir, "resume") == []

    # resumed to train on: the gap between the runs and the new start-up are no training
    more = Run(tmp_path, "q", ["train.epochs=6"], resume=True)
    assert more.finish() == 0, more.out
    (resume,) = records(run.dir, "resume")
    trained = 0.0
    for part in (lambda t: t < resume["t"], lambda t: t >= resume["t"]):
        ups = [u["t"] for u in records(run.dir, "update") if part(u["t"])]
        ends = ups + [e["t"] for e in records(run.dir, "eval") if part(e["t"])]
        trained += max(ends) - min(ups)
    r = run_summary(run.dir)
    assert r["wall_s"] == pytest.approx(trained, abs=1e-6)
    assert r["s_per_epoch"] == pytest.approx(trained / r["epochs"])
    first_update = min(u["t"] for u in records(run.dir, "update"))
    last_eval = max(e["t"] for e in records(run.dir, "eval"))
    assert r["wall_s"] < last_eval - first_update - (
        resume["t"] - max(e["t"] for e in records(run.dir, "eval") if e["t"] < resume["t"])
    )
    assert (
        f"in {r['wall_s']:.1f} s of training (after {r['startup_s']:.1f} s of start-up "
        f"in 2 runs; {r['between_runs_s']:.1f} s between them left out)" in more.out
    )
    resumed_lines = progress_lines(more.out)
    last_row = list(csv.DictReader((run.dir / "summary.csv").open()))[-1]
    assert resumed_lines[-1][5] == duration(float(last_row["wall_s"]))
    assert float(last_row["wall_s"]) == pytest.approx(trained, abs=1e-6)
