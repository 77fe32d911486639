"""``rudra-zmq worker CONFIG``: one rank of a run started by srun, mpirun or a torchrun-style
launcher, which starts the same command once per rank and sets each rank's variables.

Each process finds its rank (:mod:`rudra_zmq.launch.ranks`: command line, ``RUDRA_*``, ``DMLC_*``,
torchrun, Open MPI, PMI, SLURM) and takes its part:

- rank 0 (or role ``servers``: ``DMLC_ROLE=server|scheduler``) runs the statistics server,
  the data server, the PS and every tree node on its host, supervised as under ``rudra-zmq
  run``, and writes the run directory;
- rank r >= 1 (or role ``learner`` with ``DMLC_WORKER_ID`` = r - 1) runs learner process r - 1
  of the plan (``runtime.learners_per_process`` learners each).

So a run needs 1 + (learner processes) ranks; the error says how many when they differ. The
servers are reached at the master address (``MASTER_ADDR``, ``DMLC_PS_ROOT_URI``, the first
SLURM host, ...) at ports counted from the master port (default 29500; one above torchrun's
``MASTER_PORT``, which its own rendezvous may hold), and bind what it says
(``cluster_plan.bind_address``: an IP address exactly, ``localhost`` as 127.0.0.1, every
interface for another name). ``security.curve`` unset means CurveZMQ when the master is not
loopback and ``security.keys`` names a key directory (every rank must read it: worker cannot
copy keys); plaintext beyond loopback is said once on rank 0's terminal (:func:`security_of`). Ranks may start in any order: a learner
waits up to ``runtime.timeout_s`` for the servers and then names the one that did not answer.
Rudra-adv\\* is not planned here (its broadcast needs every learner's host): use
``rudra-zmq launch``. Blocks until the rank's part is done.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from .. import config as config_mod
from .. import topology
from ..config import ConfigError
from ..devices import HOST_LEARNERS_ENV
from ..run_files import config_path
from ..shape import ClusterShape
from . import preflight, ranks
from .cluster_plan import DEFAULT_PORT, bind_address, is_loopback_host
from .run_plan import (
    Plan,
    learner_endpoints,
    learner_groups,
    make_run_dir,
)

REPORT_FAILED_S = 10.0  # a server rank tells rank 0 its server gave up, for at most this long


def _groups(cfg, tree) -> list[list[int]]:
    per = cfg.runtime.learners_per_process
    return topology.learner_groups(tree, per) if tree else learner_groups(cfg)


def server_ranks(cfg, r: ranks.Ranks) -> int:
    """How many ranks run one server each (ranks 1 .. K-1 of ``architecture.servers`` = K):
    K - 1 when the world has K + (learner processes) ranks, else 0 (rank 0 runs them all)."""
    k, world = len(ClusterShape.of(cfg).servers), r.value("world_size")
    n = len(_groups(cfg, topology.tree_of(cfg)))
    return k - 1 if world == n + k else 0


def part(cfg, r: ranks.Ranks) -> tuple[str, int | None]:
    """``("servers", None)``, ``("server", I)`` (server I of a sharded run, on a rank of its
    own) or ``("learner", index of the learner process)`` for ranks ``r``. Raises
    ConfigError when the ranks do not fit the config."""
    if cfg.architecture.kind == "advstar":
        raise ConfigError(
            "rudra-zmq worker plans Rudra-base and Rudra-adv; Rudra-adv* "
            "(architecture.kind=advstar) needs every learner's host: start it "
            "with `rudra-zmq launch CONFIG --hostfile F`"
        )
    tree = topology.tree_of(cfg)
    n = len(_groups(cfg, tree))
    servers = ClusterShape.of(cfg).servers
    k, others = len(servers), [s.index for s in servers[1:]]  # those a rank of their own may run
    world, rank = r.value("world_size"), r.value("rank")
    if world is not None and world not in (n + 1, n + k):
        also = f", or {n + k} to give servers 1..{k - 1} ranks of their own" if others else ""
        raise ConfigError(
            f"{world} ranks (from {r.world_size.source}) for a config with {n} learner "
            f"processes: start {n + 1} ranks (rank 0 runs the servers){also}, or change "
            "sync.learners / runtime.learners_per_process"
        )
    num = r.value("num_learners")
    if num is not None and num != n:
        raise ConfigError(
            f"{num} learners (from {r.num_learners.source}) but the config plans "
            f"{n} learner processes"
        )
    own = server_ranks(cfg, r)
    if own and tree is not None:
        raise ConfigError(
            f"{world} ranks give servers 1..{k - 1} ranks of their own, which "
            "architecture.kind=adv does not plan (its trees' top nodes are on rank 0, "
            f"beside server 0): start {n + 1} ranks, or use rudra-zmq launch --ps-hosts"
        )
    role = r.value("role")
    if role is None:
        if rank is None:
            raise ConfigError(
                "no rank found: run under srun, mpirun or torchrun, or set "
                "RUDRA_RANK (see `rudra-zmq env`)"
            )
        role = "servers" if rank == 0 else "server" if rank <= own else "learner"
    if role == "servers":
        return "servers", None
    if role == "server":
        if rank is None or not 1 <= rank <= own:
            raise ConfigError(
                f"role server needs a rank from 1 to {k - 1} and {n + k} ranks in all "
                f"(architecture.servers={k}, {n} learner processes); got rank {rank}, "
                f"{world} ranks"
            )
        return "server", rank
    index = r.value("learner_id")
    if index is None:
        if rank is None or rank <= own:
            raise ConfigError(f"a learner needs its index: DMLC_WORKER_ID or a rank >= {own + 1}")
        index = rank - 1 - own
    if index >= n:
        raise ConfigError(f"learner process {index} does not exist: the config plans {n}")
    return "learner", index


def plan(cfg, r: ranks.Ranks, run_dir=None, create: bool = False) -> Plan:
    """The run's endpoints on the master host (every server there), its learner groups and
    tree; ``create``: make the run directory and save the config (rank 0)."""
    master = r.value("master_addr")
    if master is None:
        raise ConfigError(
            "no master address: set MASTER_ADDR, RUDRA_MASTER_ADDR or "
            "DMLC_PS_ROOT_URI, or run under srun (see `rudra-zmq env`)"
        )
    port = r.value("master_port")
    if port is None:
        port = DEFAULT_PORT
    elif r.master_port.source == "MASTER_PORT":
        port += 1  # torchrun's rendezvous store may listen on MASTER_PORT itself
    tree = topology.tree_of(cfg)
    shape = ClusterShape.of(cfg)
    labels = ["ps", "data", "stats"]
    labels += [label for label, _, _ in shape.tree_processes()]
    labels += shape.labels[1:]  # the other servers (on rank 0 or ranks of their own)
    labels.append("directory")  # where ranks of their own register (server_directory.py)
    host = f"[{master}]" if ":" in master else master
    endpoints = {label: f"tcp://{host}:{port + i}" for i, label in enumerate(labels)}
    binds = {label: f"tcp://{bind_address(master)}:{port + i}" for i, label in enumerate(labels)}
    path = None
    if create:
        path = make_run_dir(cfg, run_dir)
        config_mod.save(cfg, config_path(path))
    return Plan(cfg, path, endpoints, _groups(cfg, tree), tree, binds)


def security_of(cfg, master: str):
    """``(cfg with security.curve decided, the terminal line or None)`` for ranks whose
    servers are at ``master``. Unset: on when ``master`` is not loopback and
    ``security.keys`` names a key directory. The line: plaintext beyond loopback. Raises
    ConfigError for CURVE without ``security.keys`` (no rank could get the others' keys)."""
    given, keys_dir = cfg.security.curve, cfg.security.keys
    across = not is_loopback_host(master)
    on = (across and bool(keys_dir)) if given is None else given
    if on and not keys_dir:
        raise ConfigError(
            "security.curve under `rudra-zmq worker` needs security.keys: a key "
            "directory every rank can read (rudra-zmq keys init DIR; keys add DIR "
            "learner-0 ... ps; copy it to each host; docs/security.md)"
        )
    line = None
    if across and not on:
        why = (
            "security.curve is false" if given is False else "security.keys names no key directory"
        )
        line = (
            f"rudra-zmq worker: warning: {why}, so the roles talk in PLAINTEXT across "
            f"hosts: anyone who can reach {master} can read the weights and the training "
            "data and push gradients; set security.keys to a key directory on every host "
            "to encrypt (docs/security.md)"
        )
    return dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, curve=on)), line


def _keys_dir(cfg) -> str | None:
    """``security.keys`` as an absolute path (the launcher's roles run elsewhere), or None."""
    return str(Path(cfg.security.keys).absolute()) if cfg.security.keys else None


def _curve(cfg):
    """This rank's CURVE settings (the key directory every rank reads), or None."""
    from ..security import auth

    return auth.for_role(cfg, None, None) if cfg.security.curve else None


def _servers(cfg, r, p, args, how: str, line) -> int:
    """Rank 0: stats, data, server 0 (every server when none has a rank of its own), tree
    nodes, and the directory where servers of their own register. Blocks."""
    from ..security import auth
    from .launcher import Launcher
    from .server_directory import Directory

    preflight.run(cfg)  # the data checked and decoded here, before anything is made
    p = plan(cfg, r, args.run_dir, create=True)
    print(
        f"rudra-zmq worker: rank {r.value('rank')}: the servers of {cfg.name!r} on "
        f"{r.value('master_addr')} ({how}), run directory {p.run_dir}",
        flush=True,
    )
    if line:
        print(line, file=sys.stderr, flush=True)
    servers = Plan(p.cfg, p.run_dir, p.endpoints, [], p.tree, p.binds)  # no learners here
    launcher = Launcher(servers, keys_dir=_keys_dir(cfg))
    local = r.value("local_world_size")
    launcher.learners_here = max(0, local - 1) if local else 0
    if not server_ranks(cfg, r):
        return launcher.run()
    launcher.local = set(p.endpoints) - set(p.shape.labels[1:])
    token = launcher.secrets[auth.RUN_TOKEN_ENV]
    d = Directory(
        cfg, p.bind("directory"), p.endpoints["ps"], p.run_dir, token, _curve(cfg)
    ).start()
    launcher.watch = d.failure  # a server rank that gave up: stop, not wait for its records
    try:
        return launcher.run()
    finally:
        d.stop()


def _server(cfg, r, p, index: int, how: str) -> int:
    """Rank ``index`` of a sharded run: server ``index`` on this host, registered with rank
    0's directory, supervised (restarted from its checkpoints) as under ``run``. Blocks."""
    from ..security import auth
    from .launcher import Launcher
    from .server_directory import Heartbeat, advertised_address, register, report_failed

    label = p.shape.server(index).label
    address = advertised_address(r.value("master_addr"))
    port = p.endpoints[label].rsplit(":", 1)[1]
    mine = f"tcp://{bind_address(address)}:{port}"  # an IP address: bound as itself
    run_dir, token = register(
        p.endpoints["directory"], index, mine, cfg.runtime.timeout_s, _curve(cfg)
    )
    run_dir = make_run_dir(cfg, run_dir, resume=True)  # rank 0's, or the same path here
    if not config_path(run_dir).exists():  # no shared file system: this host's copy
        config_mod.save(cfg, config_path(run_dir))
    print(
        f"rudra-zmq worker: rank {r.value('rank')}: server {index} of {cfg.name!r} at "
        f"{mine} ({how}), run directory {run_dir}",
        flush=True,
    )
    eps, binds = {**p.endpoints, label: mine}, {**(p.binds or {}), label: mine}
    launcher = Launcher(Plan(cfg, run_dir, eps, [], p.tree, binds), keys_dir=_keys_dir(cfg))
    launcher.secrets[auth.RUN_TOKEN_ENV] = token  # the stats server knows rank 0's
    launcher.local, launcher.processes_file = {label}, f"processes-{label}.json"

    def give_up(why: str) -> None:  # rank 0 stops the run, rather than wait for this server
        told = report_failed(p.endpoints["directory"], index, why, REPORT_FAILED_S, _curve(cfg))
        print(
            f"rudra-zmq worker: rank {r.value('rank')}: "
            + ("told rank 0" if told else f"rank 0 did not answer within {REPORT_FAILED_S:g} s")
            + f" that server {index} cannot go on ({why})",
            file=sys.stderr,
            flush=True,
        )

    launcher.on_give_up = give_up
    # rank 0 hears from us: silent for runtime.timeout_s, we would be taken for gone
    beat = Heartbeat(p.endpoints["directory"], index, _curve(cfg), cfg.runtime.timeout_s).start()
    try:
        return launcher.run()
    finally:
        beat.stop()


def run(args, environ=None) -> int:
    """``rudra-zmq worker``: resolve this rank and run its part. Blocks; returns the exit
    code. Raises ConfigError / RanksError before anything starts."""
    environ = os.environ if environ is None else environ
    r = ranks.resolve({k: getattr(args, k, None) for k in ranks.CLI_KEYS}, environ)
    cfg = config_mod.load_config(args.config, list(args.set))
    what, index = part(cfg, r)
    p = plan(cfg, r)  # checks the master address before anything is made
    cfg, line = security_of(cfg, r.value("master_addr"))
    how = "CurveZMQ" if cfg.security.curve else "plaintext"
    if what == "servers":
        return _servers(cfg, r, p, args, how, line)
    p = dataclasses.replace(p, cfg=cfg)
    if what == "server":
        return _server(cfg, r, p, index, how)
    ids = p.learner_groups[index]
    eps = learner_endpoints(p, ids[0])
    if server_ranks(cfg, r):  # servers on ranks of their own: ask rank 0 where
        from .server_directory import lookup

        found = lookup(
            p.endpoints["directory"],
            len(p.shape.servers),
            cfg.runtime.timeout_s,
            _curve(cfg),
            ids[0],
        )
        eps["ps"] = ",".join(found)
    local = r.value("local_world_size")
    if local:  # the ranks on this host share its cores
        os.environ[HOST_LEARNERS_ENV] = str(local * len(ids))
    print(
        f"rudra-zmq worker: rank {r.value('rank')}: learners {','.join(map(str, ids))} "
        f"-> {eps['ps']} ({how})",
        file=sys.stderr,
        flush=True,
    )
    sets = [
        x
        for s in [*args.set, f"security.curve={str(cfg.security.curve).lower()}"]
        for x in ("--set", s)
    ]
    argv = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "learner",
        "--config",
        args.config,
        *sets,
        "--id",
        ",".join(map(str, ids)),
        "--ps",
        eps["ps"],
        "--data",
        eps["data"],
        "--stats",
        eps["stats"],
    ]
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # this rank becomes the learner process (same pid)


def add_parser(sub) -> None:
    """Register ``rudra-zmq worker``."""
    p = sub.add_parser(
        "worker",
        help="run this rank's part of a run (under srun, mpirun, torchrun)",
        description="Start the same command once per rank: rank 0 runs the servers (stats, "
        "data, PS, tree nodes), rank r >= 1 runs learner process r-1; with "
        "architecture.servers=K and K-1 more ranks, ranks 1..K-1 run one server each "
        "and the learners follow them. The rank "
        "and the master address come from the command line or the launcher's "
        "variables (`rudra-zmq env` shows what was found and where).",
    )
    p.add_argument("config", metavar="CONFIG", help="YAML config file (the same on every rank)")
    p.add_argument("--rank", type=int, help="this process's rank")
    p.add_argument("--world-size", type=int, help="how many ranks")
    p.add_argument("--local-rank", type=int, help="rank among this host's ranks")
    p.add_argument("--role", help="servers, server or learner (default: from the rank)")
    p.add_argument("--master-addr", metavar="HOST", help="the servers' host")
    p.add_argument(
        "--master-port",
        type=int,
        metavar="PORT",
        help=f"first server port (default {DEFAULT_PORT})",
    )
    p.add_argument("--run-dir", metavar="DIR", help="rank 0's run directory")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable; the same on every rank)",
    )
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args) -> int:
    try:
        return run(args)
    except (ConfigError, ranks.RanksError, FileNotFoundError) as exc:
        print(f"rudra-zmq: error: {exc}", file=sys.stderr)
        return 2
