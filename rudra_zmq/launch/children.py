"""The launcher's child processes: what it started, their output, and stopping them for good.

Used by :mod:`rudra_zmq.launch.launcher` (``rudra-zmq run``). ``Child`` records one role process;
``echo_lines`` copies the stats server's progress lines to the terminal and its log;
``kill_tree`` SIGKILLs a child with its descendants and process group and reaps it, without
ever signalling a pid that is no longer ours; ``accepting`` says whether a server endpoint
accepts connections yet. Functions block only as their docstrings say; none is thread-safe
for the same child from two threads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LOG_TAIL_LINES = 20


@dataclass
class Child:
    label: str  # stats | data | ps | learner3 | learner0-3
    role: str  # stats | data | ps | learner
    command: list[str]
    log: Path
    proc: subprocess.Popen
    echo: threading.Thread | None = None
    last_line: str = ""  # the last stdout line echoed (stats server only)
    ended: bool = False  # its exit was handled by the supervisor
    args: list | None = None  # the role's arguments (to restart it with)

    def describe_exit(self) -> str:
        rc = self.proc.returncode
        how = f"exited with code {rc}"
        if rc < 0:
            try:
                how += f" ({signal.Signals(-rc).name})"
            except ValueError:
                pass
        return f"{self.label} (pid {self.proc.pid}) {how}"


def echo_lines(pipe, log_path: Path, child: Child, prefix: str = "") -> None:
    """Copy a child's stdout, line by line, to its log and to our stdout (progress display),
    there after ``prefix`` (``host:label `` under ``rudra-zmq launch``). Runs in its own
    thread until the child's stdout closes."""
    echo = True
    with pipe, open(log_path, "a", buffering=1, errors="replace") as log:
        for line in pipe:
            log.write(line)
            child.last_line = line.rstrip("\n")
            if echo:
                try:
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()
                except (OSError, ValueError):  # our stdout is gone (closed pipe): keep logging
                    echo = False


def log_size(child: Child) -> int:
    """The size of a child's log (-1 when it cannot be read): its sign of progress."""
    try:
        return child.log.stat().st_size
    except OSError:
        return -1


def tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []


def accepting(endpoint: str) -> bool:
    """Whether something accepts connections on a ``tcp://`` or ``ipc://`` endpoint (a bare
    connect and close, which a ZeroMQ socket shrugs off). Blocks at most ~0.5 s."""
    scheme, _, where = endpoint.partition("://")
    try:
        if scheme == "ipc":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(where)
        else:
            host, _, port = where.rpartition(":")
            host = host.strip("[]")
            if host in ("*", "0.0.0.0", "::", ""):
                host = "127.0.0.1" if host != "::" else "::1"
            socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


def kill_tree(child: Child) -> None:
    """SIGKILL the child, its descendants and its process group, and reap the child. Never
    signals a pid that is no longer ours: psutil is asked only while the child is unreaped
    (alive or a zombie), so its pid cannot have been reused."""
    procs = []
    if child.proc.poll() is None:
        try:
            procs = psutil.Process(child.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            child.proc.kill()
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    kill_group(child)
    wait_gone(procs, timeout=2)
    try:
        child.proc.wait(timeout=2)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
        pass


def wait_gone(procs, timeout: float) -> None:
    """Wait until ``procs`` (not our children) are gone or zombies. Orphans are reaped by
    pid 1, which in some containers never does, so a zombie counts as gone."""
    deadline = time.monotonic() + timeout
    while procs and time.monotonic() < deadline:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        procs = alive
        if procs:
            time.sleep(0.02)


def kill_group(child: Child) -> None:
    """SIGKILL whatever is left in the child's process group (its session leader's pgid is
    its pid, and Linux does not reuse a pid that is still some group's id)."""
    try:
        os.killpg(child.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
