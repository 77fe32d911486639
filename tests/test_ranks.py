"""`rudra_zmq.launch.ranks`: rank and cluster facts from each launcher's variables, their precedence,
every error path, SLURM hostlists and task counts, and `rudra-zmq env`. Every test passes its
own environ; none reads the real environment."""

import argparse

import pytest

from rudra_zmq.launch import rank_values, ranks
from rudra_zmq.launch.ranks import Found, RanksError, resolve

pytestmark = pytest.mark.timeout(60)

# What each launcher sets for one of its processes (noise variables included: they must be
# ignored). Expected: field -> (value, source); fields not named must be None.
LAUNCHERS = {
    "torchrun --nnodes 2 --nproc-per-node 2, node 1, local rank 1": (
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "ROLE_RANK": "3",
            "ROLE_WORLD_SIZE": "4",
            "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": "node1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "none",
        },
        {
            "rank": (3, "RANK"),
            "world_size": (4, "WORLD_SIZE"),
            "local_rank": (1, "LOCAL_RANK"),
            "local_world_size": (2, "LOCAL_WORLD_SIZE"),
            "node_rank": (1, "GROUP_RANK"),
            "master_addr": ("node1", "MASTER_ADDR"),
            "master_port": (29500, "MASTER_PORT"),
        },
    ),
    "srun -n 4 on node[1-2], 2 tasks per node, task 3": (
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_NPROCS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_NODELIST": "node[1-2]",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURMD_NODENAME": "node2",
            "SLURM_JOB_ID": "12345",
        },
        {
            "rank": (3, "SLURM_PROCID"),
            "world_size": (4, "SLURM_NTASKS"),
            "local_rank": (1, "SLURM_LOCALID"),
            "local_world_size": (2, "SLURM_TASKS_PER_NODE (node 1)"),
            "node_rank": (1, "SLURM_NODEID"),
            "master_addr": ("node1", "SLURM_JOB_NODELIST (first host)"),
            "hosts": (["node1", "node2"], "SLURM_JOB_NODELIST"),
        },
    ),
    "mpirun -np 3 (Open MPI), one host, rank 2": (
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
            "OMPI_COMM_WORLD_NODE_RANK": "0",
            "OMPI_UNIVERSE_SIZE": "3",
            "PMIX_RANK": "2",
            "PMIX_NAMESPACE": "prterun-host-1234@1",
        },
        {
            "rank": (2, "OMPI_COMM_WORLD_RANK"),
            "world_size": (3, "OMPI_COMM_WORLD_SIZE"),
            "local_rank": (2, "OMPI_COMM_WORLD_LOCAL_RANK"),
            "local_world_size": (3, "OMPI_COMM_WORLD_LOCAL_SIZE"),
            "node_rank": (0, "OMPI_COMM_WORLD_NODE_RANK"),
        },
    ),
    "mpiexec -n 4 (MPICH hydra / Intel MPI), rank 1": (
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "4",
            "PMI_FD": "6",
            "PMI_JOBID": "0",
        },
        {
            "rank": (1, "PMI_RANK"),
            "world_size": (4, "PMI_SIZE"),
            "local_rank": (1, "MPI_LOCALRANKID"),
            "local_world_size": (4, "MPI_LOCALNRANKS"),
        },
    ),
    "srun --mpi=pmix, rank 5 of 6 on gpu[01-03]": (
        {
            "PMIX_RANK": "5",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "6",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_JOB_NODELIST": "gpu[01-03]",
            "SLURM_TASKS_PER_NODE": "2(x3)",
            "SLURM_NTASKS_PER_NODE": "2",
        },
        {
            "rank": (5, "PMIX_RANK"),
            "world_size": (6, "SLURM_NTASKS"),
            "local_rank": (1, "SLURM_LOCALID"),
            "local_world_size": (2, "SLURM_NTASKS_PER_NODE"),
            "node_rank": (2, "SLURM_NODEID"),
            "master_addr": ("gpu01", "SLURM_JOB_NODELIST (first host)"),
            "hosts": (["gpu01", "gpu02", "gpu03"], "SLURM_JOB_NODELIST"),
        },
    ),
    "DMLC/BytePS worker 1 of 2": (
        {
            "DMLC_ROLE": "worker",
            "DMLC_PS_ROOT_URI": "10.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2",
            "DMLC_NUM_SERVER": "1",
            "DMLC_WORKER_ID": "1",
            "BYTEPS_LOCAL_RANK": "0",
            "BYTEPS_LOCAL_SIZE": "1",
        },
        {
            "role": ("learner", "DMLC_ROLE"),
            "master_addr": ("10.0.0.1", "DMLC_PS_ROOT_URI"),
            "master_port": (9000, "DMLC_PS_ROOT_PORT"),
            "num_learners": (2, "DMLC_NUM_WORKER"),
            "learner_id": (1, "DMLC_WORKER_ID"),
        },
    ),
    "DMLC/BytePS server": (
        {
            "DMLC_ROLE": "server",
            "DMLC_PS_ROOT_URI": "10.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2",
            "DMLC_NUM_SERVER": "1",
        },
        {
            "role": ("servers", "DMLC_ROLE"),
            "master_addr": ("10.0.0.1", "DMLC_PS_ROOT_URI"),
            "master_port": (9000, "DMLC_PS_ROOT_PORT"),
            "num_learners": (2, "DMLC_NUM_WORKER"),
        },
    ),
    "DMLC/BytePS scheduler": (
        {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000"},
        {
            "role": ("servers", "DMLC_ROLE"),
            "master_addr": ("10.0.0.1", "DMLC_PS_ROOT_URI"),
            "master_port": (9000, "DMLC_PS_ROOT_PORT"),
        },
    ),
    "nothing set": ({"HOME": "/home/u", "PATH": "/usr/bin"}, {}),
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_launcher_gives_its_rank_and_cluster_facts(launcher):
    environ, expected = LAUNCHERS[launcher]
    r = resolve(None, environ)
    got = {
        name: (f.value, f.source) for name in ranks._FIELDS if (f := getattr(r, name)) is not None
    }
    assert got == expected


def test_value_gives_the_value_or_none_and_rejects_unknown_names():
    r = resolve({}, {"RANK": "2", "WORLD_SIZE": "3"})
    assert (r.value("rank"), r.value("world_size"), r.value("master_port")) == (2, 3, None)
    assert r.rank == Found(2, "RANK")
    with pytest.raises(AttributeError, match="'ranks'"):
        r.value("ranks")


def test_resolve_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setattr(ranks.os, "environ", {"RUDRA_RANK": "1", "RUDRA_WORLD_SIZE": "2"})
    r = resolve()
    assert (r.rank, r.world_size) == (Found(1, "RUDRA_RANK"), Found(2, "RUDRA_WORLD_SIZE"))


# ---- precedence ----

FULL = {
    "RUDRA_RANK": "2",
    "RANK": "3",
    "OMPI_COMM_WORLD_RANK": "4",
    "PMI_RANK": "5",
    "PMIX_RANK": "6",
    "SLURM_PROCID": "7",
    "WORLD_SIZE": "16",
    "SLURM_NTASKS": "16",
}


@pytest.mark.parametrize(
    "drop, rank, source",
    [
        ((), 2, "RUDRA_RANK"),
        (("RUDRA_RANK",), 3, "RANK"),
        (("RUDRA_RANK", "RANK"), 4, "OMPI_COMM_WORLD_RANK"),
        (("RUDRA_RANK", "RANK", "OMPI_COMM_WORLD_RANK"), 5, "PMI_RANK"),
        (("RUDRA_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), 6, "PMIX_RANK"),
        (
            ("RUDRA_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
            7,
            "SLURM_PROCID",
        ),
    ],
)
def test_rank_comes_from_the_highest_launcher_that_sets_it(drop, rank, source):
    environ = {k: v for k, v in FULL.items() if k not in drop}
    assert resolve({}, environ).rank == Found(rank, source)


def test_cli_beats_rudra_beats_torchrun_beats_slurm():
    environ = dict(
        FULL,
        RUDRA_WORLD_SIZE="12",
        RUDRA_MASTER_PORT="7000",
        MASTER_PORT="29500",
        MASTER_ADDR="torchhost",
        SLURM_JOB_NODELIST="n[1-4]",
    )
    cli = {"rank": 1, "world_size": "8", "role": None, "master_port": ""}  # None, "": not given
    r = resolve(cli, environ)
    assert r.rank == Found(1, "--rank")
    assert r.world_size == Found(8, "--world-size")
    assert r.master_port == Found(7000, "RUDRA_MASTER_PORT")
    assert r.master_addr == Found("torchhost", "MASTER_ADDR")
    assert r.role is None
    assert r.hosts == Found(["n1", "n2", "n3", "n4"], "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "environ, field, expected",
    [
        ({"RUDRA_ROLE": "learner", "DMLC_ROLE": "server"}, "role", Found("learner", "RUDRA_ROLE")),
        (
            {"RUDRA_MASTER_ADDR": "a", "DMLC_PS_ROOT_URI": "b", "MASTER_ADDR": "c"},
            "master_addr",
            Found("a", "RUDRA_MASTER_ADDR"),
        ),
        (
            {"DMLC_PS_ROOT_URI": "b", "MASTER_ADDR": "c", "SLURM_NODELIST": "d1"},
            "master_addr",
            Found("b", "DMLC_PS_ROOT_URI"),
        ),
        ({"SLURM_NODELIST": "d[7-8]"}, "master_addr", Found("d7", "SLURM_NODELIST (first host)")),
        (
            {"DMLC_PS_ROOT_PORT": "9000", "MASTER_PORT": "29500"},
            "master_port",
            Found(9000, "DMLC_PS_ROOT_PORT"),
        ),
        (
            {"RUDRA_NUM_LEARNERS": "3", "DMLC_NUM_WORKER": "2"},
            "num_learners",
            Found(3, "RUDRA_NUM_LEARNERS"),
        ),
        ({"SLURM_NTASKS": "4", "SLURM_NPROCS": "5"}, "world_size", Found(4, "SLURM_NTASKS")),
        ({"SLURM_NPROCS": "5"}, "world_size", Found(5, "SLURM_NPROCS")),
        (
            {"SLURM_JOB_NODELIST": "a1", "SLURM_NODELIST": "b1"},
            "hosts",
            Found(["a1"], "SLURM_JOB_NODELIST"),
        ),
        (
            {"RUDRA_LOCAL_RANK": "0", "LOCAL_RANK": "1", "SLURM_LOCALID": "2"},
            "local_rank",
            Found(0, "RUDRA_LOCAL_RANK"),
        ),
        (
            {"GROUP_RANK": "1", "OMPI_COMM_WORLD_NODE_RANK": "2", "SLURM_NODEID": "3"},
            "node_rank",
            Found(1, "GROUP_RANK"),
        ),
        (
            {"SLURM_NTASKS_PER_NODE": "3", "SLURM_TASKS_PER_NODE": "2(x2)"},
            "local_world_size",
            Found(3, "SLURM_NTASKS_PER_NODE"),
        ),
        (
            {"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"},
            "local_world_size",
            Found(1, "SLURM_TASKS_PER_NODE (node 3)"),
        ),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "local_world_size", Found(2, "SLURM_TASKS_PER_NODE")),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, "local_world_size", None),  # which node are we?
        ({"RANK": " ", "SLURM_PROCID": "4"}, "rank", Found(4, "SLURM_PROCID")),  # blank = unset
        ({"RANK": "1", "SLURM_PROCID": "junk"}, "rank", Found(1, "RANK")),  # loser not parsed
    ],
)
def test_each_field_takes_the_first_variable_found(environ, field, expected):
    assert getattr(resolve({}, environ), field) == expected


# ---- errors: each names the variable (or flag) and quotes its value ----


@pytest.mark.parametrize(
    "cli, environ, words",
    [
        ({}, {"RANK": "-1"}, ["RANK='-1'", "non-negative integer"]),
        ({}, {"SLURM_PROCID": "3.0"}, ["SLURM_PROCID='3.0'", "non-negative integer"]),
        ({}, {"PMI_RANK": "one"}, ["PMI_RANK='one'"]),
        ({}, {"WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "positive integer"]),
        ({}, {"OMPI_COMM_WORLD_SIZE": "x"}, ["OMPI_COMM_WORLD_SIZE='x'", "positive integer"]),
        ({}, {"LOCAL_RANK": "+1"}, ["LOCAL_RANK='+1'"]),
        ({}, {"MPI_LOCALNRANKS": "0"}, ["MPI_LOCALNRANKS='0'", "positive"]),
        ({}, {"GROUP_RANK": "-2"}, ["GROUP_RANK='-2'"]),
        ({}, {"DMLC_WORKER_ID": "w1"}, ["DMLC_WORKER_ID='w1'"]),
        ({}, {"DMLC_NUM_WORKER": "0"}, ["DMLC_NUM_WORKER='0'", "positive"]),
        ({}, {"MASTER_PORT": "0"}, ["MASTER_PORT='0'", "1 to 65535"]),
        ({}, {"RUDRA_MASTER_PORT": "65536"}, ["RUDRA_MASTER_PORT='65536'", "1 to 65535"]),
        ({}, {"DMLC_PS_ROOT_PORT": "http"}, ["DMLC_PS_ROOT_PORT='http'", "1 to 65535"]),
        ({}, {"MASTER_ADDR": "node 1"}, ["MASTER_ADDR='node 1'", "host name"]),
        ({}, {"RUDRA_ROLE": "ps"}, ["RUDRA_ROLE='ps'", "'servers', 'server' or 'learner'"]),
        ({}, {"DMLC_ROLE": "boss"}, ["DMLC_ROLE='boss'", "'server', 'scheduler', 'worker'"]),
        ({"rank": -1}, {}, ["--rank=-1", "non-negative integer"]),
        ({"world_size": "two"}, {}, ["--world-size='two'", "positive integer"]),
        ({"role": "ps"}, {}, ["--role='ps'", "'servers', 'server' or 'learner'"]),
        ({"master_port": 99999}, {}, ["--master-port=99999", "1 to 65535"]),
        (
            {"rank": 4},
            {"WORLD_SIZE": "4"},
            ["rank 4 (from --rank=4)", "world_size 4 (from WORLD_SIZE=4)", "rank < world_size"],
        ),
        (
            {},
            {"SLURM_PROCID": "9", "SLURM_NTASKS": "8"},
            ["rank 9 (from SLURM_PROCID=9)", "world_size 8 (from SLURM_NTASKS=8)"],
        ),
        (
            {},
            {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            ["local_rank 2 (from LOCAL_RANK=2)", "local_world_size 2 (from LOCAL_WORLD_SIZE=2)"],
        ),
        (
            {},
            {"DMLC_WORKER_ID": "2", "DMLC_NUM_WORKER": "2"},
            ["learner_id 2 (from DMLC_WORKER_ID=2)", "num_learners 2 (from DMLC_NUM_WORKER=2)"],
        ),
        (
            {},
            {"SLURM_JOB_NODELIST": "n[3-1]"},
            ["SLURM_JOB_NODELIST='n[3-1]'", "3-1 runs backwards"],
        ),
        ({}, {"SLURM_NODELIST": "n[1-2"}, ["SLURM_NODELIST='n[1-2'", "never closed"]),
        ({}, {"SLURM_TASKS_PER_NODE": "2(x0)"}, ["SLURM_TASKS_PER_NODE='2(x0)'", "2(x3),1"]),
        (
            {},
            {"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "2"},
            ["SLURM_NODEID='2'", "SLURM_TASKS_PER_NODE='2(x2)'", "below 2"],
        ),
        (
            {},
            {"SLURM_TASKS_PER_NODE": "0,2", "SLURM_NODEID": "0"},
            ["SLURM_TASKS_PER_NODE='0,2'", "0 tasks"],
        ),
        ({"ranks": 1}, {}, ["'ranks'", "world_size"]),
    ],
)
def test_errors_name_the_variable_and_quote_its_value(cli, environ, words):
    with pytest.raises(RanksError) as info:
        resolve(cli, environ)
    for w in words:
        assert w in str(info.value)


def test_ranks_error_is_a_value_error():
    assert issubclass(RanksError, ValueError)


# ---- SLURM syntaxes ----


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("x[5]", ["x5"]),
        ("a,b", ["a", "b"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        (
            "node[01-03,07],gpu5,rack[1-2]-n[1-2]",
            [
                "node01",
                "node02",
                "node03",
                "node07",
                "gpu5",
                "rack1-n1",
                "rack1-n2",
                "rack2-n1",
                "rack2-n2",
            ],
        ),
        ("c[1,3]-g[0-1].ib", ["c1-g0.ib", "c1-g1.ib", "c3-g0.ib", "c3-g1.ib"]),
        ("  host-a  ", ["host-a"]),
        ("", []),
    ],
)
def test_expand_nodelist(text, hosts):
    assert rank_values.expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, why",
    [
        ("node[1-3", "never closed"),
        ("node1-3]", "']' without '['"),
        ("node[[1-2]]", "'[' inside brackets"),
        ("node[]", "[] holds"),
        ("node[3-1]", "3-1 runs backwards"),
        ("node[a-c]", "[a-c] holds"),
        ("node[1-2-3]", "[1-2-3] holds"),
        ("node[1,]", "[1,] holds"),
        ("a,,b", "empty name"),
        ("a,", "empty name"),
        ("a b", "space"),
        ("n[0-1000000]", "more than 1,000,000 hosts"),
        ("n[0-999]-m[0-999]-k[0-9]", "more than 1,000,000 hosts"),
    ],
)
def test_expand_nodelist_rejects_malformed_text_quoting_it(text, why):
    with pytest.raises(RanksError) as info:
        rank_values.expand_nodelist(text)
    assert f"nodelist {text!r} is malformed" in str(info.value)
    assert why in str(info.value)


@pytest.mark.parametrize(
    "text, counts",
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("1,2(x2)", [1, 2, 2]),
        ("16(x1)", [16]),
    ],
)
def test_parse_tasks_per_node(text, counts):
    assert rank_values.parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x3", "2(x0)", "2(3)", "2,,1", "-1", "2(x3"])
def test_parse_tasks_per_node_rejects_malformed_text_quoting_it(text):
    with pytest.raises(RanksError) as info:
        rank_values.parse_tasks_per_node(text)
    assert f"tasks per node {text!r} is malformed" in str(info.value)
    assert "2(x3),1" in str(info.value)


# ---- describe and `rudra-zmq env` ----

SRUN_LINES = [
    "role              -             (not set)",
    "rank              3             (from SLURM_PROCID)",
    "world_size        4             (from SLURM_NTASKS)",
    "local_rank        1             (from SLURM_LOCALID)",
    "local_world_size  2             (from SLURM_TASKS_PER_NODE (node 1))",
    "master_addr       node1         (from SLURM_JOB_NODELIST (first host))",
    "master_port       -             (not set)",
    "learner_id        -             (not set)",
    "num_learners      -             (not set)",
    "hosts             node1,node2   (from SLURM_JOB_NODELIST)",
    "node_rank         1             (from SLURM_NODEID)",
]


def test_describe_says_each_value_and_where_it_came_from():
    environ = LAUNCHERS["srun -n 4 on node[1-2], 2 tasks per node, task 3"][0]
    assert ranks.describe(resolve({}, environ)) == SRUN_LINES


def test_describe_shortens_a_long_host_list_and_handles_nothing_found():
    r = resolve({}, {"SLURM_NODELIST": "n[1-6]"})
    assert "hosts             n1,n2,n3,n4,... (6 hosts)   (from SLURM_NODELIST)" in ranks.describe(
        r
    )
    assert ranks.describe(resolve({}, {}))[1] == "rank              -   (not set)"


def run_env(argv, environ, capsys):
    """Run `rudra-zmq env ARGV` through add_parser; return (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="rudra-zmq")
    ranks.add_parser(parser.add_subparsers(dest="command", required=True), environ=environ)
    args = parser.parse_args(["env", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_env_prints_what_the_launcher_says(capsys):
    environ = LAUNCHERS["srun -n 4 on node[1-2], 2 tasks per node, task 3"][0]
    rc, out, err = run_env([], environ, capsys)
    assert (rc, out.splitlines(), err) == (0, SRUN_LINES, "")


def test_env_flags_override_the_environment(capsys):
    rc, out, _ = run_env(
        [
            "--rank",
            "1",
            "--world-size",
            "2",
            "--role",
            "learner",
            "--master-addr",
            "10.1.2.3",
            "--master-port",
            "5555",
            "--local-rank",
            "0",
        ],
        {"RANK": "7", "WORLD_SIZE": "8"},
        capsys,
    )
    assert rc == 0
    assert out.splitlines()[:7] == [
        "role              learner    (from --role)",
        "rank              1          (from --rank)",
        "world_size        2          (from --world-size)",
        "local_rank        0          (from --local-rank)",
        "local_world_size  -          (not set)",
        "master_addr       10.1.2.3   (from --master-addr)",
        "master_port       5555       (from --master-port)",
    ]


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (
            ["--rank", "5", "--world-size", "2"],
            {},
            "rudra-zmq: error: rank 5 (from --rank=5) is not below world_size 2 (from --world-size=2)",
        ),
        (["--role", "ps"], {}, "rudra-zmq: error: --role='ps' is not valid"),
        ([], {"MASTER_PORT": "0"}, "rudra-zmq: error: MASTER_PORT='0' is not valid"),
    ],
)
def test_env_exits_2_with_the_error_on_stderr(argv, environ, message, capsys):
    rc, out, err = run_env(argv, environ, capsys)
    assert (rc, out) == (2, "")
    assert err.startswith(message)
    assert err.count("\n") == 1
