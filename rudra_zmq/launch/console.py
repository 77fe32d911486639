"""What ``rudra-zmq run``'s launcher says on the terminal: start-up progress, a child's exit
and its log's tail, a server that stays silent, the notices the roles logged, and the closing
lines (run directory, logs, result). Printing only: :class:`rudra_zmq.launch.launcher.Launcher`
decides when. Progress goes to stdout, trouble to stderr; each call blocks only for the write
(and a read of the log it quotes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..notices import LogNotices
from ..results.compare import result_line
from ..run_files import log_dir
from .children import Child, tail


def startup(labels, what: str, began: float) -> None:
    """``start-up: LABELS WHAT (T s)``, T counted from ``began`` (time.monotonic)."""
    print(f"start-up: {', '.join(labels)} {what} ({time.monotonic() - began:.1f} s)", flush=True)


def child_exit(child: Child, early: bool = False) -> None:
    """How ``child`` exited; ``early``: before training ended."""
    what = child.describe_exit()
    if early:
        what = what.replace(" exited", " exited before training ended,", 1)
    print(f"rudra-zmq: {what}", file=sys.stderr)


def log_tail(child: Child) -> None:
    """The last lines of ``child``'s log, indented, under a line that names the log."""
    lines = tail(child.log)
    if lines:
        print(f"--- last {len(lines)} lines of {child.log}:", file=sys.stderr)
        for line in lines:
            print(f"    {line}", file=sys.stderr)


def silent(child: Child, endpoint: str, timeout: float) -> None:
    """A starting server that neither accepts connections nor logs, and its log's tail."""
    print(
        f"rudra-zmq: {child.label} (pid {child.proc.pid}) is not accepting "
        f"connections on {endpoint}, and its log has "
        f"not grown for {timeout:g} s (runtime.timeout_s)",
        file=sys.stderr,
    )
    log_tail(child)


def notices(follow: dict[str, LogNotices]) -> None:
    """The notices (``notices.py``) each role wrote to its log since the last call, as
    ``LABEL: warning: TEXT``. Blocks for a read of each log."""
    for label, log in follow.items():
        for text in log.new():
            print(f"{label}: warning: {text}", file=sys.stderr, flush=True)


def stats_late(waited_s: float, log: Path) -> None:
    """The stats server did not finish ``waited_s`` after training ended: it is stopped."""
    # Training itself succeeded and the weights are saved; only the records
    # (summary.csv, plots) may be incomplete, so this is a warning, not a failure.
    print(
        f"rudra-zmq: warning: the stats server did not finish within "
        f"{waited_s:g} s after training ended; stopping it (its "
        f"summary may be incomplete, see {log})",
        file=sys.stderr,
    )


def closing(run_dir: Path, stats_said: str) -> None:
    """The lines of a run that ended well: its directory (unless the stats server's last
    line, ``stats_said``, was just that), its logs and its result."""
    final = f"run directory: {run_dir}"
    if stats_said != final:  # the stats server usually said it already
        print(final)
    print(f"logs: {log_dir(run_dir)}")
    outcome = result_line(run_dir)
    if outcome:
        print(outcome)
