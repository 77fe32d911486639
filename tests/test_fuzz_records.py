"""Damaged records handed back to ``replay``, ``run --resume``, ``report`` and ``compare`` are
refused in one line that names the file, the record and the field, with the documented exit
code (2), never a traceback: a seeded fuzzer (``record_fuzz``) over a real small run's files
(one server, and two), and the case that was reported (an arrivals event with step -7)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import record_fuzz
from fault_runs import ROOT
from rudra_zmq.server import arrival_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CASES = 3000  # 750 per command: about 35 s here
SHARDED_CASES = 1200  # 400 per command (resume, report, compare)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real run of the quickstart model (every role a thread, as ``rudra-zmq run`` plans
    it), with its checkpoint, arrivals log and metrics, and a sweep's point.json for it."""
    from inproc import run_in_threads

    tmp = tmp_path_factory.mktemp("records")
    run_dir, _ = run_in_threads(
        ROOT / "configs/quickstart.yaml",
        ["train.epochs=1", "sync.learners=2", "runtime.retry_s=1"],
        tmp / "run",
    )
    return record_fuzz.prepare(run_dir, tmp / "fuzzed")


def test_every_damaged_record_is_refused_in_one_line_or_read_never_a_traceback(real_run):
    counts, bad = record_fuzz.fuzz(real_run, CASES, seed=45)
    shown = "\n".join(f"{t}: {what}\n{detail}" for t, what, detail in bad[:5])
    assert not bad, "\n".join(record_fuzz.summary(counts)) + "\n" + shown
    for target in record_fuzz.TARGETS:  # the fuzzer reached every command, both ways
        assert counts[target, "refused"] > 0 and counts[target, "ok"] > 0, counts


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A real run of the quickstart model with two servers (``rudra-zmq run``): range
    checkpoints, each server's ``ps_final.json`` and the run's joined one."""
    tmp = tmp_path_factory.mktemp("sharded")
    overrides = ["train.epochs=1", "sync.learners=2", "runtime.retry_s=1"]
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs/quickstart.yaml")]
        + ["--run-dir", str(tmp / "run"), "--set", "architecture.servers=2"]
        + [a for o in overrides for a in ("--set", o)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return record_fuzz.prepare(tmp / "run", tmp / "fuzzed")


def test_every_damaged_record_of_a_sharded_run_is_refused_in_one_line_or_read(sharded_run):
    """The same for resume, report and compare over a run of two servers (replay takes runs
    of one): its range checkpoints, its servers' ps_final.json, the joined one removed."""
    targets = ("resume", "report", "compare")
    counts, bad = record_fuzz.fuzz(sharded_run, SHARDED_CASES, seed=46, targets=targets)
    shown = "\n".join(f"{t}: {what}\n{detail}" for t, what, detail in bad[:5])
    assert not bad, "\n".join(record_fuzz.summary(counts)) + "\n" + shown
    for target in targets:
        assert counts[target, "refused"] > 0 and counts[target, "ok"] > 0, counts


def test_an_arrivals_event_with_step_minus_7_is_refused_by_replay_in_one_line(real_run, tmp_path):
    run = tmp_path / "run"
    record_fuzz.prepare(real_run, run)
    events = arrival_log.read(run).copy()
    third = np.flatnonzero(events["kind"] == arrival_log.GRADIENT)[3]
    events["step"][third] = -7
    data = (run / "arrivals.bin").read_bytes()
    (run / "arrivals.bin").write_bytes(data[: arrival_log.HEADER.size] + events.tobytes())
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "replay", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2, out.stdout + out.stderr  # 1 would say "the weights differ"
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"arrivals.bin event {third} (a gradient" in out.stderr and "step is -7" in out.stderr


def test_a_nan_in_a_metrics_record_is_refused_by_compare_and_report_naming_the_line(
    real_run, tmp_path
):
    run = tmp_path / "run"
    record_fuzz.prepare(real_run, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"type":"eval"' in line)
    lines[at] = lines[at].replace('"test_error":', '"test_error":NaN,"was":', 1)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for command in (["compare", str(run), "-o", str(tmp_path / "c.png")], ["report", str(run)]):
        out = subprocess.run(
            [sys.executable, "-m", "rudra_zmq", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 2, out.stdout + out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"metrics.jsonl line {at + 1} (an eval record): test_error is NaN" in out.stderr
