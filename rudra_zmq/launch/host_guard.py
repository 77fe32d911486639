"""Run one role on a host of ``rudra-zmq launch`` and make sure it ends with the launcher.

The launcher starts ``python -m rudra_zmq.launch.host_guard ROLE ARGS...`` over ssh (or pdsh). The
guard reads one JSON line from stdin, ``{"env": {NAME: VALUE}, "learners_here": N}`` (the
run token, forwarded ``-x`` variables: never on a command line, where ``ps`` would show
them), or the same object from the file named by ``--env-file`` (pdsh, which forwards no
stdin). It computes the role's thread counts on this host (:func:`run_plan.role_env`, from
the cores it may use and the learners placed here), starts ``python -m rudra_zmq ROLE ARGS``
and exits with its exit code.

It stops the role (SIGTERM, then SIGKILL of its process group after ``GRACE_S``) when its
stdin reaches EOF (the launcher closed it, or the ssh connection is gone), when its parent
changes (the ssh session ended), or on SIGTERM/SIGHUP/SIGINT. The role itself gets SIGTERM
if the guard dies (``RUDRA_ZMQ_LAUNCHER_PID``, :func:`role_process.follow_launcher`). Blocks
until the role has exited; run as a program, from one thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 5.0  # SIGTERM -> SIGKILL of the role's process group
POLL_S = 0.2
MAX_LINE = 1 << 20  # the JSON line: a few variables, not megabytes


class _Stop(threading.Event):
    """Set when the role should stop; ``why`` says what asked."""

    why = ""

    def request(self, why: str) -> None:
        if not self.is_set():
            self.why = why
            self.set()


def _read_settings(argv: list[str]) -> tuple[dict, list[str], bool]:
    """The settings object, the role's argv (``--env-file F`` removed) and whether they came
    on stdin. Raises ValueError or OSError."""
    on_stdin = argv[:1] != ["--env-file"]
    if on_stdin:
        raw = sys.stdin.buffer.readline(MAX_LINE)
    else:
        with open(argv[1], "rb") as f:
            raw, argv = f.read(MAX_LINE), argv[2:]
    settings = json.loads(raw.decode() or "{}")
    env = settings.get("env", {})
    if (
        not isinstance(settings, dict)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        or not isinstance(settings.get("learners_here", 0), int)
    ):
        raise ValueError('expected {"env": {NAME: VALUE}, "learners_here": N}')
    if not argv:
        raise ValueError("no role given")
    return settings, argv, on_stdin


def _role_env(role: str, argv: list[str], settings: dict) -> dict[str, str]:
    """Thread counts for this host (needs the config after ``--config``), plus the launcher's
    variables."""
    from ..config import load_config
    from .run_plan import role_env

    cfg = load_config(argv[argv.index("--config") + 1], [])
    env = role_env(cfg, role, learners_here=settings.get("learners_here", 0))
    env.update(settings.get("env", {}))
    env["RUDRA_ZMQ_LAUNCHER_PID"] = str(os.getpid())  # the role follows this guard
    return env


def _watch_stdin(stop: _Stop) -> None:
    """Thread body: EOF (or an error) on stdin means the launcher is gone or said stop."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop.request("the launcher closed the connection")


def run(argv: list[str]) -> int:
    """Start the role of ``argv`` and wait for it; returns its exit code (128+N for signal
    N). Blocks."""
    try:
        settings, argv, on_stdin = _read_settings(argv)
        role = argv[0]
        env = _role_env(role, argv[1:], settings)
    except (OSError, ValueError, IndexError) as exc:
        print(f"rudra-zmq host_guard: bad start request ({exc})", file=sys.stderr)
        return 2
    stop = _Stop()
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, lambda signum, frame: stop.request(signal.Signals(signum).name))
    if on_stdin:  # (pdsh gives no stdin to watch: the parent check below stands in)
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    parent = os.getppid()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rudra_zmq", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    while proc.poll() is None:
        if os.getppid() != parent:
            stop.request("its ssh session ended")
        if stop.wait(POLL_S):
            break
    if proc.poll() is None:
        print(f"rudra-zmq host_guard: stopping {role} ({stop.why})", file=sys.stderr, flush=True)
        proc.terminate()
        deadline = time.monotonic() + GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the role's leftovers, or the role itself
    except (ProcessLookupError, PermissionError):
        pass
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the stdin watcher may sit in a read that would abort
    # the interpreter's shutdown ("could not acquire lock for <stdin>")
