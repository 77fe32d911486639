"""The ``rudra-zmq`` command line (also ``python -m rudra_zmq``).

``rudra-zmq run CONFIG`` starts a whole run on this machine (see :mod:`rudra_zmq.launcher`);
``rudra-zmq ps|learner|node|data|stats`` start one role each, with explicit endpoints, so the same
run can be spread over several machines by hand. ``rudra-zmq simulate CONFIG`` runs the sync protocol in one process with
simulated learner speeds (see :mod:`rudra_zmq.simulator`); ``rudra-zmq info`` reports the build.

Role modules (and torch) are imported inside their subcommand only, and a command line builds
only its own subcommand's parser (the commands of other modules, ``TOOLS``, load only for
their own command or ``--help``), so a role's start-up pays for nothing else;
:mod:`rudra_zmq.role_process` prepares a role's process and runs it.
Config problems print ``rudra-zmq: error: MESSAGE`` and exit 2; a role that fails at run time
raises, and its traceback is what its log should show.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time

from . import role_process
from .config import ConfigError, load_config, scale_schedule
from .run_plan import host_learners, learner_threads, ps_threads, usable_cores

PROG = "rudra-zmq"


class _UsageError(Exception):
    """A bad config or argument value: printed as ``rudra-zmq: error: ...``, exit code 2."""


# ----------------------------------------------------------------------------- helpers
def _load(args):
    """The config named by --config with the --set overrides applied, or _UsageError."""
    from . import transport

    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, FileNotFoundError) as exc:
        raise _UsageError(str(exc)) from None
    transport.set_heartbeat(cfg.runtime.heartbeat_s)   # every socket this role makes
    if hasattr(args, "keys") and cfg.security.curve:     # a role: CURVE on every socket
        from . import security

        try:
            transport.set_security(security.for_role(cfg, args.keys, args.key))
        except (security.SecurityError, OSError, ValueError) as exc:
            raise _UsageError(str(exc)) from None
    return cfg


def _parse_ids(text: str) -> list[int]:
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


# ----------------------------------------------------------------------------- subcommands
def cmd_run(args) -> int:
    from . import launcher

    try:
        if args.resume is None and args.config is None:
            raise _UsageError("give a CONFIG to start a run, or --resume RUN_DIR to continue one")
        if args.resume is not None and args.run_dir is not None:
            raise _UsageError("--run-dir starts a new run; --resume RUN_DIR continues the run "
                              "there: give one of them")
        return launcher.run(args.config, args.set, run_dir=args.run_dir, resume=args.resume)
    except (ConfigError, FileNotFoundError) as exc:  # raised before any process starts
        raise _UsageError(str(exc)) from None


def cmd_ps(args) -> int:
    cfg = _load(args)
    if args.resume and not args.run_dir:
        raise _UsageError("--resume continues from the checkpoints in --run-dir DIR; give it")
    if (cfg.architecture.kind == "advstar") != bool(args.bcast_bind):
        raise _UsageError("--bcast-bind (the endpoint the broadcast root binds) is needed with "
                          "architecture.kind=advstar, and only then (the config says "
                          f"{cfg.architecture.kind!r})")
    extra = {"broadcast": args.bcast_bind} if args.bcast_bind else {}
    # torch is imported later, after the PS binds (``ParameterServer``), for its initial
    # weights only: its thread count does not matter, and learners start meanwhile
    return role_process.serve("ps", ps_threads(cfg), False,
                              lambda m: m.serve(cfg, args.bind, args.stats, args.run_dir,
                                                resume=args.resume, **extra))


def _bcast_args(cfg, args) -> tuple[list | None, list | None]:
    """The learners' broadcast endpoints (advstar): one upstream and one bind (or none) per
    --id, checked against the plan; (None, None) for other architectures."""
    from .topology import broadcast_children

    if cfg.architecture.kind != "advstar":
        if args.bcast_upstream or args.bcast_bind:
            raise _UsageError("--bcast-upstream/--bcast-bind are for architecture.kind=advstar "
                              f"(the config says {cfg.architecture.kind!r})")
        return None, None
    ups = args.bcast_upstream.split(",") if args.bcast_upstream else []
    binds = args.bcast_bind.split(",") if args.bcast_bind else ["none"] * len(args.id)
    if len(ups) != len(args.id) or len(binds) != len(args.id):
        raise _UsageError(f"architecture.kind=advstar: give one --bcast-upstream and one "
                          f"--bcast-bind endpoint per learner id ({len(args.id)}), separated by "
                          f"commas; got {len(ups)} and {len(binds)}")
    binds = [None if b.lower() == "none" else b for b in binds]
    for i, b in zip(args.id, binds):
        kids = broadcast_children(cfg, i)
        if kids and b is None:
            raise _UsageError(f"learner {i} forwards the broadcast to learners "
                              f"{','.join(map(str, kids))}: give it a --bcast-bind endpoint")
    return ups, binds


def cmd_learner(args) -> int:
    cfg = _load(args)
    bad = [i for i in args.id if i >= cfg.sync.learners]
    if bad:
        raise _UsageError(f"--id {','.join(map(str, bad))}: learner ids run from 0 to "
                          f"sync.learners-1 = {cfg.sync.learners - 1}")
    ups, binds = _bcast_args(cfg, args)
    extra = {} if ups is None else {"bcast_upstream": ups, "bcast_bind": binds}
    # threads: the usable cores over the learners on this host (as the launcher said, else
    # this process's own learners)
    threads = learner_threads(cfg, host_learners(cfg, default=len(args.id)))
    return role_process.serve("learner", threads, True,
                              lambda m: m.serve(cfg, args.id, args.ps, args.data, args.stats,
                                                **extra))


def cmd_node(args) -> int:
    cfg = _load(args)
    if cfg.architecture.kind not in ("adv", "advstar"):
        raise _UsageError("rudra-zmq node runs a node of a PS tree: set architecture.kind=adv "
                          f"or advstar (the config says {cfg.architecture.kind!r})")
    from .topology import plan

    try:
        plan(cfg).node(args.id)
    except ValueError as exc:
        raise _UsageError(f"--id {args.id}: {exc}") from None
    return role_process.serve("tree_node", 1, False,
                              lambda m: m.serve(cfg, args.id, args.bind, args.parent))


def cmd_data(args) -> int:
    cfg = _load(args)
    return role_process.serve("data_server", 1, False, lambda m: m.serve(cfg, args.bind))


def cmd_stats(args) -> int:
    cfg = _load(args)
    return role_process.serve("stats_server", 1, False,
                              lambda m: m.serve(cfg, args.bind, args.run_dir, resume=args.resume))


def cmd_simulate(args) -> int:
    if args.schedule_scale != 1:   # epochs and lr steps scaled, recorded in the config
        try:
            args.set = list(args.set) + scale_schedule(args.config, args.set,
                                                       args.schedule_scale)
        except (ConfigError, FileNotFoundError) as exc:
            raise _UsageError(str(exc)) from None
    cfg = _load(args)
    speeds = None
    if args.speeds:
        try:
            speeds = [float(x) for x in args.speeds.split(",")]
        except ValueError:
            raise _UsageError(f"--speeds must be numbers separated by commas, got "
                              f"{args.speeds!r}") from None
    run_dir = args.run_dir or os.path.join(cfg.runtime.run_dir,
                                           f"{cfg.name}-sim-{time.strftime('%Y%m%d-%H%M%S')}")
    from . import simulator

    # The simulator computes one gradient at a time: every core, unless
    # runtime.threads_per_learner says otherwise (e.g. 1 beside another run).
    role_process.set_threads(cfg.runtime.threads_per_learner or usable_cores(),
                             torch_too=args.train)
    try:
        return simulator.main_simulate(cfg, run_dir, jitter=args.jitter, speeds=speeds,
                                       seed=args.seed, train=args.train,
                                       gradients=args.gradients)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def cmd_info(args) -> int:
    """Print the kernel build facts and library versions (does not import torch)."""
    from importlib import metadata

    import zmq

    import rudra_zmq

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    rows = [("rudra_zmq", rudra_zmq.__version__), ("python", sys.version.split()[0]),
            ("torch", version("torch")), ("pyzmq", zmq.pyzmq_version()),
            ("libzmq", zmq.zmq_version()), ("numpy", version("numpy"))]
    rows += sorted((f"build.{k}", v) for k, v in rudra_zmq.build_info().items())
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# ----------------------------------------------------------------------------- parser
def _config_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("config", metavar="CONFIG", nargs="?", help="YAML config file")
    else:
        p.add_argument("--config", required=True, metavar="C", help="YAML config file")
        p.add_argument("--keys", metavar="DIR", help="security.curve: the key directory "
                       "(`rudra-zmq keys init DIR`; default: security.keys)")
        p.add_argument("--key", metavar="NAME", help="security.curve: the client key to use "
                       "(default: learner-N, node-N or ps, by role)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sync.learners=8 (repeatable)")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run every role on this machine (one command, one run)",
                       description="Start the stats server, data server, parameter server "
                                   "and learners as processes on this machine, show progress,"
                                   " and stop them all when training ends or anything fails.")
    _config_args(p, positional=True)
    p.add_argument("--run-dir", metavar="DIR",
                   help="run directory (default: runtime.run_dir/NAME-YYYYmmdd-HHMMSS); one "
                        "that holds a run already is refused")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest valid checkpoint (CONFIG "
                        "optional; --set may change only train.epochs, evaluation and "
                        "checkpoint intervals and runtime.*)")
    p.set_defaults(func=cmd_run)


def _add_ps(sub) -> None:
    p = sub.add_parser("ps", help="run the parameter server")
    _config_args(p)
    p.add_argument("--bind", required=True, metavar="ENDPOINT",
                   help="endpoint to bind, e.g. tcp://0.0.0.0:5555")
    p.add_argument("--stats", metavar="ENDPOINT", help="stats server to report to")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where to write the weights and checkpoints (DIR/checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in --run-dir, as a new "
                        "incarnation (learners rejoin by themselves)")
    p.add_argument("--bcast-bind", metavar="ENDPOINT",
                   help="advstar: endpoint the broadcast root binds (its first members "
                        "connect there)")
    p.set_defaults(func=cmd_ps)


def _add_learner(sub) -> None:
    p = sub.add_parser("learner", help="run one or more learners in this process")
    _config_args(p)
    p.add_argument("--id", required=True, type=_parse_ids, metavar="I[,J,...]",
                   help="learner id(s), 0 .. sync.learners-1")
    p.add_argument("--ps", required=True, metavar="ENDPOINT", help="parameter server")
    p.add_argument("--data", required=True, metavar="ENDPOINT", help="data server")
    p.add_argument("--stats", metavar="ENDPOINT", help="stats server to report to")
    p.add_argument("--bcast-upstream", metavar="EP[,EP...]",
                   help="advstar: per --id, the broadcast upstream (the PS's --bcast-bind or "
                        "its upstream learner's --bcast-bind)")
    p.add_argument("--bcast-bind", metavar="EP[,EP...]",
                   help="advstar: per --id, the endpoint it binds for its broadcast children, "
                        "or none (default: none for all)")
    p.set_defaults(func=cmd_learner)


def _add_node(sub) -> None:
    p = sub.add_parser("node", help="run one node of a PS tree (architecture.kind=adv)",
                       description="A Rudra-adv tree node: sums the gradients of its children "
                                   "(learners, or tree nodes) and relays them to its parent "
                                   "(a tree node or the parameter server). Node ids: leaves "
                                   "first, then each level above (see `rudra-zmq run`'s plan).")
    _config_args(p)
    p.add_argument("--id", required=True, type=int, metavar="K", help="tree node id")
    p.add_argument("--bind", required=True, metavar="ENDPOINT",
                   help="endpoint its children connect to, e.g. ipc:///tmp/rudra-node0.sock")
    p.add_argument("--parent", required=True, metavar="ENDPOINT",
                   help="its parent: the parameter server or a tree node")
    p.set_defaults(func=cmd_node)


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="run the data server (until SIGTERM or Ctrl-C)")
    _config_args(p)
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="endpoint to bind")
    p.set_defaults(func=cmd_data)


def _add_stats(sub) -> None:
    p = sub.add_parser("stats", help="run the statistics server (until training ends)")
    _config_args(p)
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="endpoint to bind")
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="run directory for metrics, summary and plots")
    p.add_argument("--resume", action="store_true",
                   help="the run is resumed: mark it in metrics.jsonl (which is always "
                        "appended to)")
    p.set_defaults(func=cmd_stats)


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a run in one process (no sockets)",
                       description="Drive the same sync protocol engine as the parameter "
                                   "server with simulated learner speeds: staleness, updates "
                                   "and (with --train) accuracy, deterministically.")
    _config_args(p, positional=True)
    p.add_argument("--train", action="store_true",
                   help="compute real gradients and test error (else protocol only)")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="relative std of each gradient's compute time (default 0)")
    p.add_argument("--speeds", metavar="T0,T1,...",
                   help="relative compute time per learner (default all 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated timing")
    p.add_argument("--gradients", choices=("auto", "batched", "per-gradient"), default="auto",
                   help="--train: one forward/backward per weights version per update "
                        "(batched), or per learner gradient; auto: batched where it is "
                        "exact (docs/simulator.md)")
    p.add_argument("--schedule-scale", type=float, default=1.0, metavar="S",
                   help="epochs and lr steps times S in (0, 1] (0.1: 14 epochs, ÷10 at 12 "
                        "and 13 for the paper's 140), recorded as train.schedule_scale")
    p.add_argument("--run-dir", metavar="DIR", help="where to write metrics and plots")
    p.set_defaults(func=cmd_simulate)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="show the kernel build and library versions")
    p.set_defaults(func=cmd_info)


# The commands defined in other modules: command -> module (with an ``add_parser(sub)``).
# Each is imported only to parse its own command line, or to list every command (--help):
# a role's start-up does not pay for matplotlib (compare), ssh planning (launch) or the
# benchmarks.
TOOLS = {"compare": "compare", "sweep": "sweep", "report": "report", "keys": "keys",
         "launch": "cluster_launch", "env": "ranks", "worker": "worker",
         "examples": "shipped", "bench": "benchmarks.cli"}
_OWN = {"run": _add_run, "ps": _add_ps, "learner": _add_learner, "node": _add_node,
        "data": _add_data, "stats": _add_stats, "simulate": _add_simulate, "info": _add_info}
COMMANDS = (*_OWN, *TOOLS)   # in the order --help lists them


def _add_tool(sub, name: str) -> None:
    importlib.import_module(f"rudra_zmq.{TOOLS[name]}").add_parser(sub)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``rudra-zmq`` parser: every subcommand, or only ``command`` when it names one (then
    only its module is imported). Does not block."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Parameter-server distributed deep learning on ZeroMQ (Rudra).",
        epilog="Run `rudra-zmq COMMAND --help` for the options of one command.")
    from . import __version__, build_info   # the package is loaded already: costs nothing
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {__version__} (kernels: {build_info()['compile_args']})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for name in [command] if command in COMMANDS else COMMANDS:
        if name in TOOLS:
            _add_tool(sub, name)
        else:
            _OWN[name](sub)
    return parser


def main(argv=None) -> int:
    """Entry point of ``rudra-zmq``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # the first word that is no option names the command (the top-level options take no value)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:   # a role's peer never answered: say who, without a trace
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        print(f"{PROG} {args.command}: stopped by {signal.Signals(signum).name}",
              file=sys.stderr)
        return 128 + signum
