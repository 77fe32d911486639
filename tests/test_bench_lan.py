"""The Rudra-adv / adv* benchmarks: ``bench root-ingress`` and ``bench lan-table1`` at tiny sizes.

Run the way a user would (subprocesses); check the output's structure and that the root's
counted bytes agree with the gradients it took (bytes = numel x 4 x gradient messages), with no
timing thresholds (the machine is shared). The emulated-LAN tests need root and ``ip netns``
and skip with the reason otherwise; they use namespaces with a prefix of their own and check
that nothing is left behind.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns_check import netns_missing
from rudra_zmq.benchmarks.synthetic_cluster import advstar_available

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
NETNS_SH = ROOT / "bench" / "lan" / "netns.sh"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench_cmd(name, *args):
    return [sys.executable, "-m", "rudra_zmq", "bench", name, *args]


def run_json(name, *args, timeout=100):
    """``rudra-zmq bench NAME ARGS --json``: (JSON records, its pid); fails the test on exit
    != 0."""
    proc = subprocess.Popen(
        bench_cmd(name, *args, "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(ln) for ln in out.splitlines()]
    assert records[0]["type"] == "header" and records[-1]["type"] == "end"
    assert records[0]["nproc"] >= 1 and len(records[0]["loadavg"]) == 3
    return records, proc.pid


def csv_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_root_ingress_counts_one_model_per_gradient_message_and_less_through_a_tree(tmp_path):
    archs = ["base", "adv"] + (["advstar"] if advstar_available() else [])
    recs, _ = run_json(
        "root-ingress",
        "--quick",
        "--archs",
        *archs,
        "--csv",
        str(tmp_path / "ri.csv"),
        "--png",
        str(tmp_path / "ri.png"),
    )
    cases = [r for r in recs if r["type"] == "case"]
    assert {(c["arch"], c["protocol"]) for c in cases} == {  # advstar has no hardsync
        (a, p) for a in archs for p in ("softsync", "hardsync") if (a, p) != ("advstar", "hardsync")
    }
    for c in cases:
        assert c["learners"] == 4 and c["params"] == c["numel"] == 10_000
        assert c["root_grad_bytes_total"] == c["numel"] * 4 * c["root_grad_msgs_total"]
        assert c["root_rx_bytes_total"] > c["root_grad_bytes_total"]  # headers too
        assert c["updates"] >= 2 and c["s_per_update"] > 0
        assert c["grads_per_update"] >= c["learners"]  # 1-softsync, hardsync
        assert c["root_rx_bytes_per_update"] >= c["root_grad_msgs_per_update"] * 40_000
        assert c["rss_sum_mib"] > 0 and c["processes"] == 1 + c["learners"] + (
            c["learners"] // c["fanout"] if c["arch"] != "base" else 0
        )
    by = {(c["arch"], c["protocol"]): c for c in cases}
    # base: one message per gradient; hardsync through leaves of 2: exactly one per leaf
    assert by["base", "hardsync"]["root_grad_msgs_per_update"] == 4
    assert by["base", "softsync"]["grads_per_root_msg"] == 1
    assert by["adv", "hardsync"]["root_grad_msgs_per_update"] == 2
    assert by["adv", "hardsync"]["ingress_per_update_vs_base"] > 1.5
    assert by["adv", "softsync"]["grads_per_root_msg"] >= 1
    if "advstar" in archs:  # the weights leave the root once per version, by the broadcast
        assert by["advstar", "softsync"]["root_bcast_bytes_per_update"] > 0
    assert len(csv_rows(tmp_path / "ri.csv")) == len(cases)
    assert (tmp_path / "ri.png").read_bytes()[:8] == PNG_MAGIC


def test_root_ingress_with_gathering_leaves_gets_whole_subtrees_under_softsync():
    """architecture.relay: gather — each relay carries its leaf's 2 learners, counted at the
    root: the root's ingress per gradient falls by exactly the fan-out factor."""
    archs = ["adv"] + (["advstar"] if advstar_available() else [])
    recs, _ = run_json(
        "root-ingress", "--quick", "--relay", "gather", "--protocols", "softsync", "--archs", *archs
    )
    cases = [r for r in recs if r["type"] == "case"]
    assert {c["arch"] for c in cases} == set(archs)
    for c in cases:
        assert c["relay"] == "gather" and c["fanout"] == 2
        assert c["grads_per_root_msg"] == 2
        assert c["root_grad_bytes_total"] == c["numel"] * 4 * c["root_grad_msgs_total"]


# ----------------------------------------------------------------------------- emulated LAN
_LAN_MISSING = netns_missing("tc")
needs_lan = pytest.mark.skipif(_LAN_MISSING is not None, reason=_LAN_MISSING or "")


def namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix + "-")]


def netns(*args, check=True):
    res = subprocess.run([str(NETNS_SH), *args], capture_output=True, text=True, timeout=60)
    assert not check or res.returncode == 0, res.stderr
    return res


@pytest.fixture
def lan_prefix():
    prefix = f"rzp{os.getpid() % 100000}"
    yield prefix
    netns("down", "--prefix", prefix, check=False)  # whatever the test left
    assert namespaces(prefix) == []


@needs_lan
def test_netns_up_builds_shaped_hosts_that_reach_each_other_and_down_removes_them(lan_prefix):
    out = netns("up", "2", "1gbit", "--prefix", lan_prefix).stdout.split("\n")
    hosts = [ln.split() for ln in out if ln.startswith("host ")]
    assert [(h[1], h[2], h[3]) for h in hosts] == [
        ("0", f"{lan_prefix}-h0", "10.77.0.1"),
        ("1", f"{lan_prefix}-h1", "10.77.0.2"),
    ]
    assert sorted(namespaces(lan_prefix)) == sorted(
        [f"{lan_prefix}-br", f"{lan_prefix}-h0", f"{lan_prefix}-h1"]
    )
    assert netns("up", "2", "--prefix", lan_prefix, check=False).returncode != 0  # already up
    for i in (0, 1):  # each host link is shaped both ways
        q = subprocess.run(
            ["tc", "-n", f"{lan_prefix}-h{i}", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in q and "rate 1Gbit" in q, q
        q = subprocess.run(
            ["tc", "-n", f"{lan_prefix}-br", "qdisc", "show", "dev", f"h{i}"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in q and "rate 1Gbit" in q, q
    if shutil.which("ping"):
        subprocess.run(
            ["ip", "netns", "exec", f"{lan_prefix}-h0", "ping", "-c", "1", "-W", "2", "10.77.0.2"],
            check=True,
            capture_output=True,
        )
    # one TCP transfer from host 0 to host 1 (4 MiB)
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            f"{lan_prefix}-h1",
            sys.executable,
            "-c",
            "import socket\ns = socket.socket(); s.bind(('10.77.0.2', 5301)); s.listen(1)\n"
            "print('ready', flush=True); c, _ = s.accept(); n = 0\n"
            "while (b := c.recv(1 << 16)): n += len(b)\nprint(n)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                f"{lan_prefix}-h0",
                sys.executable,
                "-c",
                "import socket\nc = socket.create_connection(('10.77.0.2', 5301), 10)\n"
                "c.sendall(b'x' * (4 << 20)); c.close()",
            ],
            check=True,
            timeout=30,
        )
        assert server.stdout.readline().strip() == str(4 << 20)
    finally:
        server.kill()
        server.wait()
    netns("down", "--prefix", lan_prefix)
    assert namespaces(lan_prefix) == []
    assert not Path(f"/run/rudra_zmq_lan/{lan_prefix}.ns").exists()
    netns("down", "--prefix", lan_prefix)  # idempotent


@needs_lan
def test_netns_up_that_fails_half_way_removes_what_it_built(lan_prefix):
    res = netns("up", "2", "notarate", "--prefix", lan_prefix, check=False)
    assert res.returncode != 0 and "removing what it built" in res.stderr
    assert namespaces(lan_prefix) == []
    assert not Path(f"/run/rudra_zmq_lan/{lan_prefix}.ns").exists()


@needs_lan
def test_table1_quick_reports_seconds_per_epoch_and_root_ingress_and_cleans_up(tmp_path):
    names = ["base-hardsync", "base-softsync", "adv-softsync"] + (
        ["advstar-softsync"] if advstar_available() else []
    )
    recs, pid = run_json(
        "lan-table1",
        "--quick",
        "--cases",
        *names,
        "--csv",
        str(tmp_path / "t1.csv"),
        "--png",
        str(tmp_path / "t1.png"),
    )
    cases = [r for r in recs if r["type"] == "case"]
    assert [c["case"] for c in cases] == names
    for c in cases:
        assert c["learners"] == 4 and c["hosts"] == 2 and len(c["epoch_s"]) == 2
        assert c["s_per_epoch"] > 0
        want = 2 * c["epoch_gradients"]
        if c["case"].startswith("base"):  # one gradient per message: training ends on the dot
            assert c["grads_total"] == want
        else:  # a relay sums gradients (each learner's at most once): the last one may carry
            assert want <= c["grads_total"] <= want - 1 + c["learners"]  # past the end
        assert c["root_grad_bytes_total"] == c["numel"] * 4 * c["root_grad_msgs_total"]
        assert c["root_rx_bytes_per_epoch"] >= c["numel"] * 4  # at least one model's worth
    assert cases[0]["mean_sigma"] == 0  # hardsync
    order = [r for r in recs if r["type"] == "note" and "order" in r]
    assert len(order) == 1 and set(order[0]["order"].split(" > ")) == {c["case"] for c in cases}
    assert len(csv_rows(tmp_path / "t1.csv")) == len(names)
    assert (tmp_path / "t1.png").read_bytes()[:8] == PNG_MAGIC
    assert namespaces(f"rzt{pid % 1_000_000}") == []


@needs_lan
def test_table1_interrupted_by_ctrl_c_leaves_no_namespace_or_process():
    proc = subprocess.Popen(
        bench_cmd("lan-table1", "--quick", "--epochs", "200", "--cases", "base-hardsync"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    prefix = f"rzt{proc.pid % 1_000_000}"
    pids = set()
    try:
        deadline = time.monotonic() + 60  # wait until learners run on both learner hosts
        while len(pids) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
            pids = {
                int(p)
                for ns in namespaces(prefix)
                for p in subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True
                ).stdout.split()
            }
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert namespaces(prefix) == []
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]  # PS and learners gone


@needs_lan
def test_a_round_slower_than_retry_s_adds_no_byte_at_the_root():
    """Issue 24 item 3 on the emulated LAN: hardsync, λ = 4 on a 20 Mbit/s link, 1 MB
    gradients (a round takes ~2 s) and runtime.retry_s = 0.2: the learners only ask (CHECK,
    a header) whether the root got their gradient, so the root takes each gradient's bytes
    once: λ·M per update. (Before, every learner sent its whole gradient again each 0.2 s.)"""
    recs, pid = run_json(
        "lan-table1",
        *("--hosts", "2", "--per-host", "2", "--params", "250000", "--rate", "20mbit"),
        *("--retry-s", "0.2", "--cases", "base-hardsync", "--epoch-gradients", "8"),
        *("--epochs", "2", "--compute-ms", "10"),
    )
    (case,) = [r for r in recs if r["type"] == "case"]
    assert case["retry_s"] == 0.2 and case["updates_per_epoch"] == 2
    assert min(case["epoch_s"]) / case["updates_per_epoch"] > 2 * 0.2  # rounds outlast retry_s
    m = case["numel"] * 4
    assert case["root_grad_msgs_total"] == case["grads_total"] == 16  # no gradient twice
    headers = case["root_rx_bytes_per_epoch"] - 8 * m  # CHECKs and request headers only
    assert 0 < headers < 8 * 1024, case
    # the row says so: the learners asked, nothing was sent again or lost
    assert case["checks"] > 0 and case["resent"] == case["duplicates"] == 0, case
    assert case["undelivered"] == case["late"] == case["rejoins"] == 0, case
    notes = [r["text"] for r in recs if r["type"] == "note"]
    assert any("order: not measured" in t for t in notes)  # one case: no order claimed
    assert not any("reproduced" in t for t in notes)
    assert namespaces(f"rzt{pid % 1_000_000}") == []


@needs_lan
def test_a_float16_wire_halves_the_bytes_at_the_root_side_by_side():
    """Issue 24 item 5 on the emulated LAN: the same hardsync case with float32 and float16
    on the wire, in one run: the root takes half the gradient bytes per gradient and sends
    half the weight bytes (speed: bench/RESULTS.md, not a test)."""
    recs, pid = run_json(
        "lan-table1",
        *("--hosts", "2", "--per-host", "2", "--params", "250000", "--rate", "20mbit"),
        *("--cases", "base-hardsync", "--epoch-gradients", "8", "--epochs", "2"),
        *("--compute-ms", "10", "--wire-dtypes", "float32", "float16"),
    )
    f4, f2 = [r for r in recs if r["type"] == "case"]
    assert (f4["case"], f2["case"]) == ("base-hardsync", "base-hardsync-f2")
    assert (f4["wire_dtype"], f2["wire_dtype"]) == ("float32", "float16")
    n = f4["numel"]
    assert f4["root_grad_bytes_total"] == n * 4 * f4["root_grad_msgs_total"]
    assert f2["root_grad_bytes_total"] == n * 2 * f2["root_grad_msgs_total"]
    assert f2["root_grad_msgs_total"] == f4["root_grad_msgs_total"] == 16
    ratio = f2["root_tx_bytes_per_epoch"] / f4["root_tx_bytes_per_epoch"]
    assert 0.45 < ratio < 0.55, (f2["root_tx_bytes_per_epoch"], f4["root_tx_bytes_per_epoch"])
    assert namespaces(f"rzt{pid % 1_000_000}") == []


@needs_lan
def test_table1_runs_the_gloo_allreduce_on_the_learner_hosts_beside_its_bound():
    """Issue 24 item 6's baseline: torch.distributed's ring allreduce (DDP's step; float16:
    its fp16 hook's) across the same namespaces, a row with its link bound like the PS's."""
    recs, pid = run_json(
        "lan-table1",
        "--quick",
        *("--cases", "base-hardsync", "gloo-allreduce", "--wire-dtypes", "float32", "float16"),
    )
    cases = {r["case"]: r for r in recs if r["type"] == "case"}
    assert sorted(cases) == [
        "base-hardsync",
        "base-hardsync-f2",
        "gloo-allreduce",
        "gloo-allreduce-f2",
    ]
    for name in ("gloo-allreduce", "gloo-allreduce-f2"):
        r = cases[name]
        assert len(r["epoch_s"]) == 2 and all(s > 0 for s in r["epoch_s"])
        # 2(λ-1)/λ of a model per link per step, plus the compute: 4 steps an epoch
        m = r["params"] * (4 if name == "gloo-allreduce" else 2) / 125e6
        want = 4 * (2 * 3 / 4 * m + r["compute_ms"] / 1000)
        assert r["bound_s_per_epoch"] == pytest.approx(want)
        assert r["of_bound"] == pytest.approx(want / r["s_per_epoch"])
    hs = cases["base-hardsync"]
    assert hs["bound_s_per_epoch"] == pytest.approx(4 * (2 * 4 * 40_000 / 125e6 + 0.005))
    assert namespaces(f"rzt{pid % 1_000_000}") == []


def test_a_bad_rate_stops_lan_table1_before_any_host_is_built():
    """The bound of each row needs the rate in bytes/s: a rate that is not a tc rate is an
    error up front, naming it, not after a case ran (no root or namespaces needed)."""
    from rudra_zmq.benchmarks.lan_link import parse_rate

    assert parse_rate("1gbit") == 125e6 and parse_rate("20mbit") == 2.5e6
    assert parse_rate("10mbps") == 10e6  # tc's bytes-per-second unit
    res = subprocess.run(
        bench_cmd("lan-table1", "--quick", "--rate", "fast"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert res.returncode != 0 and "--rate 'fast': give a positive tc rate" in res.stderr
    assert "netns" not in res.stdout


@needs_lan
def test_sharded_servers_beside_the_learners_and_on_extra_hosts_each_take_their_range():
    """Issue 24 items 1 and 6: hardsync with 2 sharded servers, on the learner hosts and on
    2 hosts of their own, beside the root alone, in one run: every gradient reaches the
    servers once, a range each (bytes = one model per gradient over the two), σ = 0, each row
    beside its link bound (speed: bench/RESULTS.md, not a test); Rudra-adv the same, through
    one tree per range."""
    recs, pid = run_json(
        "lan-table1",
        # one learner per host: the root-alone row would spread them over the extra hosts
        *("--hosts", "2", "--per-host", "1", "--params", "10000", "--rate", "100mbit"),
        *("--cases", "base-hardsync", "adv-softsync", "--epoch-gradients", "8", "--epochs", "2"),
        *("--compute-ms", "5", "--servers", "1", "2"),
        *("--server-placement", "colocated", "extra"),
    )
    rows = [r for r in recs if r["type"] == "case"]
    assert [r["case"] for r in rows] == [
        "base-hardsync",
        "base-hardsync-k2-colocated",
        "base-hardsync-k2-extra",
        "adv-softsync",
        "adv-softsync-k2-colocated",
        "adv-softsync-k2-extra",
    ]
    for r in rows[4:]:  # Rudra-adv, one tree per range: each server hears its leaves' sums
        assert r["servers"] == 2 and r["server_numel"] == [5000, 5000]
        assert r["grads_total"] >= 16 and r["mean_sigma"] > 0  # 1-softsync: stale ones
    for r in rows[1:3]:
        assert r["servers"] == 2 and r["server_numel"] == [5000, 5000]
        assert r["grads_total"] == 16 and r["updates_per_epoch"] == 4 and r["mean_sigma"] == 0
        per_grad = r["root_rx_bytes_per_gradient"]  # payloads + two headers per gradient
        assert 10000 * 4 <= per_grad < 10000 * 4 + 1000, per_grad
        # the PNG's ingress panel: the busiest server's half, not the two servers' sum
        assert r["busiest_rx_bytes_per_epoch"] == pytest.approx(r["root_rx_bytes_per_epoch"] / 2)
        assert r["bound_s_per_epoch"] > 0 and r["of_bound"] > 0
    (order,) = [r["order"] for r in recs if r["type"] == "note" and "order" in r]
    assert sorted(order.split(" > ")) == ["adv-softsync", "base-hardsync"]  # K = 1 rows only
    assert namespaces(f"rzt{pid % 1_000_000}") == []


def test_a_case_row_sums_what_went_slow_or_was_lost_and_its_line_names_only_what_happened():
    from rudra_zmq.benchmarks.lan_link import retries, retries_text

    servers = [{"undelivered": 1, "duplicates": 0}, {"undelivered": 2, "duplicates": 3}]
    learners = [
        {
            "learners": [
                {"checks": 4, "resent": 0, "late": 0},
                {"checks": 1, "resent": 1, "late": 0},
            ]
        },
        {"learners": [{"checks": 0, "resent": 0, "late": 2, "rejoins": 1}]},
    ]
    r = retries(servers, learners)
    assert r == {
        "undelivered": 3, "duplicates": 3, "checks": 5, "resent": 1, "late": 2, "rejoins": 1
    }  # fmt: skip
    assert retries_text(r) == (
        "  [undelivered 3, duplicates 3, checks 5, resent 1, late 2, rejoins 1]"
    )
    assert retries_text(retries([{}], [{"learners": [{}]}])) == ""


def test_a_case_may_run_ten_times_its_link_bound_before_it_is_called_hung():
    from rudra_zmq.benchmarks.lan_link import deadline_s

    assert deadline_s(None, 3) == 600  # no bound stated: the old fixed limit
    assert deadline_s(2.0, 3) == 600  # short runs keep it
    assert deadline_s(22.6, 30) == 6780  # 30 epochs of one server in parts: no false "hung"


@needs_lan
def test_table1_timeline_traces_every_part_each_link_and_real_ddp_beside(tmp_path):
    """Issue 42 items 4 and 5: ``--timeline`` writes one trace and one PNG per case; the
    PS case's trace has each learner's compute spans, every part pushed and received per
    peer and each host link's counters; ``ddp`` (DistributedDataParallel on the synthetic
    model of sleeping layers) runs on the same hosts with each bucket's allreduce traced.
    Each row says how busy the links were and how idle the CPU, over its timed epochs."""
    recs, pid = run_json(
        "lan-table1",
        "--quick",
        *("--cases", "base-hardsync", "ddp", "--parts", "2"),
        *("--timeline", str(tmp_path / "t.json")),
        timeout=110,
    )
    cases = {r["case"]: r for r in recs if r["type"] == "case"}
    assert sorted(cases) == ["base-hardsync-p2", "ddp"]
    traces = {}
    for name, r in cases.items():
        assert r["timeline"] == str(tmp_path / f"t-{name}.json")
        assert Path(r["timeline_png"]).read_bytes()[:8] == PNG_MAGIC
        assert r["timeline_dropped"] == 0
        assert 0 <= r["learner_links_sent"] <= 1.2 and 0 <= r["learner_links_received"] <= 1.2
        assert len(r["link_busy"]) == 3  # the root's host and 2 learner hosts
        assert "cpu_idle" in r  # None where the timed epochs were too short to tell
        traces[name] = json.loads(Path(r["timeline"]).read_text())["traceEvents"]
        procs = {e["args"]["name"] for e in traces[name] if e.get("name") == "process_name"}
        assert "links" in procs
        assert any(e["ph"] == "C" and e["name"] == "link host 1" for e in traces[name])
    ps = traces["base-hardsync-p2"]
    part_bytes = 10_000 // 2 * 4
    pushed = [  # the learners' sends with a payload (the server's are to "learner N")
        e
        for e in ps
        if e["ph"] == "i"
        and e["name"] == "send"
        and e["args"]["peer"] == "parameter server"
        and e["args"]["bytes"]
    ]
    assert {e["args"]["bytes"] for e in pushed} == {part_bytes}
    taken = [
        e
        for e in ps
        if e["ph"] == "i" and e["name"] == "recv" and e["args"].get("kind") == "PUSHPULL"
    ]
    steps = cases["base-hardsync-p2"]["grads_total"]  # one per learner step
    assert len(pushed) == len(taken) == 2 * steps  # every part, marked at both ends
    assert {e["args"]["peer"] for e in taken} == {f"learner {i}" for i in range(4)}
    assert len([e for e in ps if e["ph"] == "X" and e["name"] == "compute"]) == steps
    ddp = traces["ddp"]
    assert {e["args"]["bucket"] for e in ddp if e["name"] == "allreduce"}
    assert {e["name"] for e in ddp if e["ph"] == "X"} >= {"forward", "backward", "optimizer"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t-base-hardsync-p2.json", "t-base-hardsync-p2.png", "t-ddp.json", "t-ddp.png",
    ]  # fmt: skip
    assert namespaces(f"rzt{pid % 1_000_000}") == []


def test_parts_lower_the_hardsync_bound_only_where_pushes_and_replies_use_different_directions():
    """A server on a host of its own takes the pushes in and sends the replies out, so parts
    overlap them: M(1 + 1/P). A server beside a learner sends its replies out of the link its
    learner pushes out of: that direction carries both, 2(λ-1)/λ·M, with or without parts."""
    from types import SimpleNamespace

    from rudra_zmq.benchmarks.lan_shards import bound_s_per_epoch, link_phases

    assert link_phases(8, 1, 8, "extra") == (1.0, 1.0, 1.0)
    assert link_phases(8, 1, 8, "colocated") == (0.875, 0.875, 1.75)
    assert link_phases(8, 1, 4, "colocated") == (1.75, 1.75, 2.5)  # 7 learners into M/4
    a = SimpleNamespace(hosts=8, per_host=1, params=10_000_000, rate="250mbit", compute_ms=100,
                        epoch_gradients=8)  # fmt: skip
    m = 40e6 / 31.25e6  # one float32 model through a 250 Mbit/s link, s

    def bound(placement, parts):
        return bound_s_per_epoch("base-hardsync", a, 8, placement, "float32", parts)

    assert bound("extra", 1) == pytest.approx(2 * m + 0.1)
    assert bound("extra", 16) == pytest.approx(m * 17 / 16 + 0.1)
    assert bound("colocated", 1) == bound("colocated", 16) == pytest.approx(1.75 * m + 0.1)


@pytest.mark.timeout(400)
def test_table1_runs_the_products_learner_on_the_ddp_module_k1_and_k2_beside_real_ddp():
    """Issue 42 item 5: ``--learner product`` trains the very module real DDP runs (the
    synthetic model of sleeping layers, given to every role as a user model) with the
    product's learner (``learner/learner.py``: its data server, its exchange and backward
    hooks), with the root alone in 2 parts and with 2 servers on hosts of their own, beside
    DDP in one run: every gradient reaches the servers once (σ = 0), every message of every
    step leaves from inside backward, each row beside its bound and the CPU's idle share."""
    recs, pid = run_json(
        "lan-table1",
        *("--hosts", "2", "--per-host", "1", "--params", "20000", "--layers", "4"),
        *("--rate", "100mbit", "--cases", "base-hardsync", "ddp", "--learner", "product"),
        *("--epoch-gradients", "4", "--epochs", "2", "--compute-ms", "30"),
        *("--servers", "1", "2", "--server-placement", "extra", "--parts", "2"),
        timeout=380,
    )
    rows = {r["case"]: r for r in recs if r["type"] == "case"}
    assert list(rows) == ["base-hardsync-p2-product", "base-hardsync-k2-extra-p2-product", "ddp"]
    for name, k in (("base-hardsync-p2-product", 1), ("base-hardsync-k2-extra-p2-product", 2)):
        r = rows[name]
        assert r["grads_total"] == 8 and r["mean_sigma"] == 0, r
        assert sum(r["server_numel"] if k > 1 else [r["numel"]]) == 20000
        # 4 steps of 2 learners, each step k servers x 2 parts, all from inside backward
        assert r["streamed"] and r["sent_after_backward"] == 0
        assert r["sent_during_backward"] >= 2 * 4 * k * 2
        assert r["bound_s_per_epoch"] > 0 and "cpu_idle" in r  # None: an epoch too short to sample
    assert rows["ddp"]["bound_s_per_epoch"] > 0
    assert namespaces(f"rzt{pid % 1_000_000}") == []
