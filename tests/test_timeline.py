"""The timeline (``rudra_zmq/timeline.py``): a Chrome/Perfetto trace of one run, recorded per
process, joined at the end. No sockets but the wire hooks' own messages; no timing asserted."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from rudra_zmq import timeline, wire
from rudra_zmq.benchmarks import cli as bench_cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_timeline_left():
    """Each test starts and ends with no timeline started."""
    timeline.stop()
    yield
    timeline.stop()


def load(path):
    with open(path) as f:
        return json.load(f)


def test_an_unstarted_timeline_records_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert timeline.current() is timeline.OFF and not timeline.current().enabled
    assert timeline.start_from_env("learner 0") is timeline.OFF
    timeline.mark("send", peer="server 0", bytes=10)
    timeline.sent("server 0", [b"header", np.zeros(4, np.float32)])
    with timeline.current().span("compute"):
        pass
    timeline.stop()
    assert list(tmp_path.iterdir()) == []


def test_a_started_timeline_writes_spans_marks_and_counters_as_a_chrome_trace(tmp_path):
    tl = timeline.start(tmp_path / "p.json", "learner 3")
    with tl.span("compute", step=1):
        pass
    timeline.mark("send", peer="parameter server 2", bytes=4096, at=1024)
    tl.counter("link host 1", timeline.now_us(), sent=1.0, received=2.0)
    timeline.stop()
    trace = load(tmp_path / "p.json")
    assert trace["otherData"] == {"process": "learner 3", "dropped": 0}
    events = trace["traceEvents"]
    assert events[0] == {
        "ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "learner 3"},
    }  # fmt: skip
    span, mark, counter = [e for e in events if e["ph"] != "M"]
    assert span["ph"] == "X" and span["name"] == "compute" and span["dur"] >= 0
    assert span["args"] == {"step": 1}
    assert (
        mark["ph"] == "i" and mark["cat"] == "wire" and mark["args"]["peer"] == "parameter server 2"
    )
    assert counter["ph"] == "C" and counter["args"] == {"sent": 1.0, "received": 2.0}
    assert span["ts"] <= mark["ts"] <= counter["ts"]
    assert timeline.current() is timeline.OFF  # stopped: the hooks are off again


def test_threads_record_at_once_each_under_its_own_name(tmp_path):
    tl = timeline.start(tmp_path / "p.json", "learners")

    def work(i):
        for _ in range(200):
            timeline.mark("send", peer=f"server {i}", bytes=1)

    threads = [threading.Thread(target=work, args=(i,), name=f"learner {i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()
    events = load(tmp_path / "p.json")["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    marks = [e for e in events if e["ph"] == "i"]
    assert len(marks) == 800
    assert sorted(names.values()) == [f"learner {i}" for i in range(4)]
    for e in marks:  # each thread's marks carry its own id
        assert names[e["tid"]] == f"learner {e['args']['peer'].split()[1]}"


def test_a_full_timeline_keeps_its_first_events_and_counts_the_dropped(tmp_path):
    tl = timeline.start(tmp_path / "p.json", "ps", capacity=10)
    for i in range(25):
        tl.instant("recv", n=i)
    timeline.stop()
    trace = load(tmp_path / "p.json")
    kept = [e["args"]["n"] for e in trace["traceEvents"] if e["ph"] == "i"]
    assert kept == list(range(10)) and trace["otherData"]["dropped"] == 15


def test_merge_joins_each_process_under_its_own_pid_from_time_zero_and_removes_the_parts(tmp_path):
    base = tmp_path / "run1"
    for name in ("ps0", "learners0"):
        tl = timeline.Timeline(f"{base}.{name}.1.part", name)
        tl.instant("send", bytes=8)
        tl.close()
    extra = [{"ph": "C", "name": "link host 0", "ts": timeline.now_us(), "pid": 0, "tid": 0,
              "args": {"sent Mbit/s": 1.0}}]  # fmt: skip
    parts = timeline.parts_of(base)
    assert [p.name for p in parts] == ["run1.learners0.1.part", "run1.ps0.1.part"]
    other = timeline.merge(tmp_path / "t.json", parts, extra)
    trace = load(tmp_path / "t.json")
    assert other["processes"] == ["learners0", "ps0"] and other["dropped"] == 0
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"
    }
    assert names == {1: "learners0", 2: "ps0"}
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] != "M") == 0
    assert timeline.parts_of(base) == []


def test_output_names_one_trace_per_run_and_its_png_beside_it(tmp_path):
    one = timeline.Output(tmp_path / "t.json")
    assert one.paths("base-hardsync") == (tmp_path / "t.json", tmp_path / "t.png")
    many = timeline.Output(tmp_path / "t.json", runs=2)
    assert many.paths("ddp") == (tmp_path / "t-ddp.json", tmp_path / "t-ddp.png")
    base = many.base()
    tl = timeline.Timeline(f"{base}.rank0.7.part", "rank0")
    tl.close()
    path, other = many.finish(base, "ddp")
    assert path == tmp_path / "t-ddp.json" and other["processes"] == ["rank0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-ddp.json"]  # parts folder gone


@pytest.mark.parametrize(
    "path, why",
    [
        ("{tmp}/no/such/folder/t.json", "does not exist"),
        ("{tmp}", "that is a folder"),
        ("/proc/t.json", "cannot write in /proc"),
    ],
)
def test_a_timeline_path_that_cannot_be_written_is_refused_saying_why(tmp_path, path, why):
    with pytest.raises(timeline.TimelinePathError, match=why):
        timeline.check_path(path.format(tmp=tmp_path))
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_lan_table1_refuses_an_unwritable_timeline_in_one_line_before_anything_starts(tmp_path):
    """No root or namespaces needed: the path is checked before the LAN is built."""
    bad = tmp_path / "missing" / "t.json"
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(["lan-table1", "--quick", "--timeline", str(bad)])
    text = str(exc.value)
    assert text == (
        f"rudra-zmq bench lan-table1: error: --timeline {bad}: the folder {bad.parent} "
        "does not exist"
    )


def test_the_wire_hooks_mark_each_message_sent_and_received_with_its_bytes(tmp_path):
    tl = timeline.start(tmp_path / "p.json", "learner 0")
    payload = np.arange(256, dtype=np.float32)
    frames = wire.encode(wire.Kind.PUSHPULL, 0, 5, 3, 0, [payload], at=256, more=True)
    timeline.sent("parameter server 1", frames)
    reply = wire.encode(wire.Kind.WEIGHTS, wire.SENDER_PS, 9, 4, 0, [payload], re=5, at=256)
    timeline.received("parameter server 1", wire.decode(reply, numel=512))
    tl.close()
    send, recv = [e for e in load(tmp_path / "p.json")["traceEvents"] if e["ph"] == "i"]
    assert send["name"] == "send" and send["args"] == {"peer": "parameter server 1", "bytes": 1024}
    assert recv["name"] == "recv" and recv["args"] == {
        "peer": "parameter server 1", "kind": "WEIGHTS", "bytes": 1024, "at": 256,
        "more": False, "ts": 4, "re": 5,
    }  # fmt: skip


# ----------------------------------------------------------------------------- rudra-zmq run
ROOT = Path(__file__).resolve().parents[1]


def rudra(*args, timeout):
    return subprocess.run(
        [sys.executable, "-m", "rudra_zmq", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_run_refuses_an_unwritable_timeline_with_one_line_and_starts_nothing(tmp_path):
    bad = tmp_path / "missing" / "t.json"
    res = rudra(
        "run", "configs/quickstart.yaml", "--run-dir", str(tmp_path / "r"), "--timeline", str(bad),
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"rudra-zmq: error: --timeline {bad}: the folder {bad.parent} does not exist"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "bad, said",
    [
        ("missing/t.json", "--timeline {bad}: the folder {parent} does not exist"),
        ("", "--timeline {bad}: "),  # a folder, not a file
    ],
)
def test_launch_refuses_an_unwritable_timeline_with_one_line_and_starts_nothing(
    tmp_path, bad, said
):
    bad = tmp_path / bad if bad else tmp_path
    res = rudra(
        "launch", "configs/quickstart.yaml", "-H", "127.0.0.1:1", "--run-dir",
        str(tmp_path / "r"), "--timeline", str(bad), timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "rudra-zmq: error: " + said.format(bad=bad, parent=bad.parent)
    ), res.stderr
    assert not (tmp_path / "r").exists() and res.stdout == ""


@pytest.mark.timeout(180)
def test_a_run_with_a_timeline_traces_each_learners_steps_and_every_message_per_server(tmp_path):
    trace_path = tmp_path / "t.json"
    res = rudra(
        "run", "configs/quickstart.yaml", "--run-dir", str(tmp_path / "r"),
        "--set", "train.epochs=1", "--set", "sync.learners=2", "--set", "train.eval_every_epochs=0",
        # hardsync: every update waits for both learners, so each has steps to trace (under
        # softsync a learner still importing torch on a loaded machine could make none)
        "--set", "sync.protocol=hardsync", "--timeline", str(trace_path), timeout=170,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"timeline: {trace_path} (" in res.stdout
    trace = load(trace_path)
    events = trace["traceEvents"]
    procs = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"learner", "ps", "data_server", "stats_server"} <= procs
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    computes = [e for e in events if e["ph"] == "X" and e["name"] == "compute"]
    assert len(steps) == len(computes) > 0
    assert {e["args"]["learner"] for e in steps} == {0, 1}
    pushes = [e for e in events if e["name"] == "send" and e["args"]["peer"] == "parameter server"]
    replies = [e for e in events if e["name"] == "recv" and e["args"]["peer"] == "parameter server"]
    assert len(pushes) >= len(steps) and replies
    assert {e["args"]["kind"] for e in replies} >= {"WELCOME", "WEIGHTS"}
    assert trace["otherData"]["dropped"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "t.json"]  # parts joined, gone
