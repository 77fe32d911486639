"""Where `rudra-zmq launch` puts each role (pure planning, no hosts needed), and a launch on
this host alone (`-H localhost:2`), which needs no ssh."""
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import free_port_range

from rudra_zmq import cluster_plan
from rudra_zmq.compare import run_summary
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.hostfile import parse_hosts_arg

ROOT = Path(__file__).resolve().parents[1]


def _place(overrides, hosts="a:2,b:2", **kw):
    cfg = load_config(None, overrides)
    return cluster_plan.place(cfg, parse_hosts_arg(hosts), create=False, **kw)


def test_learners_fill_each_hosts_slots_in_order_and_servers_go_first():
    cp = _place(["sync.learners=3"], "a:2,b:2")
    assert cp.placement == {"stats": "a", "data": "a", "ps": "a", "learner0": "a",
                            "learner1": "a", "learner2": "b"}
    assert (cp.learners_on("a"), cp.learners_on("b")) == (2, 1)
    assert cp.plan.endpoints == {"ps": "tcp://a:29500", "data": "tcp://a:29501",
                                 "stats": "tcp://a:29502"}
    assert cp.plan.bind("ps") == "tcp://0.0.0.0:29500"     # a name: every interface
    assert cp.host_names() == ["a", "b"]


def test_processes_of_several_learners_stay_whole_on_one_host():
    cp = _place(["sync.learners=4", "runtime.learners_per_process=2"], "a:3,b:2")
    assert cp.placement["learner0-1"] == "a" and cp.placement["learner2-3"] == "b"
    with pytest.raises(ConfigError, match="fit on no host"):
        _place(["sync.learners=4", "runtime.learners_per_process=3"], "a:2,b:2")


def test_too_few_slots_is_an_error_naming_both_counts():
    with pytest.raises(ConfigError, match=r"sync.learners=5 learners need 5 slots, and the "
                                          r"hosts give 4"):
        _place(["sync.learners=5"], "a:2,b:2")


def test_a_server_host_of_its_own_and_ip_addresses_bound_exactly():
    cp = _place(["sync.learners=2"], "10.0.0.2:2", server_host="10.0.0.1", port=7000)
    assert cp.placement["ps"] == "10.0.0.1" and cp.learners_on("10.0.0.1") == 0
    assert cp.plan.bind("stats") == "tcp://10.0.0.1:7002"
    assert cp.host_names() == ["10.0.0.1", "10.0.0.2"]
    v6 = _place(["sync.learners=1"], "[fd00::1]:1")
    assert v6.plan.endpoints["ps"] == "tcp://[fd00::1]:29500"


def test_adv_leaves_and_advstar_broadcast_sockets_sit_with_their_learners():
    cp = _place(["sync.learners=4", "sync.protocol=softsync", "architecture.kind=advstar",
                 "architecture.fanout=2",
                 "architecture.broadcast_fanout=1"], "a:1,b:3")
    assert cp.placement["node0"] == "a" and cp.placement["node1"] == "b"   # leaves 0,1 / 2,3
    assert [cp.placement[f"bcast{i}"] for i in range(3)] == ["a", "b", "b"]  # chain 0->1->2->3
    ports = [cp.plan.endpoints[k] for k in cp.plan.endpoints if cp.placement[k] == "b"]
    assert len(set(ports)) == len(ports)                                   # no port twice


def test_commands_start_in_order_with_the_config_first():
    cp = _place(["sync.learners=2", "architecture.kind=adv", "architecture.fanout=2"], "a:2")
    cmds = cluster_plan.commands(cp)
    assert [label for _, label, _, _ in cmds] == ["stats", "data", "ps", "node0",
                                                  "learner0", "learner1"]
    assert all(args[:2] == ["--config", str(cp.plan.run_dir / "config.yaml")]
               for _, _, _, args in cmds)


def test_a_bad_port_is_refused():
    with pytest.raises(ConfigError, match="--port 0"):
        _place([], "a:4", port=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_on_localhost_alone_needs_no_ssh(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "rudra_zmq", "launch",
                          str(ROOT / "configs" / "quickstart.yaml"), "-H", "localhost:2",
                          "--set", "sync.learners=2", "--set", "train.epochs=1",
                          "--port", str(free_port_range()), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "localhost:stats " in res.stdout and "localhost:learner1 " in res.stdout
    assert "ssh" not in (run / "processes.json").read_text()
    assert run_summary(run)["epochs"] >= 1.0

