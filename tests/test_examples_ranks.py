"""The example job scripts (examples/slurm.sbatch, examples/mpirun_mpmd.sh) run a real training
run through `rudra-zmq worker`, under stand-ins for srun and mpirun that start the processes
on this machine with the variables the real launchers set."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import free_port_range
from rudra_zmq.results.compare import run_summary

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# srun: one process per task, SLURM_PROCID/SLURM_LOCALID set, the worst exit code returned
FAKE_SRUN = """#!/bin/bash
while [[ ${1:-} == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

# mpirun: --host and -x NAME[=VALUE], then MPMD groups "-np N cmd ... : -np M cmd ..."; ranks
# numbered across the groups, as Open MPI does
FAKE_MPIRUN = f"""#!{sys.executable}
import os, subprocess, sys
args, env, groups = sys.argv[1:], {{}}, [[]]
while args and args[0] in ("--host", "-x"):
    flag, value, args = args[0], args[1], args[2:]
    if flag == "-x":
        name, eq, val = value.partition("=")
        env[name] = val if eq else os.environ[name]
for a in args:
    if a == ":":
        groups.append([])
    else:
        groups[-1].append(a)
procs = [(int(g[1]), g[2:]) for g in groups]
size = sum(n for n, _ in procs)
rank, running = 0, []
for n, cmd in procs:
    for _ in range(n):
        e = dict(os.environ, **env, OMPI_COMM_WORLD_RANK=str(rank),
                 OMPI_COMM_WORLD_SIZE=str(size), OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                 OMPI_COMM_WORLD_LOCAL_SIZE=str(size))
        running.append(subprocess.Popen(cmd, env=e))
        rank += 1
sys.exit(max(p.wait() for p in running))
"""


def _shim(tmp_path: Path, name: str, text: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    rudra = shutil.which("rudra-zmq")
    assert rudra, "rudra-zmq is not on PATH (pip install -e .)"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI", "RUDRA_", "DMLC_", "MASTER_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(rudra).parent}{os.pathsep}{env['PATH']}"
    env["OMP_NUM_THREADS"] = "1"
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return env


def _check_run(run_dir: Path, res) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    summary = run_summary(run_dir)
    assert summary["epochs"] >= 1.0 and summary["final_error"] is not None, out[-2000:]
    assert summary["final_error"] < 0.5, summary  # it learned: 10 classes, 90 % at chance


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_sbatch_example_trains_under_srun(tmp_path):
    env = _shim(tmp_path, "srun", FAKE_SRUN)
    env.update(
        SLURM_JOB_ID="42",
        SLURM_NTASKS="3",
        SLURM_JOB_NODELIST="localhost",
        SLURM_TASKS_PER_NODE="3",
        SLURM_NODEID="0",
    )
    port = free_port_range()
    res = subprocess.run(
        [
            "bash",
            str(EXAMPLES / "slurm.sbatch"),
            "--set",
            "sync.learners=2",
            "--set",
            "train.epochs=1",
            "--master-port",
            str(port),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    _check_run(tmp_path / "runs" / "slurm-42", res)
    assert "rank 1: learners 0" in res.stderr and "rank 2: learners 1" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_mpirun_mpmd_example_trains_with_curve_and_a_server_on_a_rank_of_its_own(tmp_path):
    """Two servers (architecture.servers=2): server 1 on a rank of its own registers with
    rank 0's directory (CURVE: the ps key) and the learners find it there."""
    from rudra_zmq.security import keys

    env = _shim(tmp_path, "mpirun", FAKE_MPIRUN)
    env.update(LEARNERS="2", SERVERS="2")
    keys.make_run_keys(tmp_path / "keys", ["learner-0", "learner-1", "ps"])  # every rank's
    port = free_port_range()
    run = tmp_path / "run"
    res = subprocess.run(
        [
            "bash",
            str(EXAMPLES / "mpirun_mpmd.sh"),
            "localhost",
            "localhost:4",
            "--set",
            "sync.learners=2",
            "--set",
            "train.epochs=1",
            "--set",
            "architecture.servers=2",
            "--set",
            "security.curve=true",
            "--set",
            "security.keys=keys",
            "--master-port",
            str(port),
            "--run-dir",
            str(run),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    _check_run(run, res)
    out = res.stdout + res.stderr
    assert out.count("(CurveZMQ)") == 4, out[-3000:]  # rank 0, server 1, 2 learners
    assert "rank 1: server 1 of" in out and "rank 3: learners 1" in out
    ps1 = f"tcp://127.0.0.1:{port + 3}"  # ps, data, stats, then ps1's port, on its own host
    assert f"-> tcp://localhost:{port},{ps1}" in out
    assert json.loads((run / "processes-ps1.json").read_text())[0]["role"] == "ps1"
    assert [r["role"] for r in json.loads((run / "processes.json").read_text())] == [
        "stats",
        "data",
        "ps",
    ]
    assert (run / "servers" / "server-1" / "weights.npy").exists()
    assert not (run / "keys").exists()  # the given keys, not new


def test_a_worker_count_that_does_not_fit_the_config_names_both(tmp_path):
    env = _shim(tmp_path, "srun", FAKE_SRUN)
    env.update(SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_JOB_NODELIST="localhost")
    res = subprocess.run(
        ["rudra-zmq", "worker", "configs/quickstart.yaml", "--set", "sync.learners=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "4 ranks (from SLURM_NTASKS)" in res.stderr and "start 3 ranks" in res.stderr


def test_advstar_under_worker_points_to_launch(tmp_path):
    env = _shim(tmp_path, "srun", FAKE_SRUN)
    env.update(RUDRA_RANK="0", RUDRA_MASTER_ADDR="localhost")
    res = subprocess.run(
        ["rudra-zmq", "worker", "configs/quickstart_advstar.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "rudra-zmq launch" in res.stderr


def test_a_learner_started_without_servers_names_the_missing_one(tmp_path):
    env = _shim(tmp_path, "srun", FAKE_SRUN)
    port = free_port_range()
    env.update(
        RUDRA_RANK="1",
        RUDRA_WORLD_SIZE="3",
        RUDRA_MASTER_ADDR="127.0.0.1",
        RUDRA_MASTER_PORT=str(port),
    )
    res = subprocess.run(
        [
            "rudra-zmq",
            "worker",
            "configs/quickstart.yaml",
            "--set",
            "sync.learners=2",
            "--set",
            "runtime.timeout_s=2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"no reply from the parameter server at tcp://127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr


def test_worker_plan_puts_every_server_on_the_master(tmp_path):
    from rudra_zmq.config import load_config
    from rudra_zmq.launch import ranks, worker

    cfg = load_config(str(ROOT / "configs" / "quickstart_adv.yaml"), [])
    r = ranks.resolve(
        {}, {"MASTER_ADDR": "node1", "MASTER_PORT": "29400", "RANK": "2", "WORLD_SIZE": "5"}
    )
    p = worker.plan(cfg, r)
    assert p.endpoints["ps"] == "tcp://node1:29401"  # one above torchrun's own port
    assert p.bind("ps") == "tcp://0.0.0.0:29401"
    assert worker.part(cfg, r) == ("learner", 1)
    assert [p.endpoints[f"node{n.id}"] for n in p.tree.nodes] == [
        "tcp://node1:29404",
        "tcp://node1:29405",
    ]
    dmlc = ranks.resolve(
        {},
        {
            "DMLC_ROLE": "worker",
            "DMLC_WORKER_ID": "0",
            "DMLC_NUM_WORKER": "4",
            "DMLC_PS_ROOT_URI": "10.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000",
        },
    )
    assert worker.part(cfg, dmlc) == ("learner", 0)
    assert worker.plan(cfg, dmlc).endpoints["data"] == "tcp://10.0.0.1:9001"


@pytest.mark.parametrize(
    "master, bind",
    [
        ("127.0.0.1", "tcp://127.0.0.1:29500"),
        ("localhost", "tcp://127.0.0.1:29500"),
        ("10.0.0.1", "tcp://10.0.0.1:29500"),
        ("::1", "tcp://[::1]:29500"),
        ("node1", "tcp://0.0.0.0:29500"),
    ],
)
def test_worker_servers_bind_the_master_address_they_are_given(master, bind):
    from rudra_zmq.config import load_config
    from rudra_zmq.launch import ranks, worker

    r = ranks.resolve({}, {"RUDRA_MASTER_ADDR": master, "RUDRA_RANK": "0"})
    assert worker.plan(load_config(None, []), r).bind("ps") == bind


@pytest.mark.parametrize(
    "master, sets, on, warns",
    [
        ("127.0.0.1", [], False, None),  # one machine: loopback
        ("node1", [], False, "security.keys names no key directory"),  # no keys to get
        ("node1", ["security.keys=k"], True, None),  # keys: encrypted
        ("node1", ["security.keys=k", "security.curve=false"], False, "security.curve is false"),
        ("127.0.0.1", ["security.keys=k", "security.curve=true"], True, None),
    ],
)
def test_worker_encrypts_across_hosts_when_it_has_keys_else_says_plaintext(master, sets, on, warns):
    from rudra_zmq.config import load_config
    from rudra_zmq.launch import worker

    cfg, line = worker.security_of(load_config(None, sets), master)
    assert cfg.security.curve is on
    assert (line is None) if warns is None else (warns in line and "PLAINTEXT" in line)


def test_worker_with_curve_and_no_key_directory_is_refused():
    from rudra_zmq.config import ConfigError, load_config
    from rudra_zmq.launch import worker

    with pytest.raises(ConfigError, match="needs security.keys"):
        worker.security_of(load_config(None, ["security.curve=true"]), "node1")


def test_worker_rank_0_says_plaintext_once_on_the_terminal(tmp_path, monkeypatch, capsys):
    from rudra_zmq import cli
    from rudra_zmq.launch import launcher

    started = []
    monkeypatch.setattr(launcher.Launcher, "run", lambda self: started.append(self) or 0)
    monkeypatch.setenv("RUDRA_RANK", "0")
    monkeypatch.setenv("RUDRA_MASTER_ADDR", "node1")
    rc = cli.main(
        ["worker", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path / "run")]
    )
    out, err = capsys.readouterr()
    assert rc == 0 and len(started) == 1, err
    assert err.count("PLAINTEXT") == 1 and "(plaintext)" in out
    assert started[0].plan.bind("ps") == "tcp://0.0.0.0:29500"
