"""The ``rudra-zmq bench`` subcommands; :func:`add_parser` hooks them into the main CLI.

Each command module provides ``add_arguments(parser)`` and ``run(args) -> exit code``.
Modules are imported when the parser is built, so they import nothing heavy at module level
(torch, psutil and matplotlib load inside the commands that use them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module in rudra_zmq.benchmarks, one line of help)
COMMANDS = {
    "thr": ("thr", "raw ZeroMQ throughput, like libzmq's local_thr/remote_thr"),
    "lat": ("lat", "raw ZeroMQ latency, like libzmq's local_lat/remote_lat"),
    "pushpull": (
        "pushpull",
        "the parameter server's push/pull path beside an echo server "
        "and raw ZeroMQ (ps-lite's modes)",
    ),
    "allreduce": ("allreduce", "torch.distributed gloo allreduce beside the PS's hardsync step"),
    "kernels": ("kernels", "the update kernels beside NumPy, torch and a plain copy"),
    "shm-leaf": ("shm_leaf", "shared memory vs ipc:// between a tree leaf and its learners"),
    "root-ingress": (
        "root_ingress",
        "bytes the root PS receives per update: Rudra-base, adv, adv*",
    ),
    "lan-table1": ("lan_table1", "the paper's Table 1 on emulated LAN hosts (root, ip netns)"),
    "lan-overlap": (
        "lan_overlap",
        "raw-ZeroMQ probe: servers answering each part of their range once complete (LAN)",
    ),
    "train-throughput": (
        "train_throughput",
        "`rudra-zmq run` training throughput beside a plain PyTorch loop",
    ),
    "epoch-time": ("epoch_time", "seconds per epoch of config files, through `rudra-zmq run`"),
    "sim-speed": ("sim_speed", "the simulator's speed beside one learner process"),
    "memory": ("memory", "peak memory (RSS/PSS/USS) of whole `rudra-zmq run`s"),
    "checkpoint": (
        "checkpoint_cost",
        "ms per PS checkpoint and update throughput with checkpoints beside none",
    ),
    "curve": ("curve_cost", "CurveZMQ beside plaintext on push+pull (round trips/s, p50)"),
    "startup": ("startup", "the quickstart's start-up beside another checkout's, alternating"),
    "failover": (
        "failover",
        "detection of dead and hung learners, PS crash to next update, under `rudra-zmq run`",
    ),
}


def _run(module):
    def call(args) -> int:
        try:
            return module.run(args)
        except ValueError as exc:  # a bad size, transport or combination of options
            raise SystemExit(f"rudra-zmq bench {args.bench}: error: {exc}") from None

    return call


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` (with one subcommand per benchmark) to the main CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="benchmark the communication layer, the kernels and whole runs",
        description="Benchmarks (see docs/benchmarks.md). Each prints one "
        "line per case; most write --csv, --png and --json.",
    )
    bench = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"rudra_zmq.benchmarks.{module_name}")
        q = bench.add_parser(
            name,
            help=help_text,
            description=module.__doc__.split("\n\n")[0],
            epilog=module.__doc__.split("\n\n", 1)[1],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(q)
        q.set_defaults(func=_run(module))
    return p


def main(argv=None) -> int:
    """``python -m rudra_zmq.benchmarks.cli ARGS`` = ``rudra-zmq bench ARGS``; blocks until
    the benchmark ends and returns its exit code."""
    parser = argparse.ArgumentParser(prog="rudra-zmq")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
