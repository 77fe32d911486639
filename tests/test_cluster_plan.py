"""Where `rudra-zmq launch` puts each role (pure planning, no hosts needed), and a launch on
this host alone (`-H localhost:2`), which needs no ssh."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import free_port_range
from rudra_zmq import cli
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.launch import cluster_plan
from rudra_zmq.launch.hostfile import parse_hosts_arg
from rudra_zmq.results.compare import run_summary

ROOT = Path(__file__).resolve().parents[1]


def _place(overrides, hosts="a:2,b:2", **kw):
    cfg = load_config(None, overrides)
    return cluster_plan.place(cfg, parse_hosts_arg(hosts), create=False, **kw)


def test_learners_fill_each_hosts_slots_in_order_and_servers_go_first():
    cp = _place(["sync.learners=3"], "a:2,b:2")
    assert cp.placement == {
        "stats": "a",
        "data": "a",
        "ps": "a",
        "learner0": "a",
        "learner1": "a",
        "learner2": "b",
    }
    assert (cp.learners_on("a"), cp.learners_on("b")) == (2, 1)
    assert cp.plan.endpoints == {
        "ps": "tcp://a:29500",
        "data": "tcp://a:29501",
        "stats": "tcp://a:29502",
    }
    assert cp.plan.bind("ps") == "tcp://0.0.0.0:29500"  # a name: every interface
    assert cp.host_names() == ["a", "b"]


def test_processes_of_several_learners_stay_whole_on_one_host():
    cp = _place(["sync.learners=4", "runtime.learners_per_process=2"], "a:3,b:2")
    assert cp.placement["learner0-1"] == "a" and cp.placement["learner2-3"] == "b"
    with pytest.raises(ConfigError, match="fit on no host"):
        _place(["sync.learners=4", "runtime.learners_per_process=3"], "a:2,b:2")


def test_too_few_slots_is_an_error_naming_both_counts():
    with pytest.raises(
        ConfigError,
        match=r"sync.learners=5 learners need 5 slots, and the "
        r"hosts give 4",
    ):
        _place(["sync.learners=5"], "a:2,b:2")


def test_a_server_host_of_its_own_and_ip_addresses_bound_exactly():
    cp = _place(["sync.learners=2"], "10.0.0.2:2", server_host="10.0.0.1", port=7000)
    assert cp.placement["ps"] == "10.0.0.1" and cp.learners_on("10.0.0.1") == 0
    assert cp.plan.bind("stats") == "tcp://10.0.0.1:7002"
    assert cp.host_names() == ["10.0.0.1", "10.0.0.2"]
    v6 = _place(["sync.learners=1"], "[fd00::1]:1")
    assert v6.plan.endpoints["ps"] == "tcp://[fd00::1]:29500"


def test_sharded_servers_go_to_the_server_host_to_named_hosts_or_beside_the_learners():
    k3 = ["sync.learners=4", "architecture.servers=3"]
    cp = _place(k3, "a:2,b:2")
    assert [cp.placement[x] for x in ("ps", "ps1", "ps2")] == ["a", "a", "a"]
    assert len({cp.plan.endpoints[x] for x in ("ps", "ps1", "ps2", "data", "stats")}) == 5
    cp = _place(k3, "a:2,b:2", ps_hosts=["learners"])
    assert [cp.placement[x] for x in ("ps", "ps1", "ps2")] == ["a", "b", "a"]  # cycling
    cp = _place(k3, "a:2,b:2", ps_hosts=["s1", "s2"])  # dedicated hosts
    assert [cp.placement[x] for x in ("ps", "ps1", "ps2")] == ["s1", "s2", "s1"]
    assert cp.learners_on("s1") == 0 and "s1 (servers only" in cluster_plan.describe(cp)
    learner = next(s for s in cluster_plan.role_steps(cp.plan) if s.role == "learner")
    ps = learner.args[learner.args.index("--ps") + 1].split(",")
    assert ps == [cp.plan.endpoints[x] for x in ("ps", "ps1", "ps2")]  # in range order
    assert {"ps", "ps1", "ps2"} <= set(learner.after)


def test_ps_hosts_with_a_bad_name_is_refused_naming_it():
    from rudra_zmq.launch.hostfile import HostfileError, parse_names

    assert parse_names("s1,10.0.0.2,[fd00::7]", "--ps-hosts") == ["s1", "10.0.0.2", "fd00::7"]
    with pytest.raises(HostfileError, match="--ps-hosts 's1,-x'"):
        parse_names("s1,-x", "--ps-hosts")
    with pytest.raises(HostfileError, match="host names only"):
        parse_names("s1:2", "--ps-hosts")


def test_adv_leaves_and_advstar_broadcast_sockets_sit_with_their_learners():
    cp = _place(
        [
            "sync.learners=4",
            "sync.protocol=softsync",
            "architecture.kind=advstar",
            "architecture.fanout=2",
            "architecture.broadcast_fanout=1",
        ],
        "a:1,b:3",
    )
    assert cp.placement["node0"] == "a" and cp.placement["node1"] == "b"  # leaves 0,1 / 2,3
    assert [cp.placement[f"bcast{i}"] for i in range(3)] == ["a", "b", "b"]  # chain 0->1->2->3
    ports = [cp.plan.endpoints[k] for k in cp.plan.endpoints if cp.placement[k] == "b"]
    assert len(set(ports)) == len(ports)  # no port twice


def test_adv_with_two_servers_puts_each_ranges_leaves_by_learners_and_inner_nodes_by_server():
    overrides = ["sync.learners=4", "architecture.kind=adv", "architecture.fanout=2"]
    overrides += ["architecture.depth=2", "architecture.servers=2"]
    cp = _place(overrides, "a:2,b:2", ps_hosts=["s1", "s2"])
    assert [cp.placement[x] for x in ("node0", "node1", "node0s1", "node1s1")] == list("abab")
    assert (cp.placement["node2"], cp.placement["node2s1"]) == ("s1", "s2")  # beside ps, ps1
    cmds = {label: args for _, label, _, args in cluster_plan.commands(cp)}
    assert cmds["node2s1"][-4:] == ["--parent", cp.plan.endpoints["ps1"], "--shard", "1"]
    assert cmds["node0s1"][cmds["node0s1"].index("--parent") + 1] == cp.plan.endpoints["node2s1"]
    learner = cmds["learner0"]
    assert learner[learner.index("--ps") + 1] == ",".join(
        cp.plan.endpoints[x] for x in ("node0", "node0s1")
    )


def test_commands_start_in_order_with_the_config_first():
    cp = _place(["sync.learners=2", "architecture.kind=adv", "architecture.fanout=2"], "a:2")
    cmds = cluster_plan.commands(cp)
    assert [label for _, label, _, _ in cmds] == [
        "stats",
        "data",
        "ps",
        "node0",
        "learner0",
        "learner1",
    ]
    assert all(
        args[:2] == ["--config", str(cp.plan.run_dir / "config.yaml")] for _, _, _, args in cmds
    )


@pytest.mark.parametrize(
    "host, bind",
    [
        ("localhost", "tcp://127.0.0.1:29500"),
        ("127.0.0.1", "tcp://127.0.0.1:29500"),
        ("127.0.0.2", "tcp://127.0.0.2:29500"),
        ("::1", "tcp://[::1]:29500"),
        ("10.0.0.1", "tcp://10.0.0.1:29500"),
        ("node1", "tcp://0.0.0.0:29500"),
    ],
)
def test_servers_bind_what_the_hostfile_says(host, bind):
    assert (
        _place(["sync.learners=1"], f"{host}:1" if ":" not in host else f"[{host}]:1").plan.bind(
            "ps"
        )
        == bind
    )


@pytest.mark.parametrize(
    "hosts, given, on, said",
    [
        # other hosts: encrypted unless the config says false
        ("a:2,b:2", None, True, "CurveZMQ"),
        ("localhost:2,b:2", None, True, "CurveZMQ"),
        # every role on this machine, on loopback
        ("localhost:4", None, False, "plaintext on loopback"),
        ("127.0.0.1:4", None, False, "plaintext on loopback"),
        ("a:2,b:2", False, False, "PLAINTEXT across hosts (security.curve: false)"),
        ("localhost:4", True, True, "CurveZMQ"),
    ],
)
def test_curve_unset_is_on_exactly_when_others_could_reach_the_roles(hosts, given, on, said):
    sets = ["sync.learners=4"] + ([] if given is None else [f"security.curve={given}"])
    cp = _place(sets, hosts)
    # unset stays unset where nothing is exposed (07a2da7), and unset reads as off
    assert bool(cp.plan.cfg.security.curve) is on and cp.curve_given is given
    assert cluster_plan.security_line(cp).startswith(said)


def test_curve_unset_is_on_for_this_machine_named_by_its_own_name(monkeypatch):
    monkeypatch.setattr(cluster_plan.hostfile, "is_local", lambda name: True)
    cp = _place(["sync.learners=2"], "box:2")  # binds every interface
    assert cp.plan.bind("ps") == "tcp://0.0.0.0:29500" and cp.plan.cfg.security.curve


def test_the_saved_config_holds_the_decided_curve(tmp_path):
    cfg = load_config(None, ["sync.learners=2"])
    cp = cluster_plan.place(cfg, parse_hosts_arg("a:2"), run_dir=tmp_path / "run")
    assert "curve: true" in (tmp_path / "run" / "config.yaml").read_text()
    assert cfg.security.curve is None  # the caller's config is left as it was
    assert load_config(tmp_path / "run" / "config.yaml").security.curve is True
    assert cp.plan.cfg.security.curve is True


def test_the_plan_says_how_each_host_is_reached_and_how_roles_talk():
    text = cluster_plan.describe(_place(["sync.learners=3"], "localhost:1,b:2"))
    assert "localhost (1 slot, 1 learners; this machine, no ssh): stats" in text
    assert "b (2 slots, 2 learners; over ssh): learner1, learner2" in text
    assert "security: CurveZMQ on every socket (security.curve unset)" in text


def test_a_bad_port_is_refused():
    with pytest.raises(ConfigError, match="--port 0"):
        _place([], "a:4", port=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_on_localhost_alone_needs_no_ssh(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "launch",
            str(ROOT / "configs" / "quickstart.yaml"),
            "-H",
            "localhost:2",
            "--set",
            "sync.learners=2",
            "--set",
            "train.epochs=1",
            "--port",
            str(free_port_range()),
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "localhost:stats " in res.stdout and "localhost:learner1 " in res.stdout
    processes = (run / "processes.json").read_text()
    assert "ssh" not in processes
    # localhost binds loopback: no role listens on every interface, nothing warns about it
    assert "tcp://127.0.0.1:" in processes and "0.0.0.0" not in processes
    assert "every network interface" not in res.stdout + res.stderr
    assert "plaintext on loopback" in res.stdout
    assert run_summary(run)["epochs"] >= 1.0


# ------------------------------------------------------------------ the launch command
def _launch(capsys, *argv):
    rc = cli.main(["launch", str(ROOT / "configs" / "quickstart.yaml"), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_states_the_ssh_rule_and_writes_nothing(tmp_path, capsys):
    rc, out, err = _launch(
        capsys, "-H", "localhost:2,b:2", "--dry-run", "--run-dir", str(tmp_path / "never")
    )
    assert rc == 0, err
    assert "localhost, 127.x.x.x, ::1 and this machine's own names run here without ssh" in out
    assert "localhost:learner0$ " + sys.executable in out  # here, no ssh
    assert "b:learner2$ ssh " in out
    assert "CurveZMQ" in out and "PLAINTEXT" not in err  # unset: encrypted
    assert not (tmp_path / "never").exists()


def test_plaintext_across_hosts_is_said_once_on_the_terminal(tmp_path, capsys):
    rc, out, err = _launch(
        capsys,
        "-H",
        "a:2,b:2",
        "--dry-run",
        "--set",
        "security.curve=false",
        "--run-dir",
        str(tmp_path / "never"),
    )
    assert rc == 0 and err.count("PLAINTEXT") == 1 and "security.curve is false" in err, err
    rc, out, err = _launch(
        capsys,
        "-H",
        "localhost:4",
        "--dry-run",
        "--set",
        "security.curve=false",
        "--run-dir",
        str(tmp_path / "never"),
    )
    assert rc == 0 and err == "" and "plaintext on loopback" in out


def test_a_launch_whose_host_cannot_be_reached_leaves_no_run_directory(tmp_path, capsys):
    runs = tmp_path / "runs"  # made by this launch: removed with the run
    rc, out, err = _launch(
        capsys,
        "-H",
        "unreachable-host:2",
        "--set",
        "sync.learners=2",
        "--set",
        f"runtime.run_dir={runs}",
        "--ssh-opts",
        "-o ProxyCommand=false",
    )
    assert rc == 1, err
    assert "could not prepare unreachable-host" in err and "removed " in err, err
    assert not runs.exists()


def test_a_failed_launch_into_a_folder_that_was_there_leaves_it_as_it_was(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    for _ in range(2):  # nothing left behind blocks a second try
        rc, out, err = _launch(
            capsys,
            "-H",
            "unreachable-host:2",
            "--set",
            "sync.learners=2",
            "--run-dir",
            str(run),
            "--ssh-opts",
            "-o ProxyCommand=false",
        )
        assert rc == 1 and "could not prepare unreachable-host" in err, err
        assert [p.name for p in run.iterdir()] == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launch_whose_server_cannot_start_leaves_no_run_directory(tmp_path, capsys):
    # every role is pointed at a key directory that holds no keys: the first server exits
    rc, out, err = _launch(
        capsys,
        "-H",
        "localhost:2",
        "--set",
        "sync.learners=2",
        "--set",
        "security.curve=true",
        "-x",
        f"RUDRA_ZMQ_KEYS={tmp_path}",
        "--port",
        str(free_port_range()),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert rc == 1, out + err
    assert "exited with code 2" in err and "removed " in err, err
    assert not (tmp_path / "run").exists()
