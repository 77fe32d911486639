"""``rudra-zmq ps|learner|node|data|stats``: one role each, with explicit endpoints, so that a
run can be spread over several machines by hand; and what every command of ``cli.py`` shares
(``--config``/``--set``, the config they name, ``UsageError``).

Each role's module (and torch) is imported inside its command only, by
:func:`rudra_zmq.launch.role_process.serve`, so a role's start-up pays for nothing else. Each command
blocks while its role runs and returns its exit code; config problems raise ``UsageError``
(``rudra-zmq: error: MESSAGE``, exit 2).
"""

from __future__ import annotations

import argparse

from ..config import ConfigError, load_config
from ..devices import host_learners, learner_threads, ps_threads
from ..shape import ClusterShape
from . import role_process


class UsageError(Exception):
    """A bad config or argument value: printed as ``rudra-zmq: error: ...``, exit code 2."""


def config_of(args):
    """The config named by --config with the --set overrides applied, or UsageError."""
    from .. import transport

    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    transport.set_heartbeat(cfg.runtime.heartbeat_s)  # every socket this role makes
    if hasattr(args, "keys") and cfg.security.curve:  # a role: CURVE on every socket
        from ..security import auth

        try:
            transport.set_security(auth.for_role(cfg, args.keys, args.key))
        except (auth.SecurityError, OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    return cfg


def parse_ids(text: str) -> list[int]:
    """``"3"`` or ``"0,1,2"`` -> list of learner ids (argparse type)."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--id must be learner ids separated by commas, like 0 or 0,1,2; got {text!r}"
        ) from None
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"--id must be distinct ids >= 0, got {text!r}")
    return ids


# ----------------------------------------------------------------------------- roles
def cmd_ps(args) -> int:
    cfg = config_of(args)
    if args.resume and not args.run_dir:
        raise UsageError("--resume continues from the checkpoints in --run-dir DIR; give it")
    if (cfg.architecture.kind == "advstar") != bool(args.bcast_bind):
        raise UsageError(
            "--bcast-bind (the endpoint the broadcast root binds) is needed with "
            "architecture.kind=advstar, and only then (the config says "
            f"{cfg.architecture.kind!r})"
        )
    extra = {"broadcast": args.bcast_bind} if args.bcast_bind else {}
    extra["server"] = _server(cfg, args.shard, "server")
    # torch is imported later, after the PS binds (``ParameterServer``), for its initial
    # weights only: its thread count does not matter, and learners start meanwhile
    return role_process.serve(
        "rudra_zmq.server.ps",
        ps_threads(cfg),
        False,
        lambda m: m.serve(cfg, args.bind, args.stats, args.run_dir, resume=args.resume, **extra),
    )


def _bcast_args(cfg, args) -> tuple[list | None, list | None]:
    """The learners' broadcast endpoints (advstar): one upstream and one bind (or none) per
    --id, checked against the plan; (None, None) for other architectures."""
    from ..topology import broadcast_children

    if cfg.architecture.kind != "advstar":
        if args.bcast_upstream or args.bcast_bind:
            raise UsageError(
                "--bcast-upstream/--bcast-bind are for architecture.kind=advstar "
                f"(the config says {cfg.architecture.kind!r})"
            )
        return None, None
    ups = args.bcast_upstream.split(",") if args.bcast_upstream else []
    binds = args.bcast_bind.split(",") if args.bcast_bind else ["none"] * len(args.id)
    if len(ups) != len(args.id) or len(binds) != len(args.id):
        raise UsageError(
            f"architecture.kind=advstar: give one --bcast-upstream and one "
            f"--bcast-bind endpoint per learner id ({len(args.id)}), separated by "
            f"commas; got {len(ups)} and {len(binds)}"
        )
    binds = [None if b.lower() == "none" else b for b in binds]
    for i, b in zip(args.id, binds):
        kids = broadcast_children(cfg, i)
        if kids and b is None:
            raise UsageError(
                f"learner {i} forwards the broadcast to learners "
                f"{','.join(map(str, kids))}: give it a --bcast-bind endpoint"
            )
    return ups, binds


def cmd_learner(args) -> int:
    cfg = config_of(args)
    bad = [i for i in args.id if i >= cfg.sync.learners]
    if bad:
        raise UsageError(
            f"--id {','.join(map(str, bad))}: learner ids run from 0 to "
            f"sync.learners-1 = {cfg.sync.learners - 1}"
        )
    ups, binds = _bcast_args(cfg, args)
    extra = {} if ups is None else {"bcast_upstream": ups, "bcast_bind": binds}
    ps, k = args.ps.split(","), len(ClusterShape.of(cfg).servers)
    if len(ps) != k:
        raise UsageError(
            f"--ps names {len(ps)} parameter servers; the config has "
            f"architecture.servers={k}: give each server's endpoint "
            "(Rudra-adv: the leaf of each range's tree), in range order, separated by commas"
        )
    # threads: the usable cores over the learners on this host (as the launcher said, else
    # this process's own learners)
    threads = learner_threads(cfg, host_learners(cfg, default=len(args.id)))
    return role_process.serve(
        "rudra_zmq.learner.learner",
        threads,
        True,
        lambda m: m.serve(
            cfg, args.id, ps, args.data, args.stats, finished_in=args.finished_in, **extra
        ),
    )


def _server(cfg, shard: int | None, what: str) -> int:
    """The server (or the range of a tree node) ``--shard`` names: 0..K-1 of the run's K
    servers, required when K > 1, 0 or absent otherwise (``ClusterShape.pick``). Raises
    UsageError naming the value."""
    try:
        return ClusterShape.of(cfg).pick(shard, what).index
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_node(args) -> int:
    cfg = config_of(args)
    if cfg.architecture.kind not in ("adv", "advstar"):
        raise UsageError(
            "rudra-zmq node runs a node of a PS tree: set architecture.kind=adv "
            f"or advstar (the config says {cfg.architecture.kind!r})"
        )
    from ..topology import plan

    try:
        plan(cfg).node(args.id)
    except ValueError as exc:
        raise UsageError(f"--id {args.id}: {exc}") from None
    shard = _server(cfg, args.shard, "tree node")
    return role_process.serve(
        "rudra_zmq.tree.node",
        1,
        False,
        lambda m: m.serve(cfg, args.id, args.bind, args.parent, shard),
    )


def cmd_data(args) -> int:
    cfg = config_of(args)
    return role_process.serve("rudra_zmq.data.server", 1, False, lambda m: m.serve(cfg, args.bind))


def cmd_stats(args) -> int:
    cfg = config_of(args)
    return role_process.serve(
        "rudra_zmq.stats.server",
        1,
        False,
        lambda m: m.serve(cfg, args.bind, args.run_dir, resume=args.resume),
    )


# ----------------------------------------------------------------------------- parsers
def config_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("config", metavar="CONFIG", nargs="?", help="YAML config file")
    else:
        p.add_argument("--config", required=True, metavar="C", help="YAML config file")
        p.add_argument(
            "--keys",
            metavar="DIR",
            help="security.curve: the key directory (`rudra-zmq keys init DIR`; default: security.keys)",
        )
        p.add_argument(
            "--key",
            metavar="NAME",
            help="security.curve: the client key to use (default: learner-N, node-N or ps, by role)",
        )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set sync.learners=8 (repeatable)",
    )


def add_ps(sub) -> None:
    p = sub.add_parser("ps", help="run the parameter server")
    config_args(p)
    p.add_argument(
        "--bind",
        required=True,
        metavar="ENDPOINT",
        help="endpoint to bind, e.g. tcp://0.0.0.0:5555",
    )
    p.add_argument("--stats", metavar="ENDPOINT", help="stats server to report to")
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where to write the weights and checkpoints (DIR/checkpoints)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --run-dir, as a new "
        "incarnation (learners rejoin by themselves)",
    )
    p.add_argument(
        "--bcast-bind",
        metavar="ENDPOINT",
        help="advstar: endpoint the broadcast root binds (its first members connect there)",
    )
    p.add_argument(
        "--shard",
        type=int,
        metavar="I",
        help="architecture.servers > 1: serve the I-th range of the flat vector (0-based)",
    )
    p.set_defaults(func=cmd_ps)


def add_learner(sub) -> None:
    p = sub.add_parser("learner", help="run one or more learners in this process")
    config_args(p)
    p.add_argument(
        "--id",
        required=True,
        type=parse_ids,
        metavar="I[,J,...]",
        help="learner id(s), 0 .. sync.learners-1",
    )
    p.add_argument(
        "--ps",
        required=True,
        metavar="EP[,EP...]",
        help="parameter server; with architecture.servers=K, the K servers' endpoints in "
        "range order",
    )
    p.add_argument("--data", required=True, metavar="ENDPOINT", help="data server")
    p.add_argument("--stats", metavar="ENDPOINT", help="stats server to report to")
    p.add_argument(
        "--bcast-upstream",
        metavar="EP[,EP...]",
        help="advstar: per --id, the broadcast upstream (the PS's --bcast-bind or "
        "its upstream learner's --bcast-bind)",
    )
    p.add_argument(
        "--bcast-bind",
        metavar="EP[,EP...]",
        help="advstar: per --id, the endpoint it binds for its broadcast children, "
        "or none (default: none for all)",
    )
    p.add_argument(
        "--finished-in",
        metavar="RUN_DIR",
        help="architecture.servers > 1: the servers whose ps_final.json in this run directory "
        "says training is done are left out, their ranges taken from their final weights (the "
        "launcher gives it to a learner it restarts after some servers finished)",
    )
    p.set_defaults(func=cmd_learner)


def add_node(sub) -> None:
    p = sub.add_parser(
        "node",
        help="run one node of a PS tree (architecture.kind=adv)",
        description="A Rudra-adv tree node: sums the gradients of its children "
        "(learners, or tree nodes) and relays them to its parent "
        "(a tree node or the parameter server). Node ids: leaves "
        "first, then each level above (see `rudra-zmq run`'s plan).",
    )
    config_args(p)
    p.add_argument("--id", required=True, type=int, metavar="K", help="tree node id")
    p.add_argument(
        "--bind",
        required=True,
        metavar="ENDPOINT",
        help="endpoint its children connect to, e.g. ipc:///tmp/rudra-node0.sock",
    )
    p.add_argument(
        "--parent",
        required=True,
        metavar="ENDPOINT",
        help="its parent: the parameter server or a tree node",
    )
    p.add_argument(
        "--shard",
        type=int,
        metavar="I",
        help="architecture.servers > 1: a node of the tree of server I's range (0..K-1)",
    )
    p.set_defaults(func=cmd_node)


def add_data(sub) -> None:
    p = sub.add_parser("data", help="run the data server (until SIGTERM or Ctrl-C)")
    config_args(p)
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="endpoint to bind")
    p.set_defaults(func=cmd_data)


def add_stats(sub) -> None:
    p = sub.add_parser("stats", help="run the statistics server (until training ends)")
    config_args(p)
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="endpoint to bind")
    p.add_argument(
        "--run-dir",
        required=True,
        metavar="DIR",
        help="run directory for metrics, summary and plots",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="the run is resumed: mark it in metrics.jsonl (which is always appended to)",
    )
    p.set_defaults(func=cmd_stats)


# command -> the function that adds its parser, in the order --help lists them
PARSERS = {
    "ps": add_ps,
    "learner": add_learner,
    "node": add_node,
    "data": add_data,
    "stats": add_stats,
}
