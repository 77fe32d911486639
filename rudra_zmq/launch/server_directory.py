"""Where the servers of a sharded run under ``rudra-zmq worker`` are: rank 0 keeps a directory.

With ``architecture.servers: K`` and K + (learner processes) ranks, ranks 1 .. K-1 each run
one server (ps-lite's convention: the servers come after the scheduler, before the workers).
Such a rank binds on its own host, so nobody knows its address in advance: it *registers*
with rank 0's directory (its server index and endpoint) and gets the run directory and run
token back; a learner rank *looks up* the K endpoints, in range order, before it starts.

The directory is a REP socket on rank 0, at the port after the run's last server port; a
request is one msgpack map (``{"op": "register", "server": I, "endpoint": "tcp://..."}`` or
``{"op": "lookup"}``), checked before it touches anything; a lookup before every server has
registered answers which are missing, and the client asks again. With CURVE the directory is
a CURVE server and only the ``ps`` key may register (it gets the run token).

A server rank whose server cannot go on (it failed and is not restarted) says so:
``{"op": "failed", "server": I, "why": "..."}`` (the ``ps`` key alone, under CURVE). Rank 0's
launcher then stops the run with that reason, where it would otherwise wait for that
server's records forever. A server rank also says ``{"op": "alive", "server": I}`` every
``ALIVE_S`` (or a quarter of ``runtime.timeout_s``; ``Heartbeat``) and
``{"op": "bye", "server": I}`` when it ends: one silent for ``runtime.timeout_s`` without a
bye (its host or its launcher gone, which nobody else would report under a plain launch
script) stops the run the same way.
"""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import zmq

from .. import wire
from ..config import ConfigError
from ..security import auth
from ..shape import ClusterShape

MAX_REQUEST = 1024  # bytes: a register request is about 60
MAX_WHY = 400  # characters of a failed server's reason
POLL_MS = 200  # how often the directory looks at its stop flag
RETRY_S = 0.5  # a client asks again this often while servers are missing
ALIVE_S = 2.0  # a server rank says it is alive this often
SERVER_OPS = ("register", "failed", "alive", "bye")  # what only a server rank may send


def advertised_address(master: str) -> str:
    """This host's address as the master ``master`` would reach it: the source address of
    a route to it (no packet is sent). Blocks for a name lookup."""
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, 9))
        except OSError as exc:
            raise ConfigError(f"no route to the master address {master!r}: {exc}") from exc
        return s.getsockname()[0]


def _check(req, servers: int) -> str | None:
    """Why the decoded request ``req`` is not one we serve, or None. Pure."""
    if not isinstance(req, dict) or req.get("op") not in ("lookup", *SERVER_OPS):
        return "expected a map with op 'lookup', 'register', 'failed', 'alive' or 'bye'"
    if req["op"] == "lookup":
        return None if len(req) == 1 else "a lookup has no other fields"
    i = req.get("server")
    if req["op"] in ("alive", "bye"):
        if set(req) != {"op", "server"}:
            return f"'{req['op']}' has exactly op and server"
    elif req["op"] == "failed":
        if set(req) != {"op", "server", "why"}:
            return "a 'failed' request has exactly op, server and why"
        why = req["why"]
        if not isinstance(why, str) or not 0 < len(why) <= MAX_WHY:
            return f"why must be a text of 1 to {MAX_WHY} characters"
    elif set(req) != {"op", "server", "endpoint"}:
        return "a register has exactly op, server and endpoint"
    if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i < servers:
        return f"server must be an integer from 1 to {servers - 1}, got {i!r}"
    ep = req.get("endpoint", "tcp://")
    if not isinstance(ep, str) or not ep.startswith("tcp://") or len(ep) > 256:
        return f"endpoint must be a tcp:// endpoint, got {ep!r}"
    return None


class Directory:
    """Rank 0's directory of a sharded run's servers, served by a thread of its own.

    ``first``: server 0's endpoint (rank 0 runs it). Thread-safe: ``start``, ``stop`` and
    ``failure`` from the launcher's thread, the rest on the directory's."""

    def __init__(self, cfg, bind: str, first: str, run_dir, token: str, curve=None):
        self.servers = len(ClusterShape.of(cfg).servers)
        self.endpoints: dict[int, str] = {0: first}
        self.reply_register = {"run_dir": str(run_dir), "token": token}
        self.failed: dict[int, str] = {}  # server -> why it cannot go on (written here only)
        self.heard: dict[int, float] = {}  # server rank -> when it last said anything
        self.gone: set[int] = set()  # server ranks that said bye
        self.silent_s = cfg.runtime.timeout_s
        self._ctx = zmq.Context()
        self._curve = curve
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        if curve is not None:
            curve.server(self._sock)
        self._sock.bind(bind)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="server-directory", daemon=True)

    def start(self) -> Directory:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; blocks until the thread ends."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # it closes the socket
        else:
            self._sock.close()
        if self._curve is not None:
            self._curve.release(self._ctx)
        self._ctx.term()

    def answer(self, data: bytes, user: str | None) -> dict:
        """The reply to one request ``data`` from a connection with key name ``user``."""
        try:
            req = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            return {"error": f"not a msgpack request: {exc}"}
        why = _check(req, self.servers)
        if why is not None:
            return {"error": why}
        if req["op"] == "lookup":
            missing = [i for i in range(self.servers) if i not in self.endpoints]
            if missing:
                return {"missing": missing}
            return {"servers": [self.endpoints[i] for i in range(self.servers)]}
        if self._curve is not None and user != "ps":
            return {"error": f"only the ps key may send {req['op']!r}, not {user!r}"}
        i = req["server"]
        self.heard[i] = time.monotonic()
        if req["op"] == "register":
            self.endpoints[i] = req["endpoint"]
            return self.reply_register
        if req["op"] == "failed":
            self.failed[i] = req["why"]
        elif req["op"] == "bye":
            self.gone.add(i)
        return {"ok": True}

    def failure(self) -> str | None:
        """Why the run cannot go on (a server rank said its server failed for good, or has
        been silent for ``runtime.timeout_s`` without a bye), or None. Does not block."""
        if self.failed:
            first = min(self.failed)
            return f"server {first} failed on its own rank and cannot go on ({self.failed[first]})"
        now = time.monotonic()
        for i, t in sorted(self.heard.items()):
            if i not in self.gone and now - t > self.silent_s:
                return (
                    f"the rank of server {i} ({self.endpoints.get(i, '?')}) has said nothing "
                    f"for {self.silent_s:g} s (runtime.timeout_s): its host or its launcher "
                    "is gone"
                )
        return None

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            frame = self._sock.recv(copy=False)
            if self._sock.getsockopt(zmq.RCVMORE):  # one frame only; drop the rest
                while self._sock.getsockopt(zmq.RCVMORE):
                    self._sock.recv()
                self._sock.send(msgpack.packb({"error": "one frame per request"}))
                continue
            reply = self.answer(frame.bytes, auth.user_id(frame))
            self._sock.send(msgpack.packb(reply))
        self._sock.close()


def _ask(endpoint: str, req: dict, timeout_s: float, curve, sender: int, done) -> dict:
    """Send ``req`` to the directory at ``endpoint`` until ``done(reply)`` or ``timeout_s``
    has passed (ConfigError naming it); a fresh socket per try. Blocks."""
    deadline = time.monotonic() + timeout_s
    last = "no reply"
    ctx = zmq.Context()
    try:
        while True:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.client(sock, sender)
            sock.connect(endpoint)
            sock.send(msgpack.packb(req))
            left = max(deadline - time.monotonic(), 0.0)
            got = sock.poll(int(min(left, 2 * RETRY_S) * 1000) + 1)
            reply = sock.recv() if got else None
            sock.close()
            if reply is not None:
                try:
                    reply = msgpack.unpackb(reply, raw=False)
                except (ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
                    raise ConfigError(
                        f"the server directory at {endpoint} sent junk: {exc}"
                    ) from None
                if not isinstance(reply, dict):
                    raise ConfigError(f"the server directory at {endpoint} sent {reply!r}")
                if "error" in reply:
                    raise ConfigError(f"the server directory at {endpoint}: {reply['error']}")
                if done(reply):
                    return reply
                last = f"servers {reply.get('missing')} have not registered"
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the server directory at {endpoint} (rank 0): {last} after "
                    f"{timeout_s:g} s (runtime.timeout_s); is every rank started?"
                )
            time.sleep(RETRY_S if got else 0)
    finally:
        ctx.term()


def register(endpoint: str, server: int, mine: str, timeout_s: float, curve=None):
    """Register server ``server`` at ``mine`` with the directory at ``endpoint``; returns
    (run directory, run token). Blocks until rank 0 answers; ConfigError after ``timeout_s``."""
    reply = _ask(
        endpoint,
        {"op": "register", "server": server, "endpoint": mine},
        timeout_s,
        curve,
        wire.SENDER_PS,
        lambda r: True,
    )
    run_dir, token = reply.get("run_dir"), reply.get("token")
    if not isinstance(run_dir, str) or not isinstance(token, str):
        raise ConfigError(f"the server directory at {endpoint} sent {reply!r}")
    return run_dir, token


def report_failed(endpoint: str, server: int, why: str, timeout_s: float, curve=None) -> bool:
    """Tell rank 0's directory that server ``server`` failed for good (``why``), so that
    rank 0 stops the run rather than wait for it; whether the directory heard it (it may be
    gone: the run stopped anyway). Blocks at most ``timeout_s``."""
    req = {"op": "failed", "server": server, "why": why[:MAX_WHY]}
    return _quietly(endpoint, req, timeout_s, curve)


class Heartbeat:
    """A server rank's ``alive`` to rank 0's directory every ``ALIVE_S`` (a quarter of
    ``timeout_s``, rank 0's patience, if that is shorter), from a thread of its
    own, and its ``bye`` on ``stop``. A request that gets no answer is not an error (rank 0
    may be starting or gone). Thread-safe: ``stop`` from the launcher's thread."""

    def __init__(self, endpoint: str, server: int, curve=None, timeout_s: float = 60.0):
        self._ask = lambda op, t: _quietly(endpoint, {"op": op, "server": server}, t, curve)
        self.every = min(ALIVE_S, timeout_s / 4)  # several beats within rank 0's patience
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._ask("alive", self.every)

    def stop(self) -> None:
        """Stop beating and say bye (at most ``ALIVE_S``). Blocks."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ask("bye", ALIVE_S)


def _quietly(endpoint: str, req: dict, timeout_s: float, curve) -> bool:
    """``req`` to the directory, as a server rank; whether it answered within ``timeout_s``."""
    try:
        _ask(endpoint, req, timeout_s, curve, wire.SENDER_PS, lambda r: True)
    except ConfigError:
        return False
    return True


def lookup(endpoint: str, servers: int, timeout_s: float, curve=None, sender: int = 0):
    """The ``servers`` endpoints, in range order, from the directory at ``endpoint``, once
    every server registered. Blocks; ConfigError after ``timeout_s``."""
    reply = _ask(endpoint, {"op": "lookup"}, timeout_s, curve, sender, lambda r: "servers" in r)
    eps = reply["servers"]
    if (
        not isinstance(eps, list)
        or len(eps) != servers
        or not all(isinstance(e, str) and e.startswith("tcp://") for e in eps)
    ):
        raise ConfigError(f"the server directory at {endpoint} sent {eps!r}")
    return eps
