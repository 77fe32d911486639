"""``rudra-zmq bench shm-leaf`` (issue #5): a leaf and its learners over ipc:// and shared memory.

Tiny sizes, run the way a user would (a subprocess): the output's structure, every round's sum
equal to the oracle both ways, and no shared-memory segment or learner process left behind,
also when the run is stopped with SIGTERM. The seqlock is tested directly against a writer
that publishes while a reader copies. No timing thresholds: the machine is shared.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cluster import gone
from rudra_zmq.benchmarks import shm_segment as shm

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]
BENCH = [sys.executable, "-m", "rudra_zmq", "bench", "shm-leaf"]


def learners_of(pid: int) -> list[int]:
    """Pids of the spawned children of ``pid`` (not multiprocessing's resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and spawned:
                out.append(int(entry))
    return out


def test_every_round_sums_to_the_oracle_both_ways_and_no_segment_is_left(tmp_path):
    # 10K is checked on every element, 70K (> FULL_CHECK_MAX) on a sample; k = 1 and 3
    proc = subprocess.Popen(
        [
            *BENCH,
            "--sizes",
            "10K",
            "70K",
            "--learners",
            "1",
            "3",
            "--rounds",
            "3",
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--chunk-mib",
            "0.1",
            "--pattern",
            "ramp",
            "--json",
            "--csv",
            str(tmp_path / "shm.csv"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=80)
    assert proc.returncode == 0, err[-3000:]
    assert shm.our_segments(proc.pid) == []
    records = [json.loads(line) for line in out.splitlines()]
    assert records[0]["type"] == "header" and records[-1]["type"] == "end"
    assert records[0]["nproc"] >= 1 and "build_info" in records[0]
    cases = [r for r in records if r["type"] == "case"]
    assert [(r["params"], r["learners"]) for r in cases] == [
        (10_000, 1),
        (10_000, 3),
        (70_000, 1),
        (70_000, 3),
    ]
    for r in cases:
        assert r["check_errors"] == 0 and r["version_errors"] == 0
        assert r["rounds_per_way"] == 3 * 2 and r["bytes"] == 4 * r["params"]
        for way in ("ipc", "shm"):
            assert 0 < r[f"{way}_ms"] <= r[f"{way}_p90_ms"]
            assert r[f"{way}_block_min_ms"] <= r[f"{way}_block_max_ms"]
            assert r[f"{way}_leaf_cpu_ms"] > 0 and r[f"{way}_learner_cpu_ms"] >= 0
        assert r["speedup"] == pytest.approx(r["ipc_ms"] / r["shm_ms"])
    with open(tmp_path / "shm.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["params"]), int(r["learners"]), r["way"]) for r in rows] == [
        (n, k, w) for n in (10_000, 70_000) for k in (1, 3) for w in ("ipc", "shm")
    ]


def test_sigterm_stops_the_learners_and_leaves_no_segment():
    proc = subprocess.Popen(
        [
            *BENCH,
            "--sizes",
            "100K",
            "--learners",
            "2",
            "--rounds",
            "1000000",
            "--repeat",
            "1",
            "--warmup",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(learners_of(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # well into the timed rounds
        learners = learners_of(proc.pid)
        assert len(learners) >= 2, "the learners did not start"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, proc.stderr.read()[-3000:]
    assert shm.our_segments(proc.pid) == []
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in learners) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in learners)


def test_seqlock_reader_never_keeps_a_half_written_buffer():
    n = 1 << 20
    seg = shm.Segment(
        f"{shm.PREFIX}_{os.getpid()}_seqlock_test", shm.VERSION_BYTES + 4 * n, create=True
    )
    try:
        lock = shm.Seqlock(seg, n)
        sources = [np.full(n, v, np.float32) for v in (1.0, 2.0)]
        lock.publish(sources[0])
        stop, torn, versions = threading.Event(), [], []

        def writer():  # publishes about as often as it takes to copy, as a busy leaf would
            i = 0
            while not stop.is_set():
                i += 1
                lock.publish(sources[i % 2])
                time.sleep(0.0005)

        t = threading.Thread(target=writer)
        t.start()
        dst = np.empty(n, np.float32)
        try:
            for _ in range(200):
                version, _ = lock.read_into(dst, timeout_s=10)
                versions.append(version)
                if dst.min() != dst.max():
                    torn.append(version)
        finally:
            stop.set()
            t.join(10)
        assert torn == []
        assert all(v % 2 == 0 for v in versions) and versions == sorted(versions)
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def test_checker_counts_a_misplaced_element_against_the_oracle():
    n = 1000
    pattern = shm.make_pattern("ramp", n)
    check = shm.Checker(n, pattern)
    acc = np.empty(n, np.float32)
    shm.write(acc, 7.0, pattern)
    acc += pattern  # 2 x pattern + 7: two learners' sum
    assert check(acc, 7.0, mult=2)
    acc[123] += 1
    assert not check(acc, 7.0, mult=2) and check.errors == 1


def test_segments_of_dead_runs_are_removed_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}_{dead.pid}_1_1_w")
    live = shm.Segment(f"{shm.PREFIX}_{os.getpid()}_live_test", 64, create=True)
    try:
        open(stale, "wb").close()
        removed = shm.remove_stale_segments()
        assert os.path.basename(stale) in removed and not os.path.exists(stale)
        assert os.path.exists(live.path)
    finally:
        live.close()
        if os.path.exists(stale):
            os.unlink(stale)
