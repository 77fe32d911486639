"""``rudra-zmq run`` whose first parameter server kills itself (SIGKILL) at a named point of
its shutdown (tests/test_ps_shutdown.py) or of training (tests/test_fault_servers.py).

    python tests/ps_crash.py run CONFIG --run-dir DIR [--set ...]    (the launcher)
    python tests/ps_crash.py worker CONFIG --rank R ...              (a worker rank's)
    python tests/ps_crash.py ps ARGS...                              (the PS it starts)

The launcher is the real one with its PS command pointed at this file; the PS is the real one
with one method wrapped, in its first incarnation only (a restarted one has ``--resume``).
``PS_CRASH_AT`` names the point; ``PS_CRASH_STOP`` the STOP (1-based) ``stopping`` dies at;
``PS_CRASH_TS`` the timestamp whose checkpoint ``checkpoint`` dies right after (mid-training
on any host, where a kill from outside can land after the end on a fast one), whose update
``update`` dies right after (with or without checkpoints), or from which
``part-ahead`` dies once parts of a round went ahead (``wire.parts``: the round half in);
``PS_CRASH_SHARD``, in a sharded run, the server (``--shard I``) that dies (default: each);
``PS_CRASH_PARENT=1``: its launcher (a worker rank: the whole rank) is killed first;
``PS_CRASH_PLAN``: several kills, of any server, in any incarnation (``planned``).
"""

import os
import signal
import sys
import time
from pathlib import Path

from rudra_zmq import cli
from rudra_zmq.launch import launcher
from rudra_zmq.server import checkpointing, ps, report, weights

POINTS = (
    "checkpoint",
    "update",
    "part-ahead",
    "stopping",
    "stopping-unsent",
    "finishing",
    "sending-done",
    "after-final",
    "after-final-unsent",
)


def die():
    if os.environ.get("PS_CRASH_PARENT") == "1":  # the host lost, not only the server:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (its launcher's death sends it a
        os.kill(os.getppid(), signal.SIGKILL)  # SIGTERM, which would finish it cleanly)
    os.kill(os.getpid(), signal.SIGKILL)


def before(cls, name, when=lambda: True):
    """Die on entering ``cls.name`` once ``when()`` says so."""
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        if when():
            die()
        return original(*args, **kwargs)

    setattr(cls, name, wrapped)


def after(cls, name, when=lambda *args: True):
    """Die as soon as ``cls.name`` returned, if ``when(*args)`` says so."""
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        original(*args, **kwargs)
        if when(*args):
            die()

    setattr(cls, name, wrapped)


def unsent(cls, name, when=lambda *args: True):
    """``cls.name`` does nothing when ``when(*args)`` says so: what it would have sent to
    the statistics server is lost (as when the process dies before ZeroMQ sent it)."""
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        if not when(*args):
            original(*args, **kwargs)

    setattr(cls, name, wrapped)


def wait_for_server_0(module, name):
    """``module.name(files_dir, ...)`` first waits (at most 60 s) for server 0's final file
    beside ``files_dir``: server 0 finished before this one, so it found nothing to join."""
    original = getattr(module, name)

    def wrapped(files_dir, *args, **kwargs):
        other = Path(files_dir).parent / "server-0" / "ps_final.json"
        deadline = time.monotonic() + 60
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return original(files_dir, *args, **kwargs)

    setattr(module, name, wrapped)


def arm(point: str) -> None:
    if point == "checkpoint":  # training: the checkpoint at PS_CRASH_TS just written
        ts = int(os.environ["PS_CRASH_TS"])
        after(
            checkpointing.CheckpointSchedule,
            "save",
            lambda _schedule, state: state.engine.timestamp >= ts,
        )
    elif point == "update":  # training: the update to PS_CRASH_TS just applied (its
        ts = int(os.environ["PS_CRASH_TS"])  # replies queued, maybe not sent), no checkpoint
        after(
            ps.ParameterServer,
            "_after_update",
            lambda _server, update: update.timestamp >= ts,
        )
    elif point == "part-ahead":  # training, wire.parts: parts of a round just sent ahead, the
        ts = int(os.environ["PS_CRASH_TS"])  # round open (at timestamp PS_CRASH_TS or later)
        after(
            weights.ReplyWeights,
            "ahead",
            lambda out, ready: bool(ready) and out.state.engine.timestamp >= ts,
        )
    elif point == "stopping":  # training over (its checkpoint written); STOP number k
        calls, k = [], int(os.environ.get("PS_CRASH_STOP", "1"))
        before(ps.ParameterServer, "_stop", lambda: calls.append(1) or len(calls) >= k)
    elif point == "stopping-unsent":  # as stopping (the first STOP), its final EVAL and
        unsent(report.PSReport, "done")  # "done" lost whatever their order: the statistics
        unsent(report.PSReport, "evaluate", lambda _report, state: state.done)  # server
        before(ps.ParameterServer, "_stop")  # cannot end the run by itself
    elif point == "finishing":  # every learner told; before the final checkpoint
        before(ps.ParameterServer, "_finish")
    elif point == "sending-done":  # the "done" record just handed to ZeroMQ
        after(report.PSReport, "done")
    elif point == "after-final":  # ps_final.json written
        after(ps, "write_end_files")
    elif point == "after-final-unsent":  # as after-final, its final EVAL and "done" lost,
        unsent(report.PSReport, "done")  # and server 0 done first (so no server joins);
        unsent(report.PSReport, "evaluate", lambda _report, state: state.done)
        wait_for_server_0(ps, "write_end_files")  # its STOPs, queued before, get 1 s to leave
        after(ps, "write_end_files", lambda *args: time.sleep(1.0) or True)
    else:
        raise SystemExit(f"PS_CRASH_AT={point!r}: one of {', '.join(POINTS)}")


def shard_armed(args) -> bool:
    """Whether the PS started with ``args`` is the one ``PS_CRASH_SHARD`` names (any if unset)."""
    want = os.environ.get("PS_CRASH_SHARD")
    mine = args[args.index("--shard") + 1] if "--shard" in args else "0"
    return want is None or want == mine


def planned(args) -> bool:
    """``PS_CRASH_PLAN`` (``SERVER:TS,SERVER:TS,...``): this server's k-th start (counted in
    ``RUN/.crash-starts-I``) dies right after its update to the k-th TS listed for it, with
    ``PS_CRASH_AT=update`` (with or without checkpoints; restarted ones too). Returns whether
    a plan is given (then nothing else is armed)."""
    plan = os.environ.get("PS_CRASH_PLAN")
    if not plan:
        return False
    me = int(args[args.index("--shard") + 1]) if "--shard" in args else 0
    mine = [int(ts) for s, ts in (e.split(":") for e in plan.split(",")) if int(s) == me]
    count = Path(args[args.index("--run-dir") + 1]) / f".crash-starts-{me}"
    k = int(count.read_text()) if count.exists() else 0
    count.write_text(str(k + 1))
    if k < len(mine):
        os.environ["PS_CRASH_TS"] = str(mine[k])
        arm("update")
    return True


def main(argv) -> int:
    role, args = argv[0], argv[1:]
    if role in ("run", "worker"):  # a launcher (a server rank's too): its PS is this file
        here = os.path.abspath(__file__)
        real = launcher._role_command
        launcher._role_command = lambda r, a: (
            [sys.executable, here, r, *a] if r == "ps" else real(r, a)
        )
    elif planned(args):
        pass
    elif "--resume" not in args and shard_armed(args):
        arm(os.environ["PS_CRASH_AT"])
    return cli.main([role, *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
