"""Warnings about what peers send, at a bounded rate: the first of each kind at once, then at
most one per ``every_s`` with how many were left out. A peer that sends nonsense, or never
reads its replies, cannot fill the log."""

from __future__ import annotations

import logging
import time

EVERY_S = 10.0
MAX_KEYS = 1024  # distinct (sender, reason) keys remembered; then they share one


class ThrottledLog:
    """Wraps a ``logging.Logger``; ``warning(key, msg, *args)`` logs the first warning of each
    ``key`` (say (sender, reason)) and then at most one per ``every_s``, adding the count of
    those not logged. Not thread-safe (one role thread owns it)."""

    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S):
        self.logger, self.every_s = logger, every_s
        self._seen: dict = {}  # key -> [last logged (monotonic), left out since]

    def warning(self, key, msg: str, *args) -> bool:
        """Log ``msg % args`` now, or count it; returns whether it was logged."""
        now = time.monotonic()
        if key not in self._seen and len(self._seen) >= MAX_KEYS:
            key = "(many senders)"
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.every_s:
            entry[1] += 1
            return False
        left_out = 0 if entry is None else entry[1]
        self._seen[key] = [now, 0]
        if left_out:
            msg += f" ({left_out} more like it in the last {self.every_s:g} s not logged)"
        self.logger.warning(msg, *args)
        return True
