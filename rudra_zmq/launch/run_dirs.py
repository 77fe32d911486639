"""A launch's run directory on every host: made, with ``config.yaml`` and the keys, on the
hosts that do not share this file system; copied back from the server host at the end; and
removed, here and there, when the launch never trained.

Used by :mod:`rudra_zmq.launch.cluster_launch` (``rudra-zmq launch``). The run directory has
the same absolute path on every host; a marker file with a fresh token tells a host that shares
this file system. Everything here blocks, each remote step for at most ``COPY_TIMEOUT_S``.
"""

from __future__ import annotations

import io
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from ..run_files import CONFIG_FILE, KEYS_DIR, LAUNCH_ID_FILE, LOG_DIR, config_path
from . import hostfile
from .remote_commands import Commands

MARKER = LAUNCH_ID_FILE  # in the run directory: tells a shared file system
COPY_TIMEOUT_S = 300.0


class LaunchError(RuntimeError):
    """A host could not be prepared or reached: the message names it and what ssh said."""


class RemoteRunDirs:
    """The run directory on the remote hosts of one launch: which share our file system
    (``shared``) and where this launch made it (``made``). Use from one thread."""

    def __init__(self, run_dir: Path, commands: Commands, hosts: list[str]):
        self.run_dir, self.commands, self.hosts = run_dir, commands, list(hosts)
        self.shared: dict[str, bool] = {}  # remote host -> shares our file system
        self.made: list[str] = []  # remote hosts where we made the run directory

    def prepare(self) -> None:
        """Give every remote host the run directory, ``config.yaml`` and keys (unless it shares
        our file system). Raises LaunchError naming the host that failed. Blocks."""
        token = secrets.token_hex(8)
        (self.run_dir / MARKER).write_text(token)
        payload = io.BytesIO()
        with tarfile.open(fileobj=payload, mode="w") as tar:
            tar.add(config_path(self.run_dir), arcname=CONFIG_FILE)
            if (self.run_dir / KEYS_DIR).is_dir():
                tar.add(self.run_dir / KEYS_DIR, arcname=KEYS_DIR)
        run_dir = shlex.quote(str(self.run_dir))
        script = (
            f"new=old; [ -e {run_dir} ] || new=new; mkdir -p {run_dir}/{LOG_DIR} && "
            f"cd {run_dir} && "
            f'if [ "$(cat {MARKER} 2>/dev/null)" = {token} ]; then echo shared; '
            f"else tar -xf - && echo copied $new; fi"
        )
        for host in self.hosts:
            if hostfile.is_local(host):
                continue
            res = subprocess.run(
                self.commands.remote(host, script),
                input=payload.getvalue(),
                capture_output=True,
                timeout=COPY_TIMEOUT_S,
            )
            said = res.stdout.decode(errors="replace").split()
            if res.returncode != 0 or not said:
                how = " ".join(self.commands.remote(host, "..."))
                raise LaunchError(
                    f"could not prepare {host} ({how} exited {res.returncode}): "
                    f"{res.stderr.decode(errors='replace').strip()[-500:]}"
                )
            self.shared[host] = said[-1] == "shared"
            if said[-1] == "new":
                self.made.append(host)

    def discard(self) -> None:
        """Remove the run directory from the hosts where this launch made it (it never
        trained). Best effort, bounded by COPY_TIMEOUT_S per host; blocks."""
        for host in self.made:
            try:
                rm = f"rm -rf -- {shlex.quote(str(self.run_dir))}"
                subprocess.run(
                    self.commands.remote(host, rm), capture_output=True, timeout=COPY_TIMEOUT_S
                )
            except (OSError, subprocess.SubprocessError):
                pass

    def copy_back(self, host: str) -> None:
        """Copy ``host``'s run directory (metrics, plots, checkpoints) here, when it does not
        share our file system. Best effort: a failure is reported, not raised."""
        if hostfile.is_local(host) or self.shared.get(host, True):
            return
        script = f"tar -C {shlex.quote(str(self.run_dir))} --exclude=./{LOG_DIR} -cf - ."
        try:
            res = subprocess.run(
                self.commands.remote(host, script), capture_output=True, timeout=COPY_TIMEOUT_S
            )
            if res.returncode != 0:
                raise LaunchError(res.stderr.decode(errors="replace").strip()[-500:])
            with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
                tar.extractall(self.run_dir, filter="data")
        except (OSError, subprocess.SubprocessError, tarfile.TarError, LaunchError) as exc:
            print(
                f"rudra-zmq: could not copy the run directory back from {host} ({exc}); "
                f"it is still there, in {self.run_dir}",
                file=sys.stderr,
            )


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its ancestors that do not exist yet, deepest first."""
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_made(run_dir: Path, made: list[Path], had: set[str]) -> None:
    """Undo what this launch wrote here for a run that never trained: the run directory and
    the empty parents it made for it (``made``, from :func:`missing_dirs`), or, in a
    directory that was there before (holding ``had``), what it wrote there. Says so in one
    line."""
    if run_dir in made:
        shutil.rmtree(run_dir, ignore_errors=True)
        for p in made[made.index(run_dir) + 1 :]:
            try:
                p.rmdir()  # only if empty: never a folder with something else in it
            except OSError:
                break
        print(f"rudra-zmq launch: removed {run_dir} (no training started there)", file=sys.stderr)
        return
    for name in set(os.listdir(run_dir)) - had:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    print(
        f"rudra-zmq launch: removed what this launch wrote in {run_dir} (no training "
        "started there)",
        file=sys.stderr,
    )
