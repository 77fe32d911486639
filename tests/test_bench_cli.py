"""``rudra-zmq bench``: every command at a tiny size, run the way a user would (a subprocess).

Each test checks the output's structure, that the figures are positive and consistent with
each other (bytes = size x count, bandwidth = bytes / time, ...), and that --csv, --png and
--json are written. No timing thresholds: the machine is shared.
"""

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rudra_zmq import kernels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # hang guards, not timings
QUICK = ["--seconds", "0.05", "--warmup", "0.02", "--repeat", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args, timeout=200):
    """``python -m rudra_zmq bench ARGS``; returns stdout (fails the test on exit != 0)."""
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def bench_json(tmp_path, *args):
    """Run with --json --csv --png; return (case records, csv rows) after checking the files."""
    out = bench(
        *args, "--json", "--csv", str(tmp_path / "out.csv"), "--png", str(tmp_path / "out.png")
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert records[0]["type"] == "header" and records[-1]["type"] == "end"
    assert records[0]["nproc"] >= 1 and len(records[0]["loadavg"]) == 3
    cases = [r for r in records if r["type"] == "case"]
    assert (tmp_path / "out.png").read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "out.csv") as f:
        rows = list(csv.DictReader(f))
    return cases, rows


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel)


def test_thr_prints_libzmq_figures_with_bytes_equal_to_size_times_count(tmp_path):
    out = bench(
        "thr",
        "--sizes",
        "64",
        "64Ki",
        "--transports",
        "tcp",
        "inproc",
        *QUICK,
        "--count",
        "50",
        "--csv",
        str(tmp_path / "thr.csv"),
    )
    lines = [ln for ln in out.splitlines() if ln.startswith("thr ")]
    assert len(lines) == 2 * 2 * 2  # transports x modes x sizes
    pattern = re.compile(
        r"thr (tcp|inproc) +(copy|zerocopy) +message size: (\d+) \[B\] "
        r"message count: (\d+) mean throughput: (\d+) \[msg/s\] "
        r"mean throughput: ([\d.]+) \[Mb/s\]"
    )
    for ln in lines:
        m = pattern.match(ln)
        assert m, ln
        size, count, msgs, mbit = int(m[3]), int(m[4]), int(m[5]), float(m[6])
        assert size in (64, 65536) and count == 50 and msgs > 0
        assert close(mbit, msgs * size * 8 / 1e6, rel=1e-3)  # libzmq's formula
    with open(tmp_path / "thr.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines)
    for r in rows:
        assert int(r["bytes"]) == int(r["size"]) * int(r["count"])
        assert 0 < float(r["mbit_min"]) <= float(r["mbit_per_s"]) <= float(r["mbit_max"])
        assert close(float(r["us_per_msg"]), 1e6 / float(r["msg_per_s"]))


def test_lat_reports_one_way_latency_percentiles_for_each_transport_and_mode(tmp_path):
    cases, rows = bench_json(
        tmp_path,
        "lat",
        "--sizes",
        "64",
        "4Ki",
        "--transports",
        "tcp",
        "ipc",
        *QUICK,
        "--count",
        "50",
    )  # fixed: same work under any load
    assert {(c["transport"], c["mode"], c["size"]) for c in cases} == {
        (t, m, s) for t in ("tcp", "ipc") for m in ("copy", "zerocopy") for s in (64, 4096)
    }
    for c in cases:
        assert c["bytes"] == c["size"] * c["count"] and c["count"] == 50
        assert 0 < c["latency_min_us"] <= c["latency_us"] <= c["latency_max_us"]
        assert 0 < c["p50_us"] <= c["p99_us"]
        assert close(c["mb_per_s"], c["size"] / c["latency_us"])
        assert type(c["resent"]) is int and c["resent"] >= 0  # asked again after 1 s unanswered
    assert len(rows) == len(cases)


def test_pushpull_moves_size_times_count_bytes_in_every_ps_lite_mode(tmp_path):
    cases, rows = bench_json(
        tmp_path,
        "pushpull",
        "--sizes",
        "2K",
        "--learners",
        "2",
        "--mode",
        "push_then_pull",
        "pushpull",
        "push",
        "pull",
        *QUICK,
    )
    assert [c["mode"] for c in cases] == ["push_then_pull", "pushpull", "push", "pull"]
    per_op = {"push_then_pull": 2, "pushpull": 2, "push": 1, "pull": 1}
    for c in cases:
        assert c["params"] == 2000 and c["size"] == 8000 and c["learners"] == 2
        assert c["bytes_per_op"] == per_op[c["mode"]] * c["size"]
        # async: every push is an update, so every pull is answered with the weights
        assert c["bytes"] == c["bytes_per_op"] * c["ops"] and c["ops"] % 2 == 0
        assert c["raw_bytes"] == c["bytes_per_op"] * c["raw_ops"]
        assert c["echo_bytes"] == c["bytes_per_op"] * c["echo_ops"]
        for side in ("ps", "echo", "raw"):
            assert 0 < c[f"{side}_gbps_min"] <= c[f"{side}_gbps"] <= c[f"{side}_gbps_max"]
            assert 0 < c[f"{side}_p50_us"] <= c[f"{side}_p99_us"]
            for who in ("server", "client"):  # per-op costs: counted, never negative
                assert c[f"{side}_{who}_cpu_us"] >= 0 and c[f"{side}_{who}_faults"] >= 0
        assert close(c["time_ratio"], c["ps_p50_us"] / c["raw_p50_us"])
        assert close(c["goodput_ratio"], c["ps_gbps"] / c["raw_gbps"])
        assert close(c["ps_echo_ratio"], c["ps_p50_us"] / c["echo_p50_us"])
        assert close(c["echo_raw_ratio"], c["echo_p50_us"] / c["raw_p50_us"])
        if c["mode"] == "pull":
            assert c["updates"] == 0 and c["updates_per_s"] == 0
        else:  # async: one update per push (the PS's own count)
            assert c["updates"] == c["ops"]
            assert close(c["updates_per_s"] / c["updates"], c["ps_ops_per_s"] / c["ops"])
    assert len(rows) == 4


def test_pushpull_hardsync_through_a_tree_takes_one_update_per_step_of_all_learners(tmp_path):
    cases, _ = bench_json(
        tmp_path,
        "pushpull",
        "--sizes",
        "1K",
        "--learners",
        "2",
        "--protocol",
        "hardsync",
        "--arch",
        "adv",
        "--fanout",
        "2",
        "--mode",
        "pushpull",
        *QUICK,
    )
    (c,) = cases
    assert c["arch"] == "adv" and c["protocol"] == "hardsync"
    assert c["bytes"] == c["bytes_per_op"] * c["ops"]
    assert c["updates"] * 2 == c["ops"]  # one update per step of all λ = 2 learners


def test_pushpull_refuses_push_only_under_hardsync_saying_why():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "bench",
            "pushpull",
            "--mode",
            "push",
            "--protocol",
            "hardsync",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode != 0
    assert "push-only under hardsync" in res.stderr and "Traceback" not in res.stderr


def test_a_negative_count_is_refused_naming_it_before_anything_runs():
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "bench", "lat", "--count", "-5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and res.stdout == ""  # not even the header
    assert "--count must be >= 0" in res.stderr and "got -5" in res.stderr
    assert "Traceback" not in res.stderr


def test_allreduce_reports_nccl_tests_bandwidths_beside_the_ps_hardsync_step(tmp_path):
    cases, rows = bench_json(tmp_path, "allreduce", "--nprocs", "2", "--sizes", "1K", *QUICK)
    (c,) = cases
    assert c["nprocs"] == 2 and c["size"] == 4000
    assert c["bytes"] == c["size"] * c["count"]
    assert 0 < c["time_min_us"] <= c["time_us"] <= c["time_max_us"]
    assert close(c["algbw_gbs"], c["size"] / (c["time_us"] * 1e-6) / 1e9)
    assert close(c["busbw_gbs"], c["algbw_gbs"] * 2 * (2 - 1) / 2)
    assert c["ps_step_us"] > 0 and c["ps_steps"] > 0
    assert close(c["gloo_over_ps"], c["time_us"] / c["ps_step_us"])
    assert len(rows) == 1


def test_kernels_benchmark_reports_bytes_and_bandwidth_of_every_implementation(tmp_path):
    cases, rows = bench_json(
        tmp_path,
        "kernels",
        "--sizes",
        "10K",
        "--threads",
        "1",
        "--kernels",
        "sgd_momentum_step",
        "accumulate",
        "--seconds",
        "0.05",
    )
    assert [c["kernel"] for c in cases] == ["sgd_momentum_step", "accumulate"]
    variants = kernels.available_variants()
    for c in cases:
        assert c["bytes"] == {"sgd_momentum_step": 5, "accumulate": 3}[c["kernel"]] * 4 * c["n"]
        assert c["default_variant"] == kernels.VARIANT
        for impl, ms in c["median_ms"].items():
            assert ms > 0 and close(c["gb_per_s"][impl], c["bytes"] / (ms * 1e-3) / 1e9)
        for v in variants:  # a variant's ratio is the floor's time over its own
            assert close(c["ratio"][v], c["floor_ms"] / c["median_ms"][v])
        assert close(c["ratio"]["numpy"], c["median_ms"]["numpy"] / c["median_ms"][kernels.VARIANT])
    assert {r["impl"] for r in rows} == {*variants, "numpy", "torch", "torch fused"}


def test_kernel_timing_rounds_vary_which_implementation_runs_before_which():
    # in a rotation of one order (A B C, B C A, ...) B always followed A within a round, and
    # what the call before leaves in the cache counts (issue 43): each implementation must
    # follow more than one other, and every round must run each once
    from rudra_zmq.benchmarks.kernels import time_round_robin

    log = []
    names = ["a", "b", "c", "d"]
    calls = {n: (log.append, n) for n in names}
    res, reps = time_round_robin(calls, reps=40, seconds=0, warmup=1)
    assert reps == 40 and set(res) == set(names)
    rounds = [log[len(names) + i * 4 : len(names) + i * 4 + 4] for i in range(reps)]
    assert all(sorted(r) == names for r in rounds)
    for n in names:
        before = {r[r.index(n) - 1] for r in rounds if r.index(n) > 0}
        assert len(before) == len(names) - 1, (n, before)


def test_kernel_timing_seed_sets_the_rounds_order_so_repeats_can_differ():
    # repeats of one comparison (--seed 1, 2, ...) must not replay one finite order
    from rudra_zmq.benchmarks.kernels import time_round_robin

    def order(seed):
        log = []
        calls = {n: (log.append, n) for n in "abcd"}
        time_round_robin(calls, reps=10, seconds=0, warmup=1, seed=seed)
        return log

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_a_bind_side_serves_a_connect_side_like_two_hosts(tmp_path):
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "bench",
            "lat",
            "--bind",
            "tcp://127.0.0.1:0",
            "--idle-timeout",
            "30",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert "lat server listening on tcp://127.0.0.1:" in line
        endpoint = line.rsplit(" ", 1)[1].strip()
        for _ in range(2):  # the bind side keeps serving until told to quit or idle
            out = bench("lat", "--connect", endpoint, "--sizes", "256", "--modes", "copy", *QUICK)
            assert re.search(
                r"^lat tcp +copy +message size: 256 \[B\] roundtrip count: \d+ "
                r"average latency: [\d.]+ \[us\]",
                out,
                re.M,
            )
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(10)
        server.stdout.close()


def test_quick_sets_only_the_options_the_command_line_did_not_give():
    import argparse

    from rudra_zmq.benchmarks.common import resolve_quick

    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int)
    p.add_argument("--params", type=int)
    p.add_argument("--quick", action="store_true")
    defaults, quick = {"epochs": 20, "params": 1000}, {"epochs": 2, "params": 10}

    def parse(*argv):
        return vars(resolve_quick(p.parse_args(argv), defaults, quick))

    assert parse("--quick", "--epochs", "200") == {"epochs": 200, "params": 10, "quick": True}
    # = the default, but given: kept
    assert parse("--quick", "--epochs", "20") == {"epochs": 20, "params": 10, "quick": True}
    assert parse("--epochs", "5") == {"epochs": 5, "params": 1000, "quick": False}


def test_bench_help_lists_every_benchmark_and_each_has_its_own_help(capsys):
    from rudra_zmq.benchmarks.cli import COMMANDS
    from rudra_zmq.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "--help"])
    assert exit_.value.code == 0
    listing = capsys.readouterr().out
    for name in COMMANDS:
        assert re.search(rf"^    {re.escape(name)}\b", listing, re.M), name
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["bench", name, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: rudra-zmq bench {name} ") and "rudra-zmq bench" in text
    # one home: no Python benchmark code left outside the package
    bench_dir = ROOT / "bench"
    assert sorted(p.relative_to(bench_dir).as_posix() for p in bench_dir.rglob("*.py")) == []
