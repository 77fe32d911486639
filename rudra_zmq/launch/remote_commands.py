"""How ``rudra-zmq launch`` reaches a host and starts a role there: the command lines only.

A host that is this machine (:func:`rudra_zmq.launch.hostfile.is_local`) runs a role as a child,
``python -m rudra_zmq ROLE ARGS``; any other goes through ``ssh`` (or ``pdsh -R ssh``) as
``cd RUN_DIR && exec PYTHON -m rudra_zmq.launch.host_guard ROLE ARGS``. Pure: builds argv lists, runs
nothing; what ``--dry-run`` prints and what :class:`rudra_zmq.launch.cluster_launch.ClusterLauncher`
starts. Thread-safe.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..run_files import env_path
from . import hostfile

SSH_OPTIONS = [
    "-o",
    "BatchMode=yes",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
    "-o",
    "ConnectTimeout=10",
]


class Commands:
    """The command lines of one launch: how a host is reached (ssh or pdsh, with the user's
    options) and how a role starts there. Pure; what ``--dry-run`` prints."""

    def __init__(
        self,
        run_dir: Path,
        via: str = "ssh",
        ssh_options: list[str] = (),
        python: str | None = None,
    ):
        self.run_dir, self.via, self.ssh_options = run_dir, via, list(ssh_options)
        self.python = python or sys.executable

    def remote(self, host: str, command: str) -> list[str]:
        """The local argv that runs the shell ``command`` on ``host``."""
        if self.via == "pdsh":
            return ["pdsh", "-N", "-S", "-R", "ssh", "-w", host, command]
        # the user's options first: for each option ssh uses the first value it is given
        return ["ssh", *self.ssh_options, *SSH_OPTIONS, host, command]

    def role_command(self, host: str, label: str, role: str, args: list[str]) -> str:
        """The shell command that starts one role on a remote host."""
        run_dir = shlex.quote(str(self.run_dir))
        guard = [self.python, "-m", "rudra_zmq.launch.host_guard"]
        if self.via == "pdsh":
            guard += ["--env-file", str(env_path(self.run_dir, label))]
        return f"cd {run_dir} && exec {shlex.join(guard + [role, *args])}"

    def argv(self, host: str, label: str, role: str, args: list[str]) -> list[str]:
        """The local argv that starts one role: a child here, else through ssh/pdsh."""
        if hostfile.is_local(host):
            return [sys.executable, "-m", "rudra_zmq", role, *args]
        return self.remote(host, self.role_command(host, label, role, args))
