"""Start-up of a launcher's roles: each as soon as the servers it sends to accept
connections (``run_plan.role_steps``), and no sooner; a server that exits, or neither listens
nor writes to its log for ``runtime.timeout_s``, stops the run. Used by ``launcher.Launcher``
(and its multi-host subclass) through ``Launcher.start_all``."""

from __future__ import annotations

import sys
import time

from ..run_files import config_path
from . import console
from .children import Child, accepting, log_size
from .run_plan import role_steps


def start_all(launcher) -> int | None:
    """Start every role as soon as the servers it sends to accept connections
    (``run_plan.role_steps``): stats and data at once, the PS once the stats server
    listens, learners once their PS (or tree node), the data and the stats server listen.
    Never earlier: a PUSH that closes before its peer is up loses its messages. Blocks
    until all are started and every server listens; returns None then, else the run's
    exit code (all stopped)."""
    conf = ["--config", str(config_path(launcher.plan.run_dir))]
    began = time.monotonic()
    waiting = list(role_steps(launcher.plan, launcher.resume))
    if launcher.local is not None:  # only ours; another rank's servers are not waited for
        waiting = [
            s._replace(after=tuple(a for a in s.after if a in launcher.local))
            for s in waiting
            if s.label in launcher.local
        ]
    servers = {s.label for s in waiting if s.label in launcher.plan.endpoints}
    listening: set[str] = set()
    while True:
        ready = [s for s in waiting if listening.issuperset(s.after)]
        for label, role, args, _ in ready:
            if launcher.interrupted:
                return launcher.interrupt()
            try:
                launcher.start(label, role, conf + args)
            except OSError as exc:
                print(f"rudra-zmq: could not start {label}: {exc}", file=sys.stderr)
                launcher.stop_all()
                return 1
        waiting = [s for s in waiting if s not in ready]
        if ready:  # a line per batch: importing torch makes the start-up take seconds
            console.startup([s.label for s in ready], "started", began)
        started = [c for c in launcher.children if c.label in servers - listening]
        if not waiting and not started:
            return None
        if not started:  # a plan error, not the user's: say it rather than wait forever
            raise RuntimeError(
                f"{waiting[0].label} waits for {waiting[0].after}, which no role of the plan serves"
            )
        up, rc = wait_ready(launcher, started)
        if rc is not None:
            return rc
        listening.update(c.label for c in up)
        console.startup([c.label for c in up], "listening", began)


def wait_ready(launcher, servers: list[Child]) -> tuple[list[Child], int | None]:
    """Block until at least one of ``servers`` accepts connections on its endpoint;
    returns (those that do, None). Returns ([], the run's exit code), all stopped, when a
    child exits, we are interrupted, or a server is silent for runtime.timeout_s: it
    neither accepts connections nor writes to its log (a server decoding a dataset with
    a progress line is never too slow, a hung one is stopped)."""
    timeout = launcher.plan.cfg.runtime.timeout_s
    heard = launcher.heard  # label -> (when its log last grew, its size then)
    for c in servers:
        heard.setdefault(c.label, (time.monotonic(), log_size(c)))
    while True:
        if launcher.interrupted:
            return [], launcher.interrupt()
        for c in launcher.children:
            if c.proc.poll() is not None:
                launcher._report(c, early=c.proc.returncode == 0)
                launcher.stop_all()
                return [], 1
        up = [c for c in servers if accepting(launcher.plan.endpoints[c.label])]
        if up:
            return up, None
        now = time.monotonic()
        for c in servers:
            size = log_size(c)
            if size != heard[c.label][1]:
                heard[c.label] = (now, size)
            elif now - heard[c.label][0] > timeout:
                console.silent(c, launcher.plan.endpoints[c.label], timeout)
                launcher.stop_all()
                return [], 1
        time.sleep(0.05)
