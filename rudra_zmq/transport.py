"""ZeroMQ transport: sockets with safe options, endpoints, and process memory tuning.

Every role creates its sockets here so that the lessons in MEASURED.md are applied once:

- LINGER is always set (the default -1 makes ``ctx.term()`` hang when a peer is gone);
- ROUTER sockets set ROUTER_MANDATORY so a reply to a vanished peer raises instead of
  being dropped silently;
- high-water marks are small for model-sized traffic (they count messages, not bytes);
- large frames are received with ``copy=False`` (a copy=True receive of zero-copy frames
  deadlocked pyzmq over inproc);
- ``tune_malloc()`` stops glibc from giving every large ZeroMQ buffer a fresh mmap, which
  cost ~16k page faults per 40 MB message.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import socket as _pysocket

import zmq

from . import wire

LINGER_MS = 200


def tune_malloc() -> bool:
    """Make glibc reuse heap memory for large buffers instead of mmap/munmap per buffer.

    Equivalent to MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4GiB MALLOC_ARENA_MAX=2 in the
    environment, applied at run time (mallopt) so it works however the process was started.
    Returns False where glibc is not available. Call once at process start; not thread-safe.
    """
    path = ctypes.util.find_library("c")
    if not path:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    ok = mallopt(m_mmap_max, 0) == 1
    ok &= mallopt(m_trim_threshold, 2**31 - 1) == 1
    ok &= mallopt(m_arena_max, 2) == 1
    return bool(ok)


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """An endpoint ``tcp://host:port`` whose port was free a moment ago (for launchers)."""
    with _pysocket.socket(_pysocket.AF_INET, _pysocket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``sock``; ``tcp://HOST:0`` or ``tcp://HOST:*`` picks a random port.

    Returns the endpoint actually bound (with the real port), for peers to connect to.
    """
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def make_socket(ctx: zmq.Context, kind: int, *, hwm: int = 16, identity: bytes | None = None,
                rcvtimeo: int = -1) -> zmq.Socket:
    """A socket with LINGER, HWM and (for ROUTER) ROUTER_MANDATORY set. Not thread-safe:
    use a socket only from the thread that made it."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.RCVTIMEO, rcvtimeo)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def drain(sock: zmq.Socket, handle, limit: int | None = None, copy: bool = False) -> int:
    """Pass the messages queued on ``sock`` to ``handle(frames)``, at most ``limit`` (None: until
    the queue is empty), received with ``copy`` (False: zero-copy ``zmq.Frame``s). Never waits
    for a message. Returns how many it handled. Not thread-safe (the socket's owner calls it)."""
    n = 0
    while limit is None or n < limit:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            break
        n += 1
        handle(frames)
    return n


class Channel:
    """One DEALER connection to a server: numbered requests and validated replies.

    Blocking calls (``request``, ``recv``) wait at most ``timeout_ms`` and then raise
    ``TimeoutError`` naming the peer, so a dead server never hangs a learner forever.
    Not thread-safe (owns one socket).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, sender: int, *, name: str = "server",
                 timeout_ms: int = 60_000, hwm: int = 16):
        self.endpoint = endpoint
        self.sender = sender
        self.name = name
        self.timeout_ms = timeout_ms
        self.sock = make_socket(ctx, zmq.DEALER, hwm=hwm, identity=f"{sender}".encode())
        # A receive timeout instead of poll() before each recv: Socket.poll builds a Poller
        # per call, Python work on every round trip of the hot path.
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.connect(endpoint)
        self._seq = itertools.count(1)
        self.inc = 0  # the server incarnation we last heard from

    def send(self, kind: wire.Kind, ts: int = 0, payloads=(), **fields) -> None:
        """Queue one request (zero-copy payloads: do not modify them until the reply)."""
        frames = wire.encode(kind, self.sender, next(self._seq), ts, self.inc, payloads,
                             **fields)
        self.sock.send_multipart(frames, copy=False)

    def recv(self, kinds=None, numel: int | None = None) -> wire.Message:
        """Receive and validate one reply; raises TimeoutError, wire.WireError, or
        ``ServerError`` for an ERROR reply."""
        parts = []
        while True:   # a streamed WEIGHTS reply comes as WPART messages, then WEIGHTS
            try:
                frames = self.sock.recv_multipart(copy=False)
            except zmq.Again:
                raise TimeoutError(f"no reply from the {self.name} at {self.endpoint} within "
                                   f"{self.timeout_ms / 1000:g} s (is it running?)") from None
            msg = wire.decode(frames)
            if msg.kind != wire.Kind.WPART:
                break
            if len(parts) >= wire.MAX_PARTS:
                raise wire.WireError("bad_parts", f"{self.name} sent more than "
                                                  f"{wire.MAX_PARTS} WPART messages in a row")
            parts.append(msg)
        msg = wire.assemble(parts, msg, numel)
        if msg.kind == wire.Kind.ERROR:
            raise ServerError(msg.fields["code"], f"{self.name} refused the request: "
                                                  f"{msg.fields['error']}")
        if kinds is not None and msg.kind not in kinds and msg.kind != wire.Kind.STOP:
            raise wire.WireError("unexpected_kind", f"{self.name} answered {msg.kind.name}")
        if msg.inc:
            self.inc = msg.inc
        return msg

    def request(self, kind: wire.Kind, ts: int = 0, payloads=(), *, reply_kinds=None,
                numel: int | None = None, **fields) -> wire.Message:
        """Send one request and wait for its reply (see ``recv``)."""
        self.send(kind, ts, payloads, **fields)
        return self.recv(reply_kinds, numel)

    def close(self) -> None:
        self.sock.close(linger=0)


class ServerError(RuntimeError):
    """The server answered ERROR; ``code`` says why (e.g. bad_length, protocol)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
