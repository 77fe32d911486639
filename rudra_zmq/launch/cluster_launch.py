"""``rudra-zmq launch CONFIG --hostfile F``: one run across the hosts of a hostfile.

The plan comes from :mod:`rudra_zmq.launch.cluster_plan`; this module starts it. Roles on this host
start as processes, as under ``rudra-zmq run``; roles on other hosts start over ssh (or
pdsh) as ``python -m rudra_zmq.launch.host_guard ROLE ARGS`` in the run directory, which has the
same absolute path on every host. Before anything starts, each remote host gets
``config.yaml`` (and, with ``security.curve``, the run's keys) unless it shares this host's
file system (a marker file tells; :mod:`rudra_zmq.launch.run_dirs`). Every process's output
comes back here, each line prefixed ``host:label``, into ``RUN/logs/LABEL.log``.
``security.curve`` unset means CurveZMQ whenever a role runs on another host or listens beyond
loopback (``cluster_plan.place``); an explicit ``false`` there is said once on the terminal. A
launch that fails before every role is up removes the run directory it made, here and on the
hosts that did not share it.
Supervision, restarts and the stop order are :class:`rudra_zmq.launch.launcher.Launcher`'s;
stopping a remote role closes its ssh stdin, which its guard takes as the order to stop it,
and a lost connection does the same. At the end the server host's files (metrics, plots,
checkpoints) are copied back here when it does not share this file system. Blocks; use from
the main thread.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from .. import config as config_mod
from .. import timeline, transport
from ..config import ConfigError
from ..run_files import env_path, log_path
from . import cluster_plan, hostfile, preflight, run_plan
from .children import Child, echo_lines
from .launcher import Launcher
from .remote_commands import Commands
from .run_dirs import LaunchError, RemoteRunDirs, missing_dirs, remove_made
from .run_plan import role_env

SSH_FAILED = 255  # ssh's exit code for its own errors (not the remote command's)


class _RemotePopen(subprocess.Popen):
    """ssh (or pdsh) running one remote role. SIGTERM closes ssh's stdin, which the remote
    guard takes as the order to stop the role; under pdsh (no stdin) it goes to pdsh's ssh
    children first, whose end the guard notices, since pdsh does not pass it on."""

    def send_signal(self, sig):
        if sig == signal.SIGTERM and self.stdin is not None and not self.stdin.closed:
            try:
                self.stdin.close()
            except OSError:
                pass
            return
        if self.stdin is None and self.poll() is None:
            try:
                for kid in psutil.Process(self.pid).children(recursive=True):
                    kid.send_signal(sig)
            except psutil.Error:
                pass
        super().send_signal(sig)


class ClusterLauncher(Launcher):
    """Starts and supervises one run on many hosts. Use once, from the main thread."""

    def __init__(
        self,
        cp: cluster_plan.ClusterPlan,
        *,
        via: str = "ssh",
        ssh_options: list[str] = (),
        forward: dict[str, str] | None = None,
        python: str | None = None,
    ):
        super().__init__(cp.plan)
        self.commands = Commands(cp.plan.run_dir, via, ssh_options, python)
        self.cp, self.via, self.forward = cp, via, dict(forward or {})
        self.dirs = RemoteRunDirs(cp.plan.run_dir, self.commands, cp.host_names())
        self.all_up = False  # every role started and listening
        if plaintext_warning(cp) is not None:
            # `launch` said it once on the terminal (plaintext_warning): the roles keep quiet
            self.secrets[transport.PLAINTEXT_NAMED_ENV] = "1"

    def settings(self, host: str) -> dict:
        """What a remote guard reads first: the launcher's variables, the learners here."""
        return {"env": {**self.secrets, **self.forward}, "learners_here": self.cp.learners_on(host)}

    # -- hosts -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Give every remote host the run directory, ``config.yaml`` and keys (unless it shares
        our file system; ``run_dirs``), and under pdsh each guard its settings file. Raises
        LaunchError naming the host that failed. Blocks."""
        if self.via == "pdsh":  # pdsh forwards no stdin: the guard reads a 0600 file
            for host, label, _, _ in cluster_plan.commands(self.cp):
                path = env_path(self.plan.run_dir, label)
                path.touch(mode=0o600)
                path.write_text(json.dumps(self.settings(host)))
        self.dirs.prepare()

    # -- processes -------------------------------------------------------------------------
    def start(self, label: str, role: str, args: list[str]) -> Child:
        """Start one role on its host; blocks only for the fork/exec (and the first write)."""
        host = self.cp.placement[label]
        log_file = log_path(self.plan.run_dir, label)
        if hostfile.is_local(host):
            command = [sys.executable, "-m", "rudra_zmq", role, *args]
            env = {
                **role_env(self.plan.cfg, role, self.cp.learners_on(host)),
                **self.secrets,
                **self.forward,
            }
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                text=True,
                errors="replace",
            )
        else:
            command = self.commands.argv(host, label, role, args)
            proc = _RemotePopen(
                command,
                stdout=subprocess.PIPE,
                stdin=subprocess.PIPE if self.via == "ssh" else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
            )
            if self.via == "ssh":
                proc.stdin.write(json.dumps(self.settings(host)) + "\n")
                proc.stdin.flush()  # and keep it open: closing it stops the role
        child = Child(label, role, command, log_file, proc, args=list(args))
        child.echo = threading.Thread(
            target=echo_lines,
            args=(proc.stdout, log_file, child, f"{host}:{label} "),
            name=f"echo-{label}",
            daemon=True,
        )
        child.echo.start()
        self.children.append(child)
        self._write_processes()
        return child

    def _failed(self, c: Child) -> int | None:
        """As :meth:`Launcher._failed`, but a learner whose host was lost (ssh's own exit
        code 255: the connection failed or broke) is left out, not restarted there."""
        host = self.cp.placement[c.label]
        if c.proc.returncode != SSH_FAILED or hostfile.is_local(host) or self.via != "ssh":
            return super()._failed(c)
        self._report(c)
        print(
            f"rudra-zmq: lost host {host} (ssh exited {SSH_FAILED}: the connection failed "
            "or broke)",
            file=sys.stderr,
            flush=True,
        )
        if c.role == "learner" and self._others_learning():
            self.left_out.add(c.label)
            print(
                f"rudra-zmq: {c.label} is left out; the run goes on without it",
                file=sys.stderr,
                flush=True,
            )
            return None
        print(f"rudra-zmq: {c.label} ran on the lost host; stopping the run", file=sys.stderr)
        self.stop_all()
        return 1

    def _report(self, child: Child, early: bool = False) -> None:
        print(f"rudra-zmq: on host {self.cp.placement[child.label]}:", file=sys.stderr)
        super()._report(child, early)

    def start_all(self) -> int | None:
        rc = super().start_all()
        self.all_up = rc is None
        return rc

    def run(self) -> int:
        """Prepare the hosts, start everything, supervise, copy the results back. Blocks.
        A failure before every role is up removes the run directory from the hosts where
        this launch made it (the caller removes ours)."""
        try:
            self.prepare()
        except (LaunchError, OSError, subprocess.SubprocessError) as exc:
            print(f"rudra-zmq launch: {exc}", file=sys.stderr)
            self.dirs.discard()
            return 1
        rc = 1
        try:
            rc = super().run()
        finally:
            if self.all_up:
                self._copy_back()
            elif rc != 0:
                self.dirs.discard()
        return rc

    def _copy_back(self) -> None:
        """Bring the run directory home from the parameter servers' hosts, then the server
        host's (it wins where both wrote), where they do not share our file system; a
        sharded run's weights.npy and ps_final.json are then joined here if no host could
        (``end_files``). Best effort, as ``copy_back``."""
        cp = self.cp
        ps_hosts = {cp.placement[label] for label in cp.plan.shape.labels} - {cp.server_host}
        for host in sorted(ps_hosts):
            self.dirs.copy_back(host)
        self.dirs.copy_back(cp.server_host)
        self.join_servers()  # the servers' files are all here only now


# ----------------------------------------------------------------------------- entry point
def _ps_hosts(text: str | None) -> list[str] | None:
    """``--ps-hosts`` for ``cluster_plan.place``: None, ``["learners"]``, or checked host
    names (HostfileError naming a bad one)."""
    if not text or text == "learners":
        return [text] if text else None
    return hostfile.parse_names(text, "--ps-hosts")


def _forwarded(names: list[str]) -> dict[str, str]:
    """``-x NAME`` (its value here) or ``-x NAME=VALUE``; raises ConfigError for an unset one."""
    out = {}
    for item in names:
        name, eq, value = item.partition("=")
        if not eq:
            if name not in os.environ:
                raise ConfigError(
                    f"-x {name}: {name} is not set here; set it or give -x {name}=VALUE"
                )
            value = os.environ[name]
        out[name] = value
    return out


def plaintext_warning(cp: cluster_plan.ClusterPlan) -> str | None:
    """The one terminal line for a launch that others could reach in plaintext (the config
    said ``security.curve: false``), else None (``run_plan.plaintext_warning``)."""
    return run_plan.plaintext_warning("launch", cp.plan, cp.host_names())


def launch(args) -> int:
    """``rudra-zmq launch``: plan, print, and (without ``--dry-run``) run. Returns the exit
    code; raises ConfigError / HostfileError / TimelinePathError before anything starts
    (and creates nothing)."""
    trace = timeline.Output(args.timeline) if args.timeline else None
    cfg = config_mod.load_config(args.config, list(args.set))
    hosts = hostfile.load(args.hostfile, args.hosts, args.include, args.exclude)
    if args.launcher == "pdsh" and shutil.which("pdsh") is None:
        raise ConfigError(
            "--launcher pdsh: pdsh is not installed here (Debian: apt-get "
            "install pdsh); or use --launcher ssh"
        )
    forward = _forwarded(args.export)
    # the data and extras: checked (and images decoded) here when the servers run here;
    # on another host its roles decode once under the cache's lock (dataset_cache)
    preflight.run(
        cfg, local=hostfile.is_local(args.server_host or hosts[0].name), decode=not args.dry_run
    )
    target = Path(args.run_dir or cfg.runtime.run_dir).absolute()
    made = [] if args.dry_run else missing_dirs(target)
    had = set(os.listdir(target)) if args.run_dir and target.is_dir() else set()
    cp = cluster_plan.place(
        cfg,
        hosts,
        server_host=args.server_host,
        ps_hosts=_ps_hosts(args.ps_hosts),
        port=args.port,
        run_dir=args.run_dir,
        create=not args.dry_run,
    )
    if not args.dry_run and args.run_dir is None:
        made.insert(0, cp.plan.run_dir)  # a new NAME-STAMP folder under runtime.run_dir
    print(
        f"rudra-zmq launch {cfg.name!r} on {hostfile.describe(hosts)}; run directory "
        f"{cp.plan.run_dir}\n{cluster_plan.describe(cp)}",
        flush=True,
    )
    warning = plaintext_warning(cp)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.dry_run:
        print(f"  ssh: {cluster_plan.LOCAL_RULE}")
        commands = Commands(cp.plan.run_dir, args.launcher, shlex.split(args.ssh_opts), args.python)
        for host, label, role, role_args in cluster_plan.commands(cp):
            print(f"{host}:{label}$ {shlex.join(commands.argv(host, label, role, role_args))}")
        return 0
    rc, launcher, base = 1, None, None
    if trace is not None:  # every role, here or remote, writes its part beside the trace
        base = forward[timeline.ENV] = trace.base()
    try:
        launcher = ClusterLauncher(
            cp,
            via=args.launcher,
            ssh_options=shlex.split(args.ssh_opts),
            forward=forward,
            python=args.python,
        )
        rc = launcher.run()
    finally:
        if rc != 0 and (launcher is None or not launcher.all_up):
            remove_made(cp.plan.run_dir, made, had)
        said = trace.close_run(base) if trace is not None else None
        if said:
            print(said, flush=True)
    return rc


def add_parser(sub) -> None:
    """Register ``rudra-zmq launch``."""
    p = sub.add_parser(
        "launch",
        help="run every role across the hosts of a hostfile (over ssh)",
        description="Place the roles of one run on the hosts of a hostfile (one slot = one "
        "learner; the servers on the first host), start them over ssh, show "
        "every host's output, and stop them all when training ends or anything "
        "fails. Every host needs rudra_zmq installed at the same python path "
        "(--python) and the run directory's path writable.",
    )
    p.add_argument("config", metavar="CONFIG", help="YAML config file (or a built-in name)")
    p.add_argument(
        "--hostfile", metavar="F", help="'host slots=N' lines (Open MPI, DeepSpeed, Horovod)"
    )
    p.add_argument("-H", "--hosts", metavar="HOST:N,...", help="hosts and slots inline")
    p.add_argument("--include", metavar="SPEC", help="only these hosts/slots: h1@h2:0,2")
    p.add_argument("--exclude", metavar="SPEC", help="not these hosts/slots: h1@h2:0,2")
    p.add_argument(
        "--server-host",
        metavar="HOST",
        help="where the PS, data and statistics servers run (default: first host)",
    )
    p.add_argument(
        "--ps-hosts",
        metavar="HOST[,HOST...]|learners",
        help="where the parameter servers run (architecture.servers: server I on the I-th "
        "host, cycling), on dedicated hosts or beside the learners ('learners': on the "
        "learners' hosts in order); default: the server host",
    )
    p.add_argument(
        "--port",
        type=int,
        default=cluster_plan.DEFAULT_PORT,
        help=f"first port used on each host (default {cluster_plan.DEFAULT_PORT})",
    )
    p.add_argument(
        "--launcher",
        choices=("ssh", "pdsh"),
        default="ssh",
        help="how to start remote roles (default ssh)",
    )
    p.add_argument(
        "--ssh-opts",
        default="",
        metavar="OPTS",
        help='extra ssh options, e.g. "-p 2222 -i ~/.ssh/cluster"',
    )
    p.add_argument(
        "-x",
        "--export",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="forward an environment variable to every role (repeatable)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help=f"python on the remote hosts (default: this one, {sys.executable})",
    )
    p.add_argument("--run-dir", metavar="DIR", help="run directory, the same path on every host")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and each host's exact commands; start nothing",
    )
    p.add_argument(
        "--timeline",
        metavar="FILE",
        help="write a Chrome/Perfetto trace of the run to FILE, as `run --timeline`; every "
        "host writes its roles' parts beside FILE, so its folder must be on a file system "
        "the hosts share (as the run directory may be)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable)",
    )
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    try:
        return launch(args)
    except (
        ConfigError,
        hostfile.HostfileError,
        FileNotFoundError,
        timeline.TimelinePathError,
    ) as exc:
        print(f"rudra-zmq: error: {exc}", file=sys.stderr)
        return 2
