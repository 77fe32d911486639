"""Run every role of one training run on this machine, supervise them, stop them all.

``rudra-zmq run CONFIG`` (:func:`run`) checks the data and extras the config names and
decodes image data once (:mod:`rudra_zmq.launch.preflight`), then creates a run directory, saves the
resolved config there as ``config.yaml`` and starts one process per role: stats server, data
server, PS, tree nodes (``architecture.kind`` adv or advstar; top level first), learner
processes (``runtime.learners_per_process`` learners each), each as soon as the servers it
sends to accept connections (``run_plan.role_steps``), so roles that do not wait for each
other start side by side. Each process logs to ``RUN/logs/ROLE.log``; ``RUN/processes.json``
lists every pid and command line; the stats server's stdout is also echoed here, as the
progress display, and so are the notices the roles write to their logs (a damaged
checkpoint, updates lost, a learner evicted: ``notices.py``), on stderr. What it prints is
:mod:`rudra_zmq.launch.console`.

The run succeeds (0) when the PS (and every tree node) exits 0: the learners get
``LEARNER_EXIT_S`` to follow, the data server is sent SIGTERM and the stats server finishes
by itself (or is stopped after ``STATS_EXIT_TIMEOUT_S``; one that fails then is restarted,
as during training, to evaluate the final weights from the run directory). A role that fails (exits non-zero,
or the data server exits at all) is restarted with ``runtime.restart`` (the PS from its newest
checkpoint, ``--resume``), at most ``runtime.max_restarts`` times per role; without restarts a
failed learner is left out (the PS evicts it and the others go on) and any other failure ends
the run (``restarts.py`` decides). A run that cannot go on, or a server that neither listens nor writes to its log for
``runtime.timeout_s``, stops all others (SIGTERM, then SIGKILL of the process tree after ``TERM_GRACE_S``) and
returns 1; Ctrl-C, SIGTERM or SIGHUP does the same and returns 130. Children run in their own
sessions, so a terminal's Ctrl-C reaches only the launcher. ``resume``: the run in the run
directory continues from its checkpoint (``rudra-zmq run --resume``).

Each role's command line and the stop order: ``docs/architecture.md`` (The launcher); the same
commands started by hand across machines: ``docs/multihost.md``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .. import config as config_mod
from .. import transport
from ..notices import LogNotices
from ..run_files import (
    PROCESSES_FILE,
    PS_FINAL_FILE,
    checkpoints_root,
    log_path,
)
from ..security import auth
from ..server.end_files import assemble, final_done
from ..shape import ClusterShape
from . import console, preflight, startup
from .children import Child, echo_lines, kill_tree
from .restarts import on_failure
from .run_plan import Plan, make_plan, plaintext_warning, role_env, run_keys, summary

POLL_S = 0.2  # how often the supervisor looks at its children
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL of the process tree
STATS_EXIT_TIMEOUT_S = 60.0  # after training, how long the stats server may take to finish
LEARNER_EXIT_S = 10.0  # after the PS finished, how long learners may take to exit
ELSEWHERE_FILES_S = 10.0  # how long rank 0 waits for servers elsewhere to write their files
FILES_POLL_S = 0.2  # ... looking for them this often


def _role_command(role: str, args: list[str]) -> list[str]:
    """The command line that starts ``role`` (stats | data | ps | learner) with ``args``.

    A module-level function so that tests can replace the real roles with small fakes.
    """
    return [sys.executable, "-m", "rudra_zmq", role, *args]


# ----------------------------------------------------------------------------- processes
class Launcher:
    """Starts and supervises the processes of one run. Use once, from one thread."""

    def __init__(self, plan: Plan, resume: bool = False, keys_dir: str | None = None):
        self.plan = plan
        self.resume = resume
        self.children: list[Child] = []
        self.interrupted = False
        self.hurry = False  # a second interrupt: skip the SIGTERM grace period
        self.restarts: dict[str, int] = {}  # label -> times restarted
        self.left_out: set[str] = set()  # learners that failed and were not restarted
        self.learners_here: int | None = None  # learners on this host (None: all λ)
        self.local: set[str] | None = None  # the labels started here (None: the whole plan)
        self.processes_file = PROCESSES_FILE  # another name where rank 0 writes this one
        self.heard: dict[str, tuple[float, int]] = {}  # wait_ready: a server's last progress
        # `worker`: why the run cannot go on, from another rank (None: nothing), polled; and
        # whom to tell when this launcher stops the run for a failure (``failure``: which)
        self.watch: Callable[[], str | None] | None = None
        self.on_give_up: Callable[[str], object] | None = None
        self.failure: str | None = None
        self.notices: dict[str, LogNotices] = {}  # label -> its log's notices, followed
        # the run's token (the stats server knows the PS's records by it) and, with
        # security.curve, the per-run key directory every role uses
        self.secrets = {auth.RUN_TOKEN_ENV: auth.new_run_token()}
        if plan.cfg.security.curve:  # keys_dir: the user's (worker), else per-run keys
            self.secrets[auth.KEYS_ENV] = keys_dir or str(run_keys(plan))
        elif plaintext_warning("run", plan) is not None:  # said on the terminal by `run`:
            self.secrets[transport.PLAINTEXT_NAMED_ENV] = "1"  # the roles keep quiet

    # -- signals -----------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        if self.interrupted:
            self.hurry = True
        self.interrupted = True

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}  # signals can't be caught here; KeyboardInterrupt still works
        return {
            s: signal.signal(s, self._on_signal)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }

    # -- starting ------------------------------------------------------------------------
    def start(self, label: str, role: str, args: list[str]) -> Child:
        """Start one role; blocks only for the fork/exec."""
        cfg = self.plan.cfg
        command = _role_command(role, args)
        log_file = log_path(self.plan.run_dir, label)
        if label not in self.notices:  # from the log's end: a restarted role appends to it
            self.notices[label] = LogNotices(log_file)
        with open(log_file, "ab") as log:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if role == "stats" else log,
                stderr=log,
                env={**role_env(cfg, role, self.learners_here), **self.secrets},
                start_new_session=True,
                text=role == "stats",
                errors="replace" if role == "stats" else None,
            )
        child = Child(label, role, command, log_file, proc, args=list(args))
        self.children.append(child)
        if role == "stats":
            child.echo = threading.Thread(
                target=echo_lines,
                name="stats-echo",
                daemon=True,
                args=(proc.stdout, log_file, child),
            )
            child.echo.start()
        self._write_processes()
        return child

    def _write_processes(self) -> None:
        """RUN/processes.json: every process started, oldest first, and how each one that
        has exited ended (``exit``: its code, negative for a signal, named in ``signal``),
        so a killed and restarted role stays in the run's records. Written at each start,
        each failure and the end; atomic (a temporary file renamed)."""
        rows = []
        for c in self.children:
            row = {"role": c.label, "pid": c.proc.pid, "command": c.command, "log": str(c.log)}
            rc = c.proc.returncode
            if rc is not None:
                row["exit"] = rc
                if rc < 0:
                    with contextlib.suppress(ValueError):
                        row["signal"] = signal.Signals(-rc).name
            rows.append(row)
        tmp = self.plan.run_dir / (self.processes_file + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(self.plan.run_dir / self.processes_file)

    def start_all(self) -> int | None:
        """Start every role in its order and wait for each server to listen
        (``startup.start_all``). Blocks; None once all started, else the run's exit code."""
        return startup.start_all(self)

    # -- supervising ---------------------------------------------------------------------
    def _report(self, child: Child, early: bool = False) -> None:
        console.child_exit(child, early)
        if child.echo is not None:  # its last lines before the log's tail
            child.echo.join(timeout=2)
        console.log_tail(child)

    def echo_notices(self) -> None:
        """Print the notices (``notices.py``) the roles wrote to their logs since the last
        call, to stderr as ``LABEL: warning: TEXT``. Blocks for a read of each log."""
        console.notices(self.notices)

    def supervise(self) -> int:
        """Poll the children until training ends (0), something fails that cannot be
        restarted (1), or we are interrupted (130), showing their notices. Blocks; returns
        with every child stopped."""
        ended_at = None  # when the PS (and every tree node) finished training
        while True:
            self.echo_notices()
            if self.interrupted:
                return self.interrupt()
            why = self.watch() if self.watch is not None else None
            if why is not None:
                print(f"rudra-zmq: {why}; stopping the run", file=sys.stderr, flush=True)
                self.stop_all()
                return 1
            for c in list(self.children):
                rc = c.proc.poll()
                if rc is None or c.ended:
                    continue
                c.ended = True
                # rc == 0 of the stats server is fine: it returns once the PS announced the
                # end of training, which may be a little before the PS itself exits; so is
                # a learner's after STOP, or anything's but the stats server's once training
                # ended (a failed stats server still owes the final weights' evaluation).
                if (rc == 0 and c.role != "data") or (ended_at is not None and c.role != "stats"):
                    continue
                outcome = self._failed(c)
                if outcome is not None:
                    return outcome
            live = [c for c in self.children if not c.ended]
            # servers elsewhere (a rank of their own) may train on after ours: the stats
            # server ends once every server is done, and the data server serves till then
            wait = ("ps", "node", "stats") if self._servers_elsewhere() else ("ps", "node")
            if ended_at is None and not any(c.role in wait for c in live):
                ended_at = time.monotonic()
                if not self._servers_elsewhere():  # a server that died after its files
                    self.join_servers()  # left them unjoined: the stats server reads these
            if ended_at is not None and (
                not any(c.role == "learner" for c in live)
                or time.monotonic() - ended_at > LEARNER_EXIT_S
            ):
                return self.finish()
            time.sleep(POLL_S)

    def _failed(self, c: Child) -> int | None:
        """``c`` failed during training (or, the stats server, after it): restart it, leave
        it out (a learner, without restarts), or stop the run (its exit code), as
        ``restarts.on_failure`` says. Blocks only for the fork/exec."""
        self._report(c, early=(c.role == "data" and c.proc.returncode == 0))
        self._write_processes()  # its exit, whatever comes next
        others = self._others_learning()
        n = self.restarts.get(c.label, 0)
        cfg, run_dir = self.plan.cfg, self.plan.run_dir
        serves = self._serves(c)
        final = self._finished(serves)
        labels = tuple(s.label for s in serves)
        done = tuple(s.label for s in serves if self._final(s) is not None)
        verdict = on_failure(cfg, c.label, c.role, c.args, n, others, run_dir, final, labels, done)
        if verdict.message:
            print(f"rudra-zmq: {verdict.message}", file=sys.stderr, flush=True)
        if verdict.action == "leave_out":
            self.left_out.add(c.label)
            return None
        if verdict.action == "finished":
            return None
        if verdict.action == "restart":
            self.restarts[c.label] = n + 1
            try:
                self.start(c.label, c.role, list(verdict.args))
                return None
            except OSError as exc:
                print(f"rudra-zmq: could not restart {c.label}: {exc}", file=sys.stderr)
        self.failure = f"{c.label} exited with code {c.proc.returncode}"
        self.stop_all()
        return 1

    def _serves(self, c: Child) -> list:
        """The parameter servers (``shape.Server``) whose training ``c`` takes part in: a PS
        itself, a tree node its range's root, a learner every server; none for the rest."""
        shape = self.plan.shape
        if c.role == "ps":
            return [shape.by_label(c.label)]
        if c.role == "node":
            return [shape.server(k) for label, _, k in shape.tree_processes() if label == c.label]
        return list(shape.servers) if c.role == "learner" else []

    def _finished(self, servers) -> dict | None:
        """The newest ``done`` record (``end_files.final_done``) of ``servers`` when each one's
        ``ps_final.json`` (in its folder) says training is done, else None. Reads K small
        files."""
        finals = [self._final(s) for s in servers]
        if not finals or None in finals:
            return None
        return max(finals, key=lambda f: f["t"])

    def _final(self, server) -> dict | None:
        """The ``done`` record that ``server``'s ``ps_final.json`` stands for, or None."""
        return final_done(server.files_dir(self.plan.run_dir), self.plan.cfg.train.epochs)

    def _servers_elsewhere(self) -> bool:
        """Whether some of the run's parameter servers run outside this launcher."""
        return self.local is not None and not self.local.issuperset(self.plan.shape.labels)

    def _others_learning(self) -> bool:
        """Whether the run can go on without a failed learner: another learner is still
        training, or one finished (it was told STOP: training is done, the PS only waits)."""
        return any(
            x.role == "learner" and (not x.ended or x.proc.returncode == 0) for x in self._current()
        )

    def _current(self) -> list[Child]:
        """The newest process of each label (a restarted role replaces its predecessor)."""
        newest = {c.label: c for c in self.children}
        return list(newest.values())

    def finish(self) -> int:
        """Training ended well: stop the data server, let the stats server finish."""
        for c in self.children:
            if c.role == "data" and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        stats = [c for c in self._current() if c.role == "stats"]
        if not stats:  # a server of its own under `rudra-zmq worker`: rank 0 reports
            self.stop_all()
            self.join_servers()
            return 0
        deadline = time.monotonic() + STATS_EXIT_TIMEOUT_S
        while any(c.proc.poll() is None or (c.proc.returncode != 0 and not c.ended) for c in stats):
            if self.interrupted:
                return self.interrupt()
            for c in stats:  # killed now: restarted, it evaluates the final weights' file
                if c.proc.poll() not in (None, 0) and not c.ended:
                    c.ended = True
                    outcome = self._failed(c)
                    if outcome is not None:
                        return outcome
                    deadline = time.monotonic() + STATS_EXIT_TIMEOUT_S
            stats = [c for c in self._current() if c.role == "stats"]
            if time.monotonic() > deadline:  # a warning: the weights are saved
                console.stats_late(STATS_EXIT_TIMEOUT_S, stats[0].log)
                break
            time.sleep(POLL_S)
        for c in stats:
            if c.proc.returncode is None:
                continue
            if c.echo is not None:
                c.echo.join(timeout=2)  # the last lines, up to "run directory: ..."
            if c.proc.returncode != 0:
                self._report(c)
                self.stop_all()
                return 1
        self.stop_all()  # the data server, and a stats server that did not finish
        self.join_servers()
        console.closing(self.plan.run_dir, stats[0].last_line)
        return 0

    def join_servers(self) -> None:
        """Join the servers' files where no server could (:func:`join_server_files`)."""
        elsewhere = self._servers_elsewhere() and "stats" in (self.local or ())
        join_server_files(self.plan.cfg, self.plan.run_dir, elsewhere)

    def interrupt(self) -> int:
        print("interrupted", file=sys.stderr)
        self.stop_all()
        return 130

    def stop_all(self) -> None:
        """SIGTERM every live child, newest first (learners, PS, data, stats); after
        TERM_GRACE_S (or a second interrupt) SIGKILL the process trees. Blocks."""
        live = [c for c in reversed(self.children) if c.proc.poll() is None]
        for c in live:
            try:
                c.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TERM_GRACE_S
        while (
            any(c.proc.poll() is None for c in live)
            and time.monotonic() < deadline
            and not self.hurry
        ):
            time.sleep(0.05)
        self.cleanup()

    def cleanup(self) -> None:
        """SIGKILL anything of ours still alive, grandchildren included, and reap; show the
        notices not shown yet. Idempotent; safe to call from ``finally``."""
        for c in self.children:
            kill_tree(c)
            if c.echo is not None:  # it closes the pipe at EOF, which the kills ensure
                c.echo.join(timeout=2)
        if self.children:  # every exit, in the run's records
            with contextlib.suppress(OSError):
                self._write_processes()
        self.echo_notices()

    def run(self) -> int:
        """Start everything and supervise; returns 0, 1 or 130. Blocks until all stopped."""
        previous = self._install_signals()
        try:
            rc = self.start_all()
            rc = self.supervise() if rc is None else rc
            if rc == 1 and self.on_give_up is not None:
                self.on_give_up(self.failure or "it did not start; its rank's output says why")
            return rc
        finally:
            # Signals are still ours here, so an interrupt cannot cut the cleanup short.
            self.cleanup()
            for s, handler in previous.items():
                signal.signal(s, handler)


def join_server_files(cfg, run_dir, elsewhere: bool = False) -> None:
    """The end of a run of several servers where none could join their files into the run's
    ``weights.npy`` and ``ps_final.json`` (the last one died between writing its own and
    joining them, or the servers ran on ranks or hosts of their own): join the servers'
    files of the run of ``cfg`` in ``run_dir`` (``end_files.assemble`` over the shape's
    ``joined_dirs``; none for one server, whose files are the run's) once every server's are
    there, unless the run's ``ps_final.json`` already says training ended at
    ``train.epochs`` (a server, or an earlier call, joined them: the K files are not read and
    written again). ``elsewhere``: some servers ran on ranks of their own and write just
    after their ``done``, so wait up to ``ELSEWHERE_FILES_S`` for them, then say how to join
    them later. Best effort: says why it could not. Blocks for the files."""
    shape = ClusterShape.of(cfg)
    dirs = shape.joined_dirs(run_dir)
    if not dirs or final_done(run_dir, cfg.train.epochs) is not None:
        return
    deadline = time.monotonic() + (ELSEWHERE_FILES_S if elsewhere else 0)
    while True:
        try:
            joined = assemble(run_dir, dirs, cfg.train.epochs, shape.join)
        except (OSError, ValueError) as exc:
            print(f"rudra-zmq: could not join the servers' weights: {exc}", file=sys.stderr)
            return
        joined = joined or (run_dir / PS_FINAL_FILE).exists()  # here, or by a server
        if joined or time.monotonic() > deadline:
            break
        time.sleep(FILES_POLL_S)
    if not joined and elsewhere:
        print(
            f"rudra-zmq: the servers on ranks of their own left their weights on their "
            f"hosts ({dirs[-1].parent}/server-I there, not shared here): "
            f"copy those folders here, then `rudra-zmq run --resume {run_dir}` joins "
            "them into weights.npy",
            file=sys.stderr,
        )


# ----------------------------------------------------------------------------- entry point
def run(config_path, overrides=(), run_dir=None, resume=None) -> int:
    """Launch a whole run on this machine; blocks until it ends. Returns the exit code: 0
    success, 1 a role failed, 130 interrupted. ``resume``: a run directory to continue from
    its newest checkpoint (``config_path`` optional; ``resume.resume_config`` checks what may
    change). Raises ConfigError / FileNotFoundError (before any process starts, and before the
    run directory is made) for a bad config, data (:mod:`rudra_zmq.launch.preflight`, which also
    decodes image data once for every role), run directory or endpoint; resumed,
    record_fields.DamagedRecord for a damaged record of the run (``resume.check_records``)."""
    if resume is not None:
        from .resume import check_records, finished_note, resume_config

        cfg = resume_config(resume, config_path, list(overrides))
        note = finished_note(resume, cfg)
        if note is not None:  # a finished run with nothing to do: start nothing
            print(note, flush=True)
            return 0
        check_records(resume, cfg)
    else:
        cfg = config_mod.load_config(config_path, list(overrides))
    preflight.run(cfg)  # the data and extras checked, images decoded: before anything exists
    plan = make_plan(cfg, resume, resume=True) if resume is not None else make_plan(cfg, run_dir)
    print(summary(plan), flush=True)
    if (line := plaintext_warning("run", plan)) is not None:  # security.curve: false
        print(line, file=sys.stderr, flush=True)
    if resume is not None:
        print(f"  resuming from {checkpoints_root(plan.run_dir)}", flush=True)
    return Launcher(plan, resume=resume is not None).run()
