"""``rudra-zmq launch --hostfile`` across three emulated LAN hosts: network namespaces built by
``bench/lan/netns.sh`` (1 Gbit/s tbf links), an OpenSSH server in each with keys made here,
and the launcher started on the first host, as a user would on a cluster. It trains the
quickstart for Rudra-base, -adv and -adv*, survives a learner host that drops off the
network, stops everything on every host when a server fails or on Ctrl-C, removes the run
directories of a launch that failed at start, and leaves nothing running. Needs root, iproute2 and Debian's openssh-server (.ci/run installs it); skips with
the reason otherwise.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from netns_check import netns_missing
from rudra_zmq.results.compare import run_summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]
NETNS_SH = ROOT / "bench" / "lan" / "netns.sh"
SSHD = "/usr/sbin/sshd"
HOSTS = ["10.77.0.1", "10.77.0.2", "10.77.0.3"]


def _missing() -> str | None:
    if why := netns_missing("tc", "ssh", "ssh-keygen"):
        return why
    if not os.path.exists(SSHD):
        return "needs an OpenSSH server (Debian: apt-get install openssh-server)"
    return None


class Lan:
    """Three namespaces with an sshd each; ``ns(i)`` is host i's namespace."""

    def __init__(self, tmp: Path):
        self.tmp, self.prefix = tmp, f"rzssh{os.getpid() % 100000}"
        self.sshd_pids: set[int] = set()

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def up(self) -> None:
        subprocess.run(
            ["bash", str(NETNS_SH), "up", "3", "1gbit", "--prefix", self.prefix],
            check=True,
            capture_output=True,
            timeout=60,
        )
        t = self.tmp
        for name in ("host_key", "id"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(t / name)], check=True
            )
        shutil.copy(t / "id.pub", t / "authorized_keys")
        (t / "sshd_config").write_text(
            f"HostKey {t / 'host_key'}\nAuthorizedKeysFile {t / 'authorized_keys'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nPermitRootLogin prohibit-password\nPidFile none\n"
            "ClientAliveInterval 2\nClientAliveCountMax 3\n"
        )
        (t / "ssh_config").write_text(
            f"Host *\n  IdentityFile {t / 'id'}\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for i, addr in enumerate(HOSTS):
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns(i),
                    SSHD,
                    "-f",
                    str(t / "sshd_config"),
                    "-o",
                    f"ListenAddress={addr}",
                    "-E",
                    str(t / f"sshd{i}.log"),
                ],
                check=True,
                timeout=30,
            )
        deadline = time.monotonic() + 20
        for i in range(3):
            while not self.pids(i):
                assert time.monotonic() < deadline, "sshd did not start"
                time.sleep(0.1)
            self.sshd_pids |= self.pids(i)

    def down(self) -> None:
        subprocess.run(
            ["bash", str(NETNS_SH), "down", "--prefix", self.prefix],
            capture_output=True,
            timeout=120,
        )

    def pids(self, i: int) -> set[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True
        ).stdout
        return {int(p) for p in out.split()}

    def commands(self, i: int) -> dict[int, str]:
        """pid -> command line of what runs in namespace ``i`` besides the sshd listeners."""
        cmds = {}
        for p in self.pids(i) - self.sshd_pids:
            try:
                cmds[p] = (
                    Path(f"/proc/{p}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
            except OSError:  # ended meanwhile
                pass
        return cmds

    def kill(self, i: int, pattern: str) -> int:
        """SIGKILL the processes of namespace ``i`` whose command line holds ``pattern``
        (never pkill: it would reach other tests' roles outside the namespace); how many."""
        n = 0
        for p, cmd in self.commands(i).items():
            if pattern in cmd:
                try:
                    os.kill(p, signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    def leftovers(self, timeout: float = 20.0) -> dict[int, list[str]]:
        """What still runs in each namespace besides the sshd listeners, after waiting up
        to ``timeout`` for it to end (the host guards give their roles 5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {i: list(cmds.values()) for i in range(3) if (cmds := self.commands(i))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.3)

    def launch(
        self, config: str, run_dir: Path, *extra: str, hosts: str = "", env: dict | None = None
    ) -> subprocess.Popen:
        """``rudra-zmq launch`` started on host 0, output to ``run_dir``.out."""
        hosts = hosts or f"{HOSTS[0]}:1,{HOSTS[1]}:2,{HOSTS[2]}:1"
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns(0),
            sys.executable,
            "-m",
            "rudra_zmq",
            "launch",
            str(ROOT / "configs" / config),
            "-H",
            hosts,
            "--run-dir",
            str(run_dir),
            "--ssh-opts",
            f"-F {self.tmp / 'ssh_config'}",
            "-x",
            "OMP_NUM_THREADS=1",
            *extra,
        ]
        out = open(f"{run_dir}.out", "w")
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )


@pytest.fixture(scope="module")
def lan(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(why)
    lan = Lan(tmp_path_factory.mktemp("lan"))
    try:
        lan.up()
        yield lan
    finally:
        lan.down()


def _finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"launch ended early:\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "config,extra",
    [
        # base through pdsh (adv, adv* and the fault tests go through ssh, the default), with
        # three parameter servers, one beside each host's learners (one server: the fault
        # tests below)
        (
            "quickstart.yaml",
            ["--launcher", "pdsh", "--set", "architecture.servers=3", "--ps-hosts", "learners"],
        ),
        ("quickstart_adv.yaml", []),
        # adv* with CurveZMQ asked for (base and adv get it by default across hosts): the run's
        # keys go to every host with the config
        ("quickstart_advstar.yaml", ["--set", "security.curve=true"]),
    ],
)
def test_launch_trains_across_three_hosts(lan, tmp_path, config, extra):
    env = None
    if "pdsh" in extra:
        if shutil.which("pdsh") is None:
            pytest.skip("needs pdsh (apt-get install pdsh)")
        env = {"PDSH_SSH_ARGS_APPEND": f"-F {lan.tmp / 'ssh_config'}"}
    run = tmp_path / "run"
    # 2 epochs: one took 1.2 s, and learners whose torch import ran late under CI load (adv*
    # starts with whoever is there) missed it, leaving 59 % error (the check is < 50 %)
    rc = _finish(lan.launch(config, run, "--set", "train.epochs=2", *extra, env=env))
    out = Path(f"{run}.out").read_text()
    assert rc == 0, out[-4000:]
    summary = run_summary(run)
    # learned: the best evaluation, not the last. A 2-epoch quickstart_adv run under CI load
    # went 15.28 % at epoch 1 to 54.17 % at epoch 2 (softsync through the tree, <σ> 0.71):
    # the launch is the subject here, not the last epoch's stability
    assert summary["epochs"] >= 2.0 and summary["best_error"] < 0.5, out[-2000:]
    assert summary["final_error"] < 0.9, out[-2000:]  # not diverged to chance
    # every host ran its share, its lines prefixed host:label, its logs here
    for prefix in (
        "10.77.0.1:ps ",
        "10.77.0.1:stats ",
        "10.77.0.2:learner1 ",
        "10.77.0.2:learner2 ",
        "10.77.0.3:learner3 ",
    ):
        assert prefix in out, (prefix, out[-3000:])
    assert {"ps.log", "stats.log", "learner3.log"} <= {p.name for p in (run / "logs").iterdir()}
    if config != "quickstart.yaml":  # the leaf of learners 1,2 sits on their host
        assert "10.77.0.2:node1 " in out
    if "architecture.servers=3" in extra:  # each server on its host, the weights joined
        assert "10.77.0.2:ps1 " in out and "10.77.0.3:ps2 " in out
        assert len(json.loads((run / "ps_final.json").read_text())["servers"]) == 3
    # across hosts CurveZMQ is on without being asked for, with the run's keys
    assert "security: CurveZMQ on every socket" in out and (run / "keys" / "server.key").exists()
    assert "PLAINTEXT" not in out
    assert lan.leftovers() == {}


def test_a_sharded_launch_across_hosts_writes_one_timeline_of_every_hosts_roles(lan, tmp_path):
    """Issue 42 item 6: ``launch --timeline`` with three servers, one beside each host's
    learners, each range in 2 parts pushed during backward: one trace holds every host's
    roles (each its part, written beside the trace on the shared file system), each
    learner's steps, and its parts sent to every server."""
    run, trace_path = tmp_path / "run", tmp_path / "launch.json"
    proc = lan.launch(
        "quickstart.yaml", run, "--set", "train.epochs=1", "--set", "sync.protocol=hardsync",
        "--set", "architecture.servers=3", "--ps-hosts", "learners", "--set", "wire.parts=2",
        "--timeline", str(trace_path),
    )  # fmt: skip
    rc = _finish(proc)
    out = Path(f"{run}.out").read_text()
    assert rc == 0, out[-4000:]
    assert f"timeline: {trace_path} (" in out
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names.count("ps") == 3 and {"learner", "data_server", "stats_server"} <= set(names)
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert {e["args"]["learner"] for e in steps} == {0, 1, 2, 3}
    sent = {e["args"]["peer"] for e in events if e["name"] == "send" and e["args"]["bytes"]}
    parts = {e["args"]["peer"] for e in events if e["name"] == "recv" and e["args"].get("at")}
    # each server's range in 2 parts: its second part's replies (x{at} > 0) reach the learners
    assert len(parts) == 3 and parts <= sent, (parts, sent)
    assert trace["otherData"]["dropped"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch.json", "run", "run.out"]
    assert lan.leftovers() == {}


@contextlib.contextmanager
def _private_sshd(lan, tmp_path, hosts=(0,)):
    """A second sshd on each of ``hosts`` (port 2222), each in a mount namespace of its own
    where a tmpfs hides ``tmp_path/private``: what its sessions write there is seen neither
    here nor on the other hosts. Yields the folder; stops those sshds after."""
    private = tmp_path / "private"
    private.mkdir()
    extra_sshd = set()
    try:
        for i in hosts:
            script = (
                f"mount -t tmpfs tmpfs {private} && exec {SSHD} -p 2222 "
                f"-f {lan.tmp / 'sshd_config'} -o ListenAddress={HOSTS[i]} "
                f"-E {lan.tmp / f'sshd-private{i}.log'}"
            )
            subprocess.run(
                ["ip", "netns", "exec", lan.ns(i), "unshare", "-m", "--propagation", "private"]
                + ["sh", "-c", script],
                check=True,
                timeout=30,
            )
            deadline = time.monotonic() + 20
            while not lan.pids(i) - lan.sshd_pids:
                assert time.monotonic() < deadline, f"the private sshd of host {i} did not start"
                time.sleep(0.1)
            extra_sshd |= lan.pids(i) - lan.sshd_pids
        yield private
    finally:
        for pid in extra_sshd:
            os.kill(pid, signal.SIGTERM)


def test_a_host_without_the_shared_file_system_gets_the_config_and_gives_back_results(
    lan, tmp_path
):
    with _private_sshd(lan, tmp_path, hosts=(0, 1)) as private:
        run = private / "run"
        proc = lan.launch(
            "quickstart.yaml",
            run,
            "--set",
            "sync.learners=2",
            "--set",
            "train.epochs=1",
            "--set",
            "architecture.servers=2",  # a server on each host: both hosts' files come back
            "--ps-hosts",
            "learners",
            "--ssh-opts",
            f"-F {lan.tmp / 'ssh_config'} -p 2222",
            hosts=f"{HOSTS[0]}:1,{HOSTS[1]}:1",
        )
        rc = _finish(proc)
        out = Path(f"{run}.out").read_text()
        assert rc == 0, out[-4000:]
        assert f"{HOSTS[1]}:ps1 parameter server 1 of 2" in out  # in host 1's own tmpfs
        # the roles ran in the hidden folder; metrics and plots came back, logs were here
        assert run_summary(run)["epochs"] >= 1.0
        assert (run / "throughput.png").exists() and (run / "ps_final.json").exists()
        assert (run / "logs" / "ps.log").read_text().strip()
        parts = [np.load(run / "servers" / f"server-{i}" / "weights.npy") for i in (0, 1)]
        np.testing.assert_array_equal(np.concatenate(parts), np.load(run / "weights.npy"))
    assert lan.leftovers() == {}


def test_a_launch_that_fails_at_start_removes_the_run_directories_it_made(lan, tmp_path):
    with _private_sshd(lan, tmp_path) as private:
        run = private / "run"
        ssh = [
            "ip",
            "netns",
            "exec",
            lan.ns(0),
            "ssh",
            "-F",
            str(lan.tmp / "ssh_config"),
            "-p",
            "2222",
            HOSTS[0],
        ]
        # every role is pointed at a key directory that is not there: the first server exits
        proc = lan.launch(
            "quickstart.yaml",
            run,
            "--set",
            "sync.learners=2",
            "-x",
            "RUDRA_ZMQ_KEYS=/nonexistent-keys",
            "--ssh-opts",
            f"-F {lan.tmp / 'ssh_config'} -p 2222",
            hosts=f"{HOSTS[0]}:2",
        )
        rc = _finish(proc)
        out = Path(f"{run}.out").read_text()
        assert rc == 1 and f"removed {run}" in out, out[-4000:]
        assert not run.exists()  # here
        there = subprocess.run(
            [*ssh, f"test -e {run} && echo there || echo gone"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert there.stdout.split() == ["gone"], there  # and on the host
    assert lan.leftovers() == {}


def test_a_learner_host_that_drops_off_the_network_is_left_out(lan, tmp_path):
    run = tmp_path / "run"
    # learner 3 alone on host 2; ssh notices a dead link after 1 s x 3 keepalives
    # runtime.learner_timeout_s=25 (60 by default), and timeout_s=25 for a learner never
    # heard from (from the PS's start): the PS, done, waits that long for learner 3 before
    # evicting it; 4 epochs: training ends well inside it even on a loaded machine (40, then
    # 20 epochs took ~60 s at a load of 11: evicted before training ended, so the
    # done-and-waiting path was not reached; 10 epochs and 60 s cost the suite 65 s)
    proc = lan.launch(
        "quickstart.yaml",
        run,
        "--set",
        "train.epochs=4",
        "--set",
        "runtime.restart=true",
        "--set",
        "runtime.timeout_s=25",
        "--set",
        "runtime.learner_timeout_s=25",
        "--ssh-opts",
        f"-F {lan.tmp / 'ssh_config'} -o ServerAliveInterval=1",
    )
    try:
        _wait_for(Path(f"{run}.out"), "training started", proc)
        subprocess.run(["ip", "-n", lan.ns(2), "link", "set", "eth0", "down"], check=True)
        rc = _finish(proc)
    finally:
        subprocess.run(["ip", "-n", lan.ns(2), "link", "set", "eth0", "up"])
    out = Path(f"{run}.out").read_text()
    assert rc == 0, out[-4000:]
    assert "lost host 10.77.0.3" in out and "learner3 is left out" in out, out[-3000:]
    assert "restarting learner3" not in out
    assert "training is done; waiting to tell learners [3] to stop" in out, out[-3000:]
    assert run_summary(run)["epochs"] >= 4.0 - 1e-6
    # back on the network, sshd finds its client gone and the guard stops learner 3
    assert lan.leftovers(timeout=60) == {}


def test_a_failed_server_stops_every_host_and_names_it(lan, tmp_path):
    run = tmp_path / "run"
    proc = lan.launch(
        "quickstart.yaml", run, "--set", "train.epochs=200", "--set", "runtime.restart=false"
    )
    _wait_for(Path(f"{run}.out"), "training started", proc)
    assert lan.kill(0, "-m rudra_zmq ps "), "no parameter server on host 0"
    rc = _finish(proc)
    out = Path(f"{run}.out").read_text()
    assert rc == 1, out[-3000:]
    assert "on host 10.77.0.1:" in out and "rudra-zmq: ps (pid" in out, out[-3000:]
    assert lan.leftovers() == {}


def test_ctrl_c_tears_down_every_host(lan, tmp_path):
    run = tmp_path / "run"
    proc = lan.launch("quickstart_adv.yaml", run, "--set", "train.epochs=200")
    _wait_for(Path(f"{run}.out"), "training started", proc)
    os.killpg(proc.pid, signal.SIGINT)
    rc = _finish(proc, timeout=60)
    assert rc == 130, Path(f"{run}.out").read_text()[-3000:]
    assert lan.leftovers() == {}


def test_dry_run_prints_each_hosts_commands_and_writes_nothing(tmp_path):
    run = tmp_path / "never"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "launch",
            str(ROOT / "configs" / "quickstart_advstar.yaml"),
            "-H",
            "a:1,b:2,c:1",
            "--dry-run",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    cmds = [ln for ln in lines if "$ " in ln]
    assert [c.split("$")[0] for c in cmds] == [
        "a:stats",
        "a:data",
        "a:ps",
        "a:node0",
        "b:node1",
        "a:learner0",
        "b:learner1",
        "b:learner2",
        "c:learner3",
    ]
    assert all(" ssh " in f" {c} " and "rudra_zmq.launch.host_guard" in c for c in cmds)
    assert "--bcast-upstream tcp://a:29504 --bcast-bind tcp://0.0.0.0:29500" in cmds[6]
    assert not run.exists()
