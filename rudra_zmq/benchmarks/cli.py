"""The ``rudra-zmq bench`` subcommands; :func:`add_parser` hooks them into the main CLI.

Each command module provides ``add_arguments(parser)`` and ``run(args) -> exit code``.
Modules are imported when the parser is built, so they import nothing heavy at module level
(torch and matplotlib load inside the commands that use them).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "thr": "raw ZeroMQ throughput, like libzmq's local_thr/remote_thr",
    "lat": "raw ZeroMQ latency, like libzmq's local_lat/remote_lat",
    "pushpull": "the parameter server's push/pull path beside raw ZeroMQ (ps-lite's modes)",
    "allreduce": "torch.distributed gloo allreduce beside the PS's hardsync step",
    "kernels": "the update kernels beside NumPy, torch and a plain copy",
}


def _run(module):
    def call(args) -> int:
        try:
            return module.run(args)
        except ValueError as exc:   # a bad size, transport or combination of options
            raise SystemExit(f"rudra-zmq bench {args.bench}: error: {exc}") from None
    return call


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` (with one subcommand per benchmark) to the main CLI's subparsers."""
    p = sub.add_parser("bench", help="benchmark the communication layer and the kernels",
                       description="Benchmarks of the communication layer (see "
                                   "docs/benchmarks.md). Each prints one line per case; "
                                   "--csv, --png and --json write the figures.")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"rudra_zmq.benchmarks.{name}")
        q = bench.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0],
                             epilog=module.__doc__.split("\n\n", 1)[1],
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q)
        q.set_defaults(func=_run(module))
    return p


def main(argv=None) -> int:
    """``python -m rudra_zmq.benchmarks.cli ARGS`` = ``rudra-zmq bench ARGS``."""
    parser = argparse.ArgumentParser(prog="rudra-zmq")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
