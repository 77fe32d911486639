"""How a role process is prepared before it runs (``rudra-zmq ps|learner|node|data|stats``).

``serve(role_module, threads, torch_too, call)`` does it in order: glibc malloc set to reuse
heap memory for large buffers (``transport.tune_malloc``); logging at INFO to stderr, which the
launcher sends to the role's log; the role module imported; the compiled kernels (and torch)
set to the role's thread count (``set_threads``); SIGTERM turned into KeyboardInterrupt, as
Ctrl-C is, so the role's ``finally`` blocks close their sockets and write what they have; and
under ``rudra-zmq run`` a role that does not outlive its launcher (``follow_launcher``: the
kernel's parent-death signal, and a watchdog thread that ends a role whose clean-up is stuck
``ORPHAN_GRACE_S`` after the launcher died). Then it calls the role, blocking until it returns.

Called on a process's main thread (``signal.signal`` requires it), once per process.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time


def set_threads(n: int, *, torch_too: bool) -> None:
    """Use ``n`` threads in the compiled kernels and, if ``torch_too`` or torch is already
    imported, in torch (intra-op ``n``, inter-op 1). Call before the role starts work."""
    from .. import kernels

    kernels.set_num_threads(n)
    if not torch_too and "torch" not in sys.modules:
        return  # do not pay for `import torch` in a role that never uses it
    import torch

    torch.set_num_threads(n)
    try:  # allowed only once per process, and only before any inter-op work started
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


ORPHAN_GRACE_S = 15.0  # a role's clean exit after its launcher died, before a hard exit


def follow_launcher(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Under ``rudra-zmq run`` (``RUDRA_ZMQ_LAUNCHER_PID`` set), make sure this role does not
    outlive its launcher, even one killed by SIGKILL. A no-op elsewhere. Does not block.

    Linux sends the role SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), so its
    SIGTERM handling closes sockets and writes what it has. A daemon thread also watches the
    parent pid: if the role is still alive ``grace_s`` after the launcher is gone -- its
    cleanup is stuck somewhere, or it ignored the signal -- faulthandler writes every
    thread's stack to the role's log (stderr) and the process exits with status 1 from a C
    thread, which needs no GIL.
    """
    want = os.environ.get("RUDRA_ZMQ_LAUNCHER_PID")
    if not want or not sys.platform.startswith("linux"):
        return
    launcher = int(want)
    import ctypes
    import threading

    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        pass
    threading.Thread(
        target=_exit_when_orphaned, args=(launcher, grace_s), daemon=True, name="launcher-watch"
    ).start()
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        raise KeyboardInterrupt(signal.SIGTERM)


def _exit_when_orphaned(launcher_pid: int, grace_s: float) -> None:
    """Thread body: poll the parent pid; once the launcher is gone, arm a hard exit."""
    import faulthandler

    while os.getppid() == launcher_pid:
        time.sleep(0.5)
    try:
        faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)
    except (ValueError, OSError, AttributeError):  # stderr unusable: exit without a dump
        time.sleep(grace_s)
        os._exit(1)


# The role a trace names each process by (rudra-zmq run --timeline), from its module.
TRACE_NAMES = {
    "rudra_zmq.server.ps": "ps",
    "rudra_zmq.learner.learner": "learner",
    "rudra_zmq.tree.node": "tree_node",
    "rudra_zmq.data.server": "data_server",
    "rudra_zmq.stats.server": "stats_server",
}


def serve(role_module: str, threads: int, torch_too: bool, call):
    """Prepare this process for a role and run ``call(module)``, ``module`` being the role's
    module ``role_module`` (a dotted name: ``rudra_zmq.server.ps``) imported; blocks until
    it returns.

    SIGTERM raises KeyboardInterrupt here, like Ctrl-C, so the role's ``finally`` blocks close
    their sockets when a launcher stops it (a role may install its own handler instead).
    """
    from .. import timeline, transport

    transport.tune_malloc()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    from .. import kernels

    module = importlib.import_module(role_module)
    set_threads(threads, torch_too=torch_too)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    # the variant in use, once (nothing could log it at import); after the handler, so that a
    # role's first log line says a SIGTERM from then on stops it with its "stopped by" line
    kernels.log_choice()
    follow_launcher()
    # rudra-zmq run --timeline: this role's part
    timeline.start_from_env(TRACE_NAMES.get(role_module, role_module))
    try:
        return call(module)
    finally:
        timeline.stop()
        signal.signal(signal.SIGTERM, previous)


__all__ = ["serve", "set_threads", "follow_launcher", "ORPHAN_GRACE_S"]
