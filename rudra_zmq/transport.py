"""ZeroMQ transport: sockets with safe options, endpoints, and process memory tuning.

Every role creates its sockets here, so that what measuring pyzmq 27 / libzmq 4.3.5 taught us is
applied once (raw ZeroMQ figures: ``bench/RESULTS.md``, "Raw ZeroMQ reference"):

- LINGER is always set (the default -1 makes ``ctx.term()`` hang when a peer is gone);
- ROUTER sockets set ROUTER_MANDATORY so a reply to a vanished peer raises instead of
  being dropped silently;
- high-water marks are small for model-sized traffic (they count messages, not bytes);
- large frames are received with ``copy=False`` (a copy=True receive of zero-copy frames
  deadlocked pyzmq over inproc);
- TCP keepalive on every socket (``set_heartbeat``), so a peer that vanished without closing
  its connection (a host that died, a cable) is dropped and reconnected to; not ZMTP
  heartbeats, whose timer aborts libzmq 4.3.5 on a connection whose peer left while its
  queue was full (docs/wire.md, "Liveness");
- ``set_security``: CurveZMQ on every socket (``security/auth.py``), applied in ``bind``/``connect``;
- ``ZMQ_MAXMSGSIZE`` (``max_bytes``): a peer sending a larger frame is disconnected before
  anything is allocated for it; clients use unpredictable routing ids and no ROUTER hands
  an id over, so no connection can take another's name;
- ``tune_malloc()`` stops glibc from giving every large ZeroMQ buffer a fresh mmap, which
  cost ~16k page faults per 40 MB message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import random
import socket as _pysocket
import threading
import time

import zmq

from . import outbox, wire

LINGER_MS = 200
# The longest a blocking wait stays inside libzmq before returning to Python. A signal sent to
# the process (SIGTERM from the launcher, or from Linux when the launcher dies) can be
# delivered to any thread that does not block it -- one of torch's, say -- and then the main
# thread's poll is not interrupted: its Python handler runs only when the call returns. A
# learner waiting out a 60 s receive timeout once outlived its SIGKILLed launcher that way.
WAKE_MS = 250
_HEARTBEAT_S = 2  # TCP keepalive idle time and probe interval (set_heartbeat)
KEEPALIVE_PROBES = 5  # unanswered probes before the kernel drops a connection
_SECURITY = None  # security.Curve once set_security was called: CURVE on every socket
MESSAGE_SLACK = wire.MAX_HEADER_BYTES + 4096  # a frame's bytes beyond its float payload

log = logging.getLogger("rudra_zmq.transport")


def set_security(curve) -> None:
    """CURVE for every socket this process binds or connects from now on (a
    ``security.Curve``), or None for plaintext. Not thread-safe: call once at process start."""
    global _SECURITY
    _SECURITY = curve


def security():
    """This process's ``security.Curve``, or None (plaintext)."""
    return _SECURITY


def frame_limit(payload_bytes: int) -> int:
    """``max_bytes`` for a socket whose largest frame is a ``payload_bytes`` payload (for
    model-sized traffic, ``runtime.chunk_mib``: weights and gradients travel in chunks)."""
    return int(payload_bytes) + MESSAGE_SLACK


def new_routing_id() -> bytes:
    """An unpredictable routing id for a client socket (16 bytes, never starting with 0,
    which libzmq reserves): no other connection can guess it and take its replies."""
    return b"r" + os.urandom(15)


def set_heartbeat(seconds: float) -> None:
    """Liveness probing for the TCP sockets this process makes from now on (``runtime.
    heartbeat_s``; 0 = none): TCP keepalive after ``seconds`` idle (whole seconds, at least
    1), a probe every ``seconds``, the connection dropped after ``KEEPALIVE_PROBES``
    unanswered. Not thread-safe: call once at process start."""
    global _HEARTBEAT_S
    _HEARTBEAT_S = 0 if seconds <= 0 else max(1, round(seconds))


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


# Ports handed out by free_tcp_endpoint in this process: a launcher asks for several
# (ps, data, stats, tree nodes) before any role binds, and the kernel may offer the same
# free port twice in a row (CI once gave data and stats the same port).
_handed_out: set[tuple[str, int]] = set()
_rng = random.Random()
# LO-HI: the ports free_tcp_endpoint picks from (several launches on one machine, each in a
# range of its own, never pick one another's ports; the test suite gives each worker one)
PORTS_ENV = "RUDRA_ZMQ_PORTS"
FIRST_PORT = 10000  # planned ports start here (below the kernel's ephemeral range)
MIN_PORTS = 1000  # the narrowest range to pick from ($RUDRA_ZMQ_PORTS: refused if narrower)


class NoFreePort(OSError):
    """Every port of ``$RUDRA_ZMQ_PORTS`` is in use or planned (the message says so)."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections and port-0 binds (Linux default
    32768-60999; read from /proc where it exists)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """An endpoint ``tcp://host:port`` for a role the caller will start: the port was free a
    moment ago, is never one this process handed out before, and lies below the kernel's
    ephemeral range when that leaves room (10000 up to it), so no connect() on this
    machine -- a learner's own outgoing socket, say -- can take it before the role binds.
    ``$RUDRA_ZMQ_PORTS`` (``LO-HI``) narrows the choice to that range, and never leaves it (a
    firewall may open only those). Not thread-safe. Raises OSError when ``host`` is not an
    address of this machine or the range has no free port, ValueError for a bad
    ``$RUDRA_ZMQ_PORTS``."""
    first, lo = FIRST_PORT, ephemeral_port_range()[0]
    ranged = os.environ.get(PORTS_ENV)
    if ranged:
        first, lo = _port_range(ranged)
    if lo - first >= MIN_PORTS:
        for _ in range(200):
            if endpoint := _claim(host, _rng.randrange(first, lo)):
                return endpoint
    if ranged:  # 200 draws hit busy ports: look at every port of the range once
        for port in range(first, lo):
            if endpoint := _claim(host, port):
                return endpoint
        raise NoFreePort(
            f"no free tcp port on {host} in ${PORTS_ENV}={ranged}: each of its {lo - first} "
            "ports is in use or already planned by this process; give a wider or another range"
        )
    for _ in range(200):  # no room below the ephemeral range: let the kernel choose
        with _pysocket.socket(_pysocket.AF_INET, _pysocket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if (host, port) not in _handed_out:
            _handed_out.add((host, port))
            return f"tcp://{host}:{port}"
    raise OSError(f"no free tcp port found on {host}")


def _claim(host: str, port: int) -> str | None:
    """``tcp://host:port``, now handed out, if this process never handed it out and it is
    free; else None. Raises OSError as ``_port_is_free``."""
    if (host, port) in _handed_out or not _port_is_free(host, port):
        return None
    _handed_out.add((host, port))
    return f"tcp://{host}:{port}"


def _port_range(text: str) -> tuple[int, int]:
    """``LO-HI`` as (lo, hi + 1); raises ValueError naming ``$RUDRA_ZMQ_PORTS``."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        lo = hi = -1
    if not (1024 <= lo and lo + MIN_PORTS - 1 <= hi <= 65535):
        raise ValueError(
            f"${PORTS_ENV}={text!r}: give LO-HI, 1024 <= LO, at least {MIN_PORTS} ports"
        )
    return lo, hi + 1


def _port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` now. Raises OSError for an
    address that is not this machine's (as the port-0 bind would)."""
    with _pysocket.socket(_pysocket.AF_INET, _pysocket.SOCK_STREAM) as s:
        # ZeroMQ listens with SO_REUSEADDR, so a port with only TIME_WAIT leftovers is
        # fine for it too
        s.setsockopt(_pysocket.SOL_SOCKET, _pysocket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        return True


def wait_readable(sock: zmq.Socket, timeout_ms: int) -> bool:
    """Whether ``sock`` has a message within ``timeout_ms`` (-1: no limit). Blocks, in slices
    of at most ``WAKE_MS`` so that signal handlers run promptly (see ``WAKE_MS``)."""
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
    while True:
        left = WAKE_MS if deadline is None else int((deadline - time.monotonic()) * 1000)
        if sock.poll(max(0, min(WAKE_MS, left))):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``sock`` (a CURVE server first, if ``set_security`` was called); ``tcp://HOST:0``
    or ``tcp://HOST:*`` picks a random port.

    Returns the endpoint actually bound (with the real port), for peers to connect to.
    """
    if _SECURITY is not None:
        _SECURITY.server(sock)
    elif endpoint.startswith("tcp://") and _wildcard(endpoint):
        _warn_exposed(endpoint)
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, endpoint: str, sender: int) -> None:
    """Connect ``sock`` for ``sender`` (a wire sender id: with CURVE, its key is used)."""
    if _SECURITY is not None:
        _SECURITY.client(sock, sender)
    sock.connect(endpoint)


def closing_linger_ms(retry_s: float, training_over: bool) -> int:
    """The linger of a server's socket at close: ``LINGER_MS``, or once training is over
    ``runtime.retry_s`` (at least ``LINGER_MS``): the STOPs it queued last may wait behind
    weights still leaving on a slow link (parts sent ahead), and with 0.2 s they were lost.
    Costs nothing with peers that read: ``term`` returns once everything is sent. Pure."""
    return max(LINGER_MS, int(retry_s * 1000)) if training_over else LINGER_MS


TERM_WAIT_S = 10.0  # the longest ``term`` waits once a socket was closed with a message half-sent


def term(ctx: zmq.Context) -> bool:
    """Stop ``ctx``'s ZAP handler, if any, then ``ctx.term()`` (which would wait for it).
    Blocks until every socket of ``ctx`` is closed and has delivered what its linger allows.
    Once this process closed a socket with a message half-sent (``outbox.Outbox.close``: an
    infinite linger, the peer reading nothing), it waits at most ``TERM_WAIT_S`` and returns
    False if the context is still terminating then (in a thread of its own, which a process
    that ends leaves behind); True otherwise."""
    if _SECURITY is not None:
        _SECURITY.release(ctx)
    if not outbox.held():
        ctx.term()
        return True
    ender = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    ender.start()
    ender.join(TERM_WAIT_S)
    if ender.is_alive():
        log.warning(
            "a peer has not read a message half-sent to it for %.0f s; not waiting for it",
            TERM_WAIT_S,
        )
        return False
    return True


def destroy(ctx: zmq.Context, linger_ms: int) -> bool:
    """``ctx.destroy(linger=linger_ms)`` with ``term``'s bound: close every socket of ``ctx``
    still open (those of threads that are gone; not thread-safe otherwise), then ``term``.
    Returns what ``term`` does."""
    for sock in list(ctx._sockets):
        if sock is not None and not sock.closed:
            sock.close(linger=linger_ms)
    return term(ctx)


_warned_exposed: set = set()
PLAINTEXT_NAMED_ENV = "RUDRA_ZMQ_PLAINTEXT_NAMED"  # set: the launcher said it on the terminal


def _wildcard(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("*", "0.0.0.0", "::", "")


def _warn_exposed(endpoint: str) -> None:
    """One warning per process: a plaintext socket on every interface is open to anyone."""
    if not _warned_exposed:
        _warned_exposed.add(endpoint)
        # under `rudra-zmq launch`, which said it once for the whole run, only at debug level
        level = logging.DEBUG if os.environ.get(PLAINTEXT_NAMED_ENV) else logging.WARNING
        log.log(
            level,
            "%s listens on every network interface without encryption: anyone who "
            "can reach this host can read what it serves (weights, training data) and "
            "send it requests (gradients, records). Set "
            "security.curve=true (rudra-zmq keys init DIR; --keys DIR), or bind one "
            "address on a trusted network.",
            endpoint,
        )


def peer_connected(sock: zmq.Socket, ident: bytes, sender: int) -> bool:
    """Whether the ROUTER ``sock`` still has the connection ``ident``: a probe goes out that
    a ``Channel`` drops unread (an ERROR answering request 0, which no client ever sends),
    or the ROUTER says that peer is gone (EHOSTUNREACH, ROUTER_MANDATORY). Never blocks."""
    frames = wire.encode(wire.Kind.ERROR, sender, 0, code="probe", error="", re=0)
    try:
        sock.send_multipart([ident, *frames], zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        return exc.errno != zmq.EHOSTUNREACH  # EAGAIN: there, with a full queue
    return True


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    hwm: int = 16,
    identity: bytes | None = None,
    rcvtimeo: int = -1,
    max_bytes: int = -1,
    sndbuf: int = 0,
) -> zmq.Socket:
    """A socket with LINGER, HWM, TCP keepalive, (for ROUTER) ROUTER_MANDATORY and, if
    ``max_bytes`` >= 0, ZMQ_MAXMSGSIZE (a peer sending a larger frame is disconnected);
    ``sndbuf`` > 0: the kernel's send buffer of each of its TCP connections, in bytes
    (``runtime.sndbuf_kib``; 0: the kernel sizes it). Not thread-safe: use a socket only from
    the thread that made it."""
    sock = ctx.socket(kind)
    if sndbuf > 0:
        sock.setsockopt(zmq.SNDBUF, sndbuf)
    if max_bytes >= 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.RCVTIMEO, rcvtimeo)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if _HEARTBEAT_S:  # kernel probes: no libzmq timer (docs/wire.md, "Liveness")
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, _HEARTBEAT_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, _HEARTBEAT_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
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
