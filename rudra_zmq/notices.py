"""Warnings that change what a user should believe about a run, on the terminal as well as in
the role's log: a damaged checkpoint skipped, updates lost in a restart, a learner evicted.

A role writes one with ``notice(logger, fmt, *args)``: a WARNING log record whose message starts
with ``MARKER``. The launcher (``rudra-zmq run``, and ``rudra-zmq worker`` for its servers)
follows each role's log with a ``LogNotices`` and prints the marked lines to its stderr as
``LABEL: warning: TEXT``. Under ``rudra-zmq launch`` every line of every role comes back to
the terminal anyway, prefixed ``host:label``, marker included. Nothing here blocks beyond
reading a file; not thread-safe.
"""

from __future__ import annotations

import logging
from pathlib import Path

MARKER = "[notice]"
_READ_MAX = 1 << 20  # bytes of new log read per call: a flood cannot stall the launcher


def notice(logger: logging.Logger, fmt: str, *args) -> None:
    """Log ``fmt % args`` as a WARNING the launcher also shows on the terminal."""
    logger.warning(f"{MARKER} {fmt}", *args)


def notice_text(line: str) -> str | None:
    """The text of a notice in one log line (after the marker), or None if it is none."""
    i = line.find(MARKER)
    return None if i < 0 else line[i + len(MARKER) :].strip()


class LogNotices:
    """The notices appended to one log file since the last call, read incrementally from the
    size the file had when this was made (a restarted role appends to the same log)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._pos = self.path.stat().st_size
        except OSError:
            self._pos = 0
        self._partial = b""

    def new(self) -> list[str]:
        """Notices in the complete lines written since the last call. Blocks for one read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read(_READ_MAX)
        except OSError:
            return []
        if not data:
            return []
        self._pos += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        found = (notice_text(line.decode(errors="replace")) for line in lines)
        return [text for text in found if text]
