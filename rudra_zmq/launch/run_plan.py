"""The plan of one ``rudra-zmq run``: the run directory, the servers' endpoints, the learner
processes and each role's environment (thread counts, malloc tuning). Pure planning: it
creates the run directory and probes for free ports, and starts nothing
(:mod:`rudra_zmq.launch.launcher` does). Functions do not block beyond that; thread-safe.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from .. import config as config_mod
from .. import devices, plan_endpoints, topology
from ..config import ConfigError
from ..run_files import CONFIG_FILE, KEYS_DIR, config_path, log_dir
from ..shape import ClusterShape
from ..sync import protocol_label

# glibc would give each large ZeroMQ buffer a fresh mmap (~16k page faults per 40 MB
# message, measured with pyzmq 27 / libzmq 4.3.5); these make it reuse heap memory instead, from
# process start.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "2147483647",
}

SERVERS = ("ps", "data", "stats")  # the servers of every run


@dataclass
class Plan:
    """What :func:`rudra_zmq.launch.launcher.run` will start: the config, the run directory, the endpoints of the
    servers (ps, data, stats) and the learner ids of each learner process."""

    cfg: config_mod.Config
    run_dir: Path
    endpoints: dict[str, str]  # by label: ps, data, stats, node0, node1, ...
    learner_groups: list[list[int]]
    tree: topology.Tree | None = None  # architecture.kind adv
    binds: dict[str, str] | None = None  # by label, where a server binds when that is not
    # its endpoint (a cluster launch binds every interface and is reached by host name)

    def bind(self, label: str) -> str:
        """The endpoint the server ``label`` binds (its endpoint, unless ``binds`` says)."""
        return (self.binds or {}).get(label, self.endpoints[label])

    @cached_property
    def shape(self) -> ClusterShape:
        """The cluster's shape: the parameter servers, their labels and tree plan."""
        return ClusterShape.of(self.cfg)


def make_run_dir(cfg, run_dir=None, resume: bool = False) -> Path:
    """Create and return the run directory (``logs/`` inside it). Without ``run_dir`` it is
    ``runtime.run_dir/NAME-YYYYmmdd-HHMMSS``, made unique with a ``-2``, ``-3`` suffix. A
    ``run_dir`` that already holds a run is refused unless ``resume``."""
    try:
        if run_dir is not None:
            path = Path(run_dir).absolute()
            if config_path(path).exists() and not resume:
                raise ConfigError(
                    f"{path} already holds a run (its {CONFIG_FILE} is there); "
                    f"continue it with `rudra-zmq run --resume {path}` or give "
                    "another --run-dir"
                )
            path.mkdir(parents=True, exist_ok=True)
        else:
            parent = Path(cfg.runtime.run_dir).absolute()
            parent.mkdir(parents=True, exist_ok=True)
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            base = f"{cfg.name}-{stamp}"
            for i in range(1, 1000):
                path = parent / (base if i == 1 else f"{base}-{i}")
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    continue
            else:
                raise ConfigError(f"could not find a free run directory name {base}-N in {parent}")
        log_dir(path).mkdir(exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the run directory ({exc}); set runtime.run_dir "
            "or --run-dir to a writable folder"
        ) from None
    return path


def endpoints(cfg, run_dir: Path | None) -> dict[str, str]:
    """Endpoints for ps (and ps1.. of a sharded run), data and stats: free tcp ports on
    runtime.host (``run_dir`` unused: None plans them before the directory exists), or ipc
    sockets in the run directory when runtime.transport is ipc. Raises ConfigError naming a
    bad runtime.host, a bad ``$RUDRA_ZMQ_PORTS`` or an ipc path too long."""
    labels = [*SERVERS, *ClusterShape.of(cfg).labels[1:]]
    return {role: plan_endpoints.server_endpoint(cfg, run_dir, role) for role in labels}


def learner_groups(cfg) -> list[list[int]]:
    """Learner ids per process: ceil(λ / runtime.learners_per_process) contiguous groups."""
    n, k = cfg.sync.learners, cfg.runtime.learners_per_process
    return [list(range(i * k, min((i + 1) * k, n))) for i in range(math.ceil(n / k))]


def role_env(
    cfg, role: str, learners_here: int | None = None, base: dict | None = None
) -> dict[str, str]:
    """The child environment: thread counts per role, unbuffered output, malloc tuning.
    ``learners_here``: learners on the role's host (default λ: all on this one); ``base``:
    the environment to extend (default ``os.environ``)."""
    here = cfg.sync.learners if learners_here is None else learners_here
    cores = devices.usable_cores()
    busy = here * devices.learner_threads(cfg, max(here, 1))
    # The PS shares this machine with the learners: by default give its kernels the cores the
    # learners leave (at least 1, at most 4 — memory bandwidth saturates before that). Two
    # kernel threads on a box the learners keep busy were 1.7x slower than one and burned
    # 1.8-3.4x the CPU per update (`git show ec5276f:bench/RESULTS.md`, push+pull).
    ps = cfg.runtime.ps_threads or max(1, min(4, cores - busy))
    threads = {"learner": devices.learner_threads(cfg, max(here, 1)), "ps": ps}.get(role, 1)
    env = dict(os.environ if base is None else base)
    env.update(
        MALLOC_ENV,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        # each role asks to be sent SIGTERM if this launcher dies
        # (role_process.follow_launcher)
        RUDRA_ZMQ_LAUNCHER_PID=str(os.getpid()),
    )
    env[devices.HOST_LEARNERS_ENV] = str(max(here, 1))
    if busy + ps > cores:
        # Oversubscribed: OpenMP threads that spin while waiting steal the cores other
        # processes compute on (2 learners x 2 threads on 2 cores: 0.49x; passive: 1.15x).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if role == "ps":
        env["RUDRA_ZMQ_PS_THREADS"] = str(ps)
    return env


def make_plan(cfg, run_dir=None, resume: bool = False) -> Plan:
    """Create the run directory (with the resolved ``config.yaml``) and plan every endpoint
    and learner group of the run (``resume``: of the run already in ``run_dir``). Raises
    ConfigError for a bad directory or endpoint, before the directory exists where it can."""
    # tcp ports need no directory: a bad runtime.host or $RUDRA_ZMQ_PORTS then leaves none
    eps = None if cfg.runtime.transport == "ipc" else endpoints(cfg, None)
    fresh = run_dir is None or not Path(run_dir).exists()
    path = make_run_dir(cfg, run_dir, resume)
    try:  # ipc paths need the directory's name: one too long removes the directory made here
        plan = _plan(cfg, path, eps or endpoints(cfg, path))
    except ConfigError:
        if fresh:
            shutil.rmtree(path, ignore_errors=True)
        raise
    config_mod.save(cfg, config_path(path))
    return plan


def _plan(cfg, path: Path, eps: dict[str, str]) -> Plan:
    """The plan of a run in ``path`` whose servers listen on ``eps``, with the endpoints of
    its tree nodes or broadcast added. Raises ConfigError."""
    tree = topology.tree_of(cfg)
    if cfg.architecture.kind == "advstar":
        eps.update(topology.broadcast_endpoints(cfg, path))
    if tree is None:
        return Plan(cfg, path, eps, learner_groups(cfg))
    eps.update(topology.node_endpoints(cfg, ClusterShape.of(cfg).tree_processes(), path))
    return Plan(
        cfg, path, eps, topology.learner_groups(tree, cfg.runtime.learners_per_process), tree
    )


def learner_endpoints(plan: Plan, learner: int) -> dict:
    """Where learner ``learner`` connects: its PS (the root, or its leaf tree node), the data
    and stats servers, and (advstar) its broadcast (upstream, bind or None)."""
    ep, cfg = plan.endpoints, plan.cfg
    ps = ",".join(ep[label] for label in plan.shape.first_hops(learner))  # in range order
    out = {"ps": ps, "data": ep["data"], "stats": ep["stats"], "bcast": None}
    if cfg.architecture.kind == "advstar":
        up = topology.broadcast_upstream(cfg, learner)
        mine = f"bcast{learner}"
        out["bcast"] = (
            ep["bcast" if up is None else f"bcast{up}"],
            plan.bind(mine) if mine in ep else None,
        )
    return out


def learner_label(ids: list[int]) -> str:
    """The label of the learner process running ``ids``: learner3, learner0-3, learner0+4."""
    if len(ids) == 1:
        return f"learner{ids[0]}"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"learner{ids[0]}-{ids[-1]}"
    return "learner" + "+".join(map(str, ids))  # a leaf of architecture.leaves


class Start(NamedTuple):
    """One role to start: ``label`` (ps, learner0-3, ...), ``role`` (its subcommand),
    ``args`` (its command-line arguments without ``--config``) and ``after``: the servers
    (labels) that must accept connections before it starts, those it sends to."""

    label: str
    role: str
    args: list[str]
    after: tuple[str, ...]


def role_steps(plan: Plan, resume: bool = False) -> list[Start]:
    """Every role of the run, in start order (stats, data, PS, tree nodes top level first,
    learners), each with the servers it waits for (``Start.after``): the PS for the stats
    server, a tree node for its parent, a learner for its PS or tree node, the data and the
    stats server. Roles whose servers listen start side by side."""
    ep, bind, shape = plan.endpoints, plan.bind, plan.shape
    again = ["--resume"] if resume else []
    starts = [
        Start(
            "stats", "stats", ["--bind", bind("stats"), "--run-dir", str(plan.run_dir), *again], ()
        ),
        Start("data", "data", ["--bind", bind("data")], ()),
    ]
    for server in shape.servers:
        starts.append(
            Start(
                server.label,
                "ps",
                [
                    "--bind",
                    bind(server.label),
                    "--stats",
                    ep["stats"],
                    "--run-dir",
                    str(plan.run_dir),
                    *again,
                    *(["--bcast-bind", bind("bcast")] if "bcast" in ep else []),
                    *server.args,
                ],
                ("stats",),
            )
        )
    tree = plan.tree
    for level in range(max((n.level for n in tree.nodes), default=0) if tree else 0, 0, -1):
        for label, n, k in shape.tree_processes():
            if n.level == level:  # range k's tree relays to server k
                server = shape.server(k)
                parent = server.label if n.parent is None else shape.node_label(n.parent, k)
                starts.append(
                    Start(
                        label,
                        "node",
                        [
                            "--id",
                            str(n.id),
                            "--bind",
                            bind(label),
                            "--parent",
                            ep[parent],
                            *server.args,
                        ],
                        (parent,),
                    )
                )
    for ids in plan.learner_groups:
        mine = learner_endpoints(plan, ids[0])
        args = [
            "--id",
            ",".join(map(str, ids)),
            "--ps",
            mine["ps"],
            "--data",
            ep["data"],
            "--stats",
            ep["stats"],
        ]
        if plan.cfg.architecture.kind == "advstar":
            eps = [learner_endpoints(plan, i)["bcast"] for i in ids]
            args += [
                "--bcast-upstream",
                ",".join(up for up, _ in eps),
                "--bcast-bind",
                ",".join(b or "none" for _, b in eps),
            ]
        parents = shape.first_hops(ids[0])  # the servers, or its leaf in each range's tree
        starts.append(Start(learner_label(ids), "learner", args, (*parents, "data", "stats")))
    return starts


def summary(plan: Plan) -> str:
    cfg = plan.cfg
    s = cfg.sync
    proto = protocol_label(s.protocol, s.n)
    lines = [
        f"rudra-zmq run {cfg.name!r}: {proto}, lambda={s.learners} learners "
        f"({len(plan.learner_groups)} processes), mu={s.batch_size} per learner",
        f"  model {cfg.model.name}, dataset {cfg.data.dataset}, {cfg.train.epochs:g} epochs",
        f"  run directory {plan.run_dir}",
        "  endpoints "
        + ", ".join(
            f"{r} {ep}"
            for r, ep in plan.endpoints.items()
            if r in (*plan.shape.labels, "data", "stats")
        ),
    ]
    lines += [f"  {line}" for line in plan.shape.describe()]
    if plan.tree is not None:
        lines += [
            f"  {line}, {plan.endpoints[f'node{n.id}']}"
            for n, line in zip(plan.tree.nodes, plan.tree.describe())
        ]
        lines += [f"  {line}" for line in plan.shape.describe_trees()]
    if cfg.architecture.kind == "advstar":
        lines += [f"  {line}" for line in topology.describe_broadcast(cfg)]
    return "\n".join(lines)


def run_keys(plan: Plan) -> Path:
    """Make (or, resumed, reuse) ``RUN_DIR/keys``: the servers' key pair and a client key per
    learner, per tree node and for the PS (``security.curve`` under ``rudra-zmq run``)."""
    from ..security import keys

    directory = plan.run_dir / KEYS_DIR
    if (directory / "server.key").exists():
        return directory
    names = [f"learner-{i}" for i in range(plan.cfg.sync.learners)] + ["ps"]  # every server
    if plan.tree is not None:
        names += [f"node-{n.id}" for n in plan.tree.nodes]
    keys.make_run_keys(directory, names)
    return directory
