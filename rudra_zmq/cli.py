"""The ``rudra-zmq`` command line (also ``python -m rudra_zmq``).

``rudra-zmq run CONFIG`` starts a whole run on this machine (see :mod:`rudra_zmq.launch.launcher`);
``rudra-zmq ps|learner|node|data|stats`` start one role each, with explicit endpoints, so the same
run can be spread over several machines by hand (:mod:`rudra_zmq.launch.role_commands`).
``rudra-zmq simulate CONFIG`` runs the sync protocol in one process with simulated learner
speeds (see :mod:`rudra_zmq.sim.simulator`); ``rudra-zmq info`` reports the build.

Role modules (and torch) are imported inside their subcommand only, and a command line builds
only its own subcommand's parser (the commands of other modules, ``TOOLS``, load only for
their own command or ``--help``), so a role's start-up pays for nothing else;
:mod:`rudra_zmq.launch.role_process` prepares a role's process and runs it.
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

from . import timeline
from .config import ConfigError, scale_schedule
from .devices import usable_cores
from .launch import role_process
from .launch.role_commands import PARSERS, UsageError, config_args, config_of
from .results.record_fields import DamagedRecord

PROG = "rudra-zmq"


# ----------------------------------------------------------------------------- subcommands
def cmd_run(args) -> int:
    from .launch import launcher

    try:
        if args.resume is None and args.config is None:
            raise UsageError("give a CONFIG to start a run, or --resume RUN_DIR to continue one")
        if args.resume is not None and args.run_dir is not None:
            raise UsageError(
                "--run-dir starts a new run; --resume RUN_DIR continues the run "
                "there: give one of them"
            )
        out = timeline.Output(args.timeline) if args.timeline else None

        def start() -> int:
            return launcher.run(args.config, args.set, run_dir=args.run_dir, resume=args.resume)

        return start() if out is None else _with_timeline(out, start)
    except (ConfigError, FileNotFoundError, DamagedRecord, timeline.TimelinePathError) as exc:
        raise UsageError(str(exc)) from None  # raised before any process starts


def _with_timeline(out, start) -> int:
    """Run ``start()`` with every role it starts recording its part of the timeline
    (``RUDRA_TIMELINE`` in their environment), then join the parts into ``out``'s file
    (none is written if no role started)."""
    base = out.base()
    os.environ[timeline.ENV] = base
    try:
        return start()
    finally:
        del os.environ[timeline.ENV]
        said = out.close_run(base)
        if said:
            print(said, flush=True)


def cmd_simulate(args) -> int:
    if args.schedule_scale != 1:  # epochs and lr steps scaled, recorded in the config
        try:
            args.set = list(args.set) + scale_schedule(args.config, args.set, args.schedule_scale)
        except (ConfigError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
    cfg = config_of(args)
    speeds = None
    if args.speeds:
        try:
            speeds = [float(x) for x in args.speeds.split(",")]
        except ValueError:
            raise UsageError(
                f"--speeds must be numbers separated by commas, got {args.speeds!r}"
            ) from None
    if args.resume and not args.run_dir:
        raise UsageError("--resume continues the simulation in --run-dir DIR: name it")
    run_dir = args.run_dir or os.path.join(
        cfg.runtime.run_dir, f"{cfg.name}-sim-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    from .sim import simulator

    # The simulator computes one gradient at a time: every core, unless
    # runtime.threads_per_learner says otherwise (e.g. 1 beside another run).
    role_process.set_threads(
        cfg.runtime.threads_per_learner or usable_cores(), torch_too=args.train
    )
    try:
        return simulator.main_simulate(
            cfg,
            run_dir,
            jitter=args.jitter,
            speeds=speeds,
            seed=args.seed,
            train=args.train,
            gradients=args.gradients,
            resume=args.resume,
        )
    except ValueError as exc:  # sim_checkpoint.CheckpointError too
        raise UsageError(str(exc)) from None


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

    rows = [
        ("rudra_zmq", rudra_zmq.__version__),
        ("python", sys.version.split()[0]),
        ("torch", version("torch")),
        ("pyzmq", zmq.pyzmq_version()),
        ("libzmq", zmq.zmq_version()),
        ("numpy", version("numpy")),
    ]
    rows += sorted((f"build.{k}", v) for k, v in rudra_zmq.build_info().items())
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# ----------------------------------------------------------------------------- parser
def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run every role on this machine (one command, one run)",
        description="Start the stats server, data server, parameter server "
        "and learners as processes on this machine, show progress,"
        " and stop them all when training ends or anything fails.",
    )
    config_args(p, positional=True)
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="run directory (default: runtime.run_dir/NAME-YYYYmmdd-HHMMSS); one "
        "that holds a run already is refused",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest valid checkpoint (CONFIG "
        "optional; --set may change only train.epochs, evaluation and "
        "checkpoint intervals and runtime.*)",
    )
    p.add_argument(
        "--timeline",
        metavar="FILE",
        help="write a Chrome/Perfetto trace of the run to FILE (each learner's compute and "
        "steps, every message and part it sent and received, per server; docs/benchmarks.md)",
    )
    p.set_defaults(func=cmd_run)


def _add_simulate(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a run in one process (no sockets)",
        description="Drive the same sync protocol engine as the parameter "
        "server with simulated learner speeds: staleness, updates "
        "and (with --train) accuracy, deterministically.",
    )
    config_args(p, positional=True)
    p.add_argument(
        "--train",
        action="store_true",
        help="compute real gradients and test error (else protocol only)",
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="relative std of each gradient's compute time (default 0)",
    )
    p.add_argument(
        "--speeds", metavar="T0,T1,...", help="relative compute time per learner (default all 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated timing")
    p.add_argument(
        "--gradients",
        choices=("auto", "batched", "per-gradient"),
        default="auto",
        help="--train: one forward/backward per weights version per update "
        "(batched), or per learner gradient; auto: batched where it is "
        "exact (docs/simulator.md)",
    )
    p.add_argument(
        "--schedule-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="epochs and lr steps times S in (0, 1] (0.1: 14 epochs, ÷10 at 12 "
        "and 13 for the paper's 140), recorded as train.schedule_scale",
    )
    p.add_argument("--run-dir", metavar="DIR", help="where to write metrics and plots")
    p.add_argument(
        "--resume",
        action="store_true",
        help="--train: continue the simulation in --run-dir from its checkpoint (written "
        "after each evaluation; same config but runtime.*, --seed, --jitter, --speeds)",
    )
    p.set_defaults(func=cmd_simulate)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="show the kernel build and library versions")
    p.set_defaults(func=cmd_info)


# The commands defined in other modules: command -> module (with an ``add_parser(sub)``).
# Each is imported only to parse its own command line, or to list every command (--help):
# a role's start-up does not pay for matplotlib (compare), ssh planning (launch) or the
# benchmarks.
TOOLS = {
    "compare": "results.compare",
    "sweep": "launch.sweep",
    "report": "results.report",
    "keys": "security.keys",
    "launch": "launch.cluster_launch",
    "env": "launch.ranks",
    "worker": "launch.worker",
    "examples": "shipped",
    "bench": "benchmarks.cli",
    "replay": "sim.replay",
}
_OWN = {"run": _add_run, **PARSERS, "simulate": _add_simulate, "info": _add_info}
COMMANDS = (*_OWN, *TOOLS)  # in the order --help lists them


def _add_tool(sub, name: str) -> None:
    importlib.import_module(f"rudra_zmq.{TOOLS[name]}").add_parser(sub)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``rudra-zmq`` parser: every subcommand, or only ``command`` when it names one (then
    only its module is imported). Does not block."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Parameter-server distributed deep learning on ZeroMQ (Rudra).",
        epilog="Run `rudra-zmq COMMAND --help` for the options of one command.",
    )
    from . import __version__, build_info  # the package is loaded already: costs nothing

    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {__version__} (kernels: {build_info()['variant']} variant, "
        f"{build_info()['compile_args']})",
    )
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
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # a role's peer never answered: say who, without a trace
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        print(f"{PROG} {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
