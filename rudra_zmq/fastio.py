"""Compiled ZeroMQ framing for the hot path: whole multipart messages without pyzmq's
per-frame Python work (``rudra_zmq._fastio``, built from ``csrc/_fastio.pyx``).

The parameter server's ROUTER and every learner's ``transport.Channel`` send and receive
through a :class:`FastSocket`: the same pyzmq socket (options, bind, connect, poll and close
stay pyzmq's), but each message is one call into libzmq's C API with the GIL released. pyzmq
builds a ``zmq.Frame`` per frame and releases every zero-copy frame through its garbage
collector thread; at 90k parameters that cost ~70 µs of a ~240 µs round trip on a 2-core
machine (bench/RESULTS.md). Received frames are :class:`Frame` objects (buffer protocol,
``.bytes``, ``.buffer``: what ``wire.decode`` reads); sends copy frames under 64 KiB and pin
larger ones until libzmq releases them, as pyzmq's ``copy=False`` does.

There is no pyzmq fallback: a missing extension or a pyzmq whose libzmq functions cannot be
found is an import error that says what to do.
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque

import zmq

from . import kernels

try:
    from . import _fastio
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "rudra_zmq's compiled ZeroMQ framing (rudra_zmq._fastio) is not built or does not "
        f"load: {exc}. Build it with `pip install -e .` from the repository root (needs a C "
        "compiler and Cython>=3), or `python setup.py build_ext --inplace`.") from exc

Frame = _fastio.Frame
COPY_THRESHOLD = _fastio.COPY_THRESHOLD
decode_hot = _fastio.decode_hot     # wire.decode's fast front (see wire.py)
encode_hot = _fastio.encode_hot     # wire.encode's fast front
HOT_KINDS = _fastio.HOT_KINDS
HOT_MAX_PARTS = _fastio.HOT_MAX_PARTS
HOT_VERSION = _fastio.HOT_VERSION         # the protocol version it encodes and accepts
HOT_MAX_FRAMES = _fastio.HOT_MAX_FRAMES   # payload frames of a hot message


def _libzmq_addresses() -> dict:
    """Addresses of the libzmq functions that pyzmq's compiled backend loaded (dlsym on its
    extension module also searches the libzmq it links)."""
    try:
        from zmq.backend.cython import _zmq
        lib = ctypes.CDLL(_zmq.__file__)
        return {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                for name in _fastio.LIBZMQ_FUNCTIONS}
    except (ImportError, OSError, AttributeError) as exc:
        raise ImportError(
            f"rudra_zmq needs pyzmq's Cython backend and the libzmq it loads (pyzmq "
            f"{zmq.__version__}, libzmq {zmq.zmq_version()}): {exc}. Install a pyzmq wheel "
            "for CPython (`pip install --force-reinstall pyzmq`).") from exc


_fastio.bind_libzmq(_libzmq_addresses())
_fastio.bind_kernels(kernels._kernels.c_api())   # the hot path's update: the same kernel

HotPS = _fastio.HotPS
strerror = zmq.strerror
POLICIES = {"constant": _fastio.POLICY_CONSTANT, "staleness": _fastio.POLICY_STALENESS,
            "per_gradient": _fastio.POLICY_PER_GRADIENT}

# Pins of sockets closed while libzmq still held some of their frames (it releases them by
# ctx.term() at the latest); kept here so that those buffers stay alive until then.
_orphans: list = []
_orphans_lock = threading.Lock()


class FastSocket:
    """A pyzmq socket's messages through the compiled framing.

    ``send_multipart``/``recv_multipart`` behave as pyzmq's with ``copy=False``: frames of
    64 KiB or more are sent zero-copy (do not modify them until the peer has them), received
    frames are zero-copy :class:`Frame` objects; ``zmq.Again``/``zmq.ZMQError`` as pyzmq
    raises them. Both block (GIL released) as the socket's options say. Not thread-safe: use
    it from the thread that owns the socket.
    """

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.addr = sock.underlying    # libzmq's socket (for the compiled calls)
        # one pin per message with zero-copy frames, oldest first (HotPS adds its own)
        self.pins: deque = deque()

    def send_multipart(self, frames, flags: int = 0, copy: bool = False) -> None:
        """Send ``frames`` as one message (``copy`` is accepted for pyzmq's signature; large
        frames always go zero-copy)."""
        self._check_open()
        self.prune()
        pin = _fastio.send(self.addr, list(frames), flags)
        if pin is not None:
            self.pins.append(pin)

    def recv_multipart(self, flags: int = 0, copy: bool = False) -> list:
        """Receive one whole message as a list of :class:`Frame` (``copy`` is accepted for
        pyzmq's signature; frames are never copied)."""
        self._check_open()
        self.prune()
        return _fastio.recv(self.addr, flags)

    def pushpull_hot(self, sender: int, seq: int, ts: int, inc: int, wait: bool, pieces: list,
                     numel: int):
        """A learner's whole-gradient PUSHPULL (``pieces``: its float32 chunks) and the wait for
        its reply in one compiled call (``_fastio.pushpull_hot``): returns (the frames of every
        message received, the recognised reply or None), or None when the request is not of
        the hot shape (nothing was sent). Blocks up to the socket's RCVTIMEO (then the list
        is empty)."""
        self._check_open()
        self.prune()
        r = _fastio.pushpull_hot(self.addr, sender, seq, ts, inc, wait, pieces, numel)
        if r is None:
            return None
        if r[0] is not None:
            self.pins.append(r[0])
        return r[1], r[2]

    def prune(self) -> int:
        """Drop the pins of messages libzmq has finished sending (their buffers may then be
        reused or freed); returns how many are still in flight."""
        pins = self.pins
        while pins and pins[0].done:
            pins.popleft()
        return len(pins)

    @property
    def in_flight(self) -> int:
        """Messages whose zero-copy frames libzmq may still read."""
        return self.prune()

    def close(self, linger: int | None = None) -> None:
        """Close the socket; buffers still in flight stay alive until libzmq drops them."""
        if not self.sock.closed:
            self.sock.close(linger=linger)
        if self.prune():
            with _orphans_lock:
                _orphans[:] = [p for p in _orphans if not p.done]
                _orphans.extend(self.pins)
            self.pins.clear()

    def _check_open(self) -> None:
        if self.sock.closed:   # the address would dangle: libzmq freed the socket
            raise zmq.ZMQError(zmq.ENOTSOCK, "the socket is closed")
