"""Where a run's servers listen when ``rudra-zmq run`` plans them: an ipc socket in the run
directory or a free tcp port of runtime.host. Each bad value is refused with one ConfigError
that names it and says what to do (the PS, data and stats servers, tree nodes and the
broadcast all go through here). Pure but for the port probe; thread-safe."""

from __future__ import annotations

import os

from . import transport
from .config import ConfigError

IPC_PATH_MAX = 107  # sun_path is 108 bytes on Linux, including the NUL


def ipc_endpoint(run_dir, label: str) -> str:
    """``ipc://RUN_DIR/LABEL.sock``; raises ConfigError when the path is too long for a Unix
    socket (the run directory need not exist yet)."""
    path = os.path.join(run_dir, f"{label}.sock")
    if len(path) > IPC_PATH_MAX:
        raise ConfigError(
            f"the ipc socket path {path!r} is longer than {IPC_PATH_MAX} bytes, the limit of a "
            "Unix socket; use a shorter runtime.run_dir or --run-dir, or runtime.transport=tcp"
        )
    return f"ipc://{path}"


def tcp_endpoint(host: str) -> str:
    """A free tcp port of ``host`` (from ``$RUDRA_ZMQ_PORTS`` if set); raises ConfigError
    naming a host that is not this machine's, a bad port range or one with no port left."""
    try:
        return transport.free_tcp_endpoint(host)
    except transport.NoFreePort as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(
            f"runtime.host {host!r}: cannot bind a port there ({exc}); use an address of "
            "this machine"
        ) from None
    except ValueError as exc:  # $RUDRA_ZMQ_PORTS (transport.PORTS_ENV)
        raise ConfigError(str(exc)) from None


def server_endpoint(cfg, run_dir, label: str, ipc: bool | None = None) -> str:
    """The endpoint of server ``label``: ipc in ``run_dir`` when ``ipc`` (default: when
    runtime.transport is ipc), else a tcp port of runtime.host. Raises ConfigError."""
    if ipc is None:
        ipc = cfg.runtime.transport == "ipc"
    return ipc_endpoint(run_dir, label) if ipc else tcp_endpoint(cfg.runtime.host)
