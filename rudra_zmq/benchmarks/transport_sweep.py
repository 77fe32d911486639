"""The shared options and ``run()`` of the raw ZeroMQ sweeps ``bench thr`` and ``bench lat``:
transports x modes x sizes, the passive side served with ``--bind``, the other side spawned
or reached with ``--connect`` (:mod:`.sides`), one record per case reported by
:class:`.common.Report`."""

from __future__ import annotations

import zmq

from .. import transport
from . import common, sides

TRANSPORTS = ["tcp", "ipc", "inproc"]  # what ``thr`` and ``lat`` sweep
MODES = ["copy", "zerocopy"]


def add_transport_sweep_args(p, bind_help: str) -> None:
    """The options of a ``thr``/``lat``-style command: sides, sizes, transports, modes,
    timing and output."""
    sides.add_side_args(p, bind_help)
    common.add_size_args(p, "64", "4Mi", 16, "message size in bytes")
    p.add_argument(
        "--transports",
        nargs="+",
        default=None,
        choices=TRANSPORTS,
        help="default: tcp ipc inproc (tcp only with --connect)",
    )
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    common.add_timing_args(p)
    p.add_argument(
        "--count",
        type=int,
        default=0,
        metavar="N",
        help="messages per repeat, fixed (as libzmq's local_thr/local_lat take "
        "them); default 0: as many as fill --seconds",
    )
    common.add_output_args(p)


def op_count(args, per_op_s: float) -> int:
    """``--count`` if given, else the operations that fill ``--seconds`` at ``per_op_s``."""
    return args.count if args.count > 0 else common.calibrate(per_op_s, args.seconds, lo=10)


def run_transport_sweep(
    args, command: str, handlers, title: str, note: str, plot, cases, line
) -> int:
    """``run()`` of a ``thr``/``lat``-style command; blocks until done, returns the exit code.

    With ``--bind``: serve ``handlers`` as the passive side. Otherwise choose the transports,
    print the header (``note`` and where the other side is), start or reach the other side,
    and report (text: ``line(record)``) every record that ``cases(control, ctx, transport,
    mode, sizes)`` yields, transport by transport and mode by mode. Every socket and the
    context are closed on any exit (linger 0: never hangs).
    """
    if args.bind:
        return sides.serve_agent(
            f"{command} server", args.bind, handlers, args.idle_timeout, args.exit_with_parent
        )
    if args.count < 0:
        raise ValueError(f"--count must be >= 0 (0: fill --seconds), got {args.count}")
    kinds = args.transports or (["tcp"] if args.connect else TRANSPORTS)
    if args.connect and "inproc" in kinds:
        raise ValueError("inproc needs both sides in one process: drop --connect")
    sizes = common.sizes_from_args(args)
    transport.tune_malloc()
    report = common.Report(
        args,
        title,
        notes=[note, f"other side: {args.connect or 'spawned on this machine (inproc: a thread)'}"],
        plot=plot,
    )
    ctx = zmq.Context()
    peers = sides.Sides(ctx, command, args.connect, handlers)
    try:
        for kind in kinds:
            for mode in args.modes:
                for r in cases(peers.control(kind), ctx, kind, mode, sizes):
                    report.case(r, line(r))
    finally:
        peers.close()
        ctx.destroy(linger=0)  # closes what an error left open, never hangs
    report.close()
    return 0
