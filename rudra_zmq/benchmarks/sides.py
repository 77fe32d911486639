"""The two sides of a ``rudra-zmq bench`` command, so that it can run across two hosts.

A command runs its passive side with ``--bind EP``: an :class:`Agent`, a ROUTER answering JSON
requests (``{"op": ...}``) by binding data sockets, starting servers and so on; and its
measuring side with ``--connect EP``: a :class:`Control` client that asks the agent and prints
the figures. Without either, the measuring side starts the passive one as a subprocess on this
machine (``spawn_bind_side``), and inproc cases run the agent in a thread of the measuring
process (:class:`Sides`). When the control endpoint has a fixed port P, data sockets bind
P + 1, P + 2, ... so one port range is enough to open in a firewall.

Control messages are JSON on a socket pair of their own: a benchmark's private conversation,
not rudra_zmq's wire protocol (``rudra_zmq.wire``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import zmq

from .. import transport

CONTROL_TIMEOUT_S = 300.0  # a passive side silent this long while asked something: an error


class Agent:
    """The passive side of a two-sided benchmark: a ROUTER at ``bind`` answering JSON requests.

    ``handlers`` maps an ``op`` to ``fn(request) -> reply`` or ``(reply, after)``; ``after()``
    runs once the reply is sent (for handlers that must hand out an endpoint, then serve it).
    ``serve()`` blocks until an ``{"op": "quit"}`` request or ``idle_s`` without one.
    Not thread-safe: one thread owns the agent.
    """

    def __init__(self, ctx: zmq.Context, bind: str, handlers: dict, idle_s: float = 3600):
        self.ctx, self.handlers, self.idle_s = ctx, handlers, idle_s
        self.sock = transport.make_socket(ctx, zmq.ROUTER)
        self.endpoint = transport.bind(self.sock, bind)
        self.fixed_port = bind.startswith("tcp://") and bind.rsplit(":", 1)[1] not in ("0", "*")
        self._k = 0

    def data_endpoint(self, kind: str, slot: int = 1) -> str:
        """Where to bind a data socket of transport ``kind``: tcp on this agent's host, at the
        control port + ``slot`` if the control port was given (one port range to open in a
        firewall), else a random port; ipc a fresh socket file; inproc a fresh name."""
        self._k += 1
        if kind == "tcp":
            host = _host(self.endpoint) if self.endpoint.startswith("tcp") else "127.0.0.1"
            port = int(self.endpoint.rsplit(":", 1)[1]) + slot if self.fixed_port else 0
            return f"tcp://{host}:{port}"
        if kind == "ipc":
            return f"ipc:///tmp/rudra-bench-{os.getpid()}-{id(self)}-{self._k}.sock"
        if kind == "inproc":
            return f"inproc://rudra-bench-{id(self)}-{self._k}"
        raise ValueError(f"unknown transport {kind!r}: tcp, ipc or inproc")

    def serve(self) -> None:
        last = time.monotonic()
        try:
            while time.monotonic() - last < self.idle_s:
                if not self.sock.poll(200):
                    continue
                ident, body = self.sock.recv_multipart()
                req = json.loads(body)
                if req.get("op") == "quit":
                    self.sock.send_multipart([ident, b'{"ok": true}'])
                    return
                after = None
                try:
                    out = self.handlers[req["op"]](req)
                    if isinstance(out, tuple):
                        out, after = out
                    reply = {"ok": True, **out}
                except Exception as exc:  # reported to the measuring side, which raises
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                self.sock.send_multipart([ident, json.dumps(reply).encode()])
                if after is not None:
                    after()
                last = time.monotonic()
        finally:
            self.sock.close(linger=transport.LINGER_MS)


class Control:
    """The measuring side's connection to an :class:`Agent`. Not thread-safe."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float = CONTROL_TIMEOUT_S):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.sock = transport.make_socket(ctx, zmq.DEALER)
        self.sock.connect(endpoint)

    def send(self, op: str, **kw) -> None:
        self.sock.send(json.dumps({"op": op, **kw}).encode())

    def recv(self) -> dict:
        if not self.sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(
                f"the benchmark's other side at {self.endpoint} did not answer "
                f"within {self.timeout_s:.0f} s (is `--bind` running there?)"
            )
        reply = json.loads(self.sock.recv())
        if not reply.pop("ok"):
            raise RuntimeError(f"the other side ({self.endpoint}) failed: {reply['error']}")
        return reply

    def request(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.recv()

    def reachable(self, endpoint: str) -> str:
        """An endpoint the agent bound, with a wildcard host replaced by the one we dialled."""
        if endpoint.startswith("tcp://") and _host(endpoint) in ("0.0.0.0", "*", "[::]", "::"):
            return f"tcp://{_host(self.endpoint)}:{endpoint.rsplit(':', 1)[1]}"
        return endpoint

    def close(self, quit_agent: bool = False) -> None:
        if quit_agent:
            try:
                self.sock.send(b'{"op": "quit"}')
                self.sock.poll(2000)
            except zmq.ZMQError:
                pass
        self.sock.close(linger=0)


def _host(endpoint: str) -> str:
    return endpoint.split("://", 1)[1].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else ""


def spawn_bind_side(command: str, extra=(), timeout_s: float = 60.0):
    """Start ``python -m rudra_zmq bench COMMAND --bind tcp://127.0.0.1:0 EXTRA`` and return
    (process, control endpoint) once it printed ``listening on ENDPOINT``. Blocks."""
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "bench",
        command,
        "--bind",
        "tcp://127.0.0.1:0",
        "--idle-timeout",
        "600",
        "--exit-with-parent",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on " in line:
            return proc, line.rsplit("listening on ", 1)[1].split()[0]
    proc.kill()
    raise RuntimeError(f"`{' '.join(cmd)}` did not start (exit code {proc.poll()})")


def stop_bind_side(proc, control: Control | None) -> None:
    """Ask the spawned side to quit, then make sure it is gone."""
    if control is not None:
        control.close(quit_agent=True)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def add_side_args(p, what: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--bind",
        metavar="EP",
        help=f"run the passive side here ({what}) and serve the measuring side, "
        "e.g. tcp://0.0.0.0:5555",
    )
    g.add_argument(
        "--connect",
        metavar="EP",
        help="run the measuring side against a `--bind` side at EP "
        "(default: start one on this machine)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=3600,
        metavar="S",
        help="--bind: exit after S seconds without a request (default 3600)",
    )
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)


def close_bound(sock: zmq.Socket, endpoint: str) -> None:
    """Close a socket this side bound, and remove its ipc socket file (libzmq leaves it)."""
    sock.close(linger=0)
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://") :])
        except OSError:
            pass


def exit_with_parent(interval_s: float = 1.0) -> None:
    """Exit this process when its parent is gone (checked every ``interval_s`` from a daemon
    thread, even while the main thread blocks in C): a benchmark's helper process must not
    outlive a measuring side that was killed. Call once, first thing in a helper process."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def print_listening(what: str, endpoint: str) -> None:
    print(f"{what} listening on {endpoint}", flush=True)


class Sides:
    """The measuring side's view of the passive side(s) of one benchmark run.

    inproc cases need both sides in one process: their agent runs in a thread of this process
    (sharing ``ctx``). tcp/ipc cases talk to the agent at ``connect``, or, without it, to one
    spawned on this machine (``rudra-zmq bench COMMAND --bind ...``). ``close()`` stops what
    this object started. Not thread-safe.
    """

    def __init__(
        self, ctx: zmq.Context, command: str, connect: str | None, handlers_for, spawn_extra=()
    ):
        self.ctx, self.command, self.connect = ctx, command, connect
        self.handlers_for, self.spawn_extra = handlers_for, spawn_extra
        self._local = self._remote = self._proc = self._thread = None

    def control(self, kind: str) -> Control:
        if kind == "inproc":
            if self._local is None:
                agent = Agent(self.ctx, f"inproc://rudra-bench-ctl-{id(self)}", {})
                agent.handlers = self.handlers_for(self.ctx, agent)
                self._thread = threading.Thread(target=agent.serve, daemon=True, name="bench-agent")
                self._thread.start()
                self._local = Control(self.ctx, agent.endpoint)
            return self._local
        if self._remote is None:
            endpoint = self.connect
            if endpoint is None:
                self._proc, endpoint = spawn_bind_side(self.command, self.spawn_extra)
            self._remote = Control(self.ctx, endpoint)
        return self._remote

    def close(self) -> None:
        if self._local is not None:
            self._local.close(quit_agent=True)
            self._thread.join(10)
        if self._proc is not None:
            stop_bind_side(self._proc, self._remote)
        elif self._remote is not None:
            self._remote.close(quit_agent=False)


def serve_agent(
    what: str, bind: str, handlers_for, idle_s: float, with_parent: bool = False
) -> int:
    """``--bind``: run an agent in this process until told to quit (or idle, or, with
    ``with_parent``, until the process that started it is gone). Blocks."""
    if with_parent:
        exit_with_parent()
    transport.tune_malloc()
    ctx = zmq.Context()
    agent = Agent(ctx, bind, {}, idle_s)
    agent.handlers = handlers_for(ctx, agent)
    print_listening(what, agent.endpoint)
    try:
        agent.serve()
    finally:
        if "_close" in agent.handlers:  # what the handlers started (processes)
            agent.handlers["_close"]()
        ctx.destroy(linger=0)  # a data socket an error left open must not block the exit
    return 0
