"""The sending side of one broadcast hop, shared by the root and every member.

A sender (the root PS's :class:`~rudra_zmq.broadcast.root.BroadcastRoot`, or a learner's
:class:`~rudra_zmq.broadcast.member.BroadcastMember`) binds a ROUTER; each child connects a
DEALER and grants credit in chunks (CREDIT x{credit, reset}). :class:`Fanout` keeps, per
child, its credit and which version it has, and decides what to send:

- ``admit``/``pass_on``/``passed``: a version arriving chunk by chunk goes on, chunk by chunk,
  to each child that had credit for all of it when its first chunk came (so the chain
  pipelines and a child never gets a fragment it cannot complete);
- ``catch_up``: the newest complete :class:`Version` goes whole to each child that lacks it
  and now has room (a child that had no room only misses superseded versions);
- ``stop``: STOP to every child, and to children that join later.

Also the small pieces both roles share: the I/O thread base class with its inproc control
pipe (:class:`IOThread`), and socket helpers. Everything here is used by one I/O thread only,
except :class:`Version` (immutable, readable from any thread).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import zmq

from .. import transport, wire
from ..wire import Kind

log = logging.getLogger("rudra_zmq.broadcast")

_DRAIN = 256  # messages handled per socket before looking at the others
POLL_MS = 100  # an I/O thread looks at its commands and clocks at least this often


def default_window(numel: int, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> int:
    """Credit a member grants its upstream, in chunks: two versions, at least 4."""
    return max(4, 2 * -(-numel * 4 // chunk_bytes))


@dataclass(frozen=True)
class Version:
    """One complete weight version: ``chunks`` are read-only views in model order (the
    received frames, or the root's snapshot; float32, or half on a half wire), ``frames``
    the messages that carried them. Never written: safe to read from any thread."""

    ts: int
    total: int
    chunks: tuple
    frames: tuple

    def concatenated(self) -> np.ndarray:
        return self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)


@dataclass
class _Child:
    ident: bytes
    member: int
    credit: int
    window: int
    sent: int = -1  # newest version it got whole
    passing: int | None = None  # the version it is getting chunk by chunk
    told_stop: bool = False


class Fanout:
    """The sending side of a root or member: a ROUTER its children connect to, each child's
    credit and versions. Used only by the owning I/O thread."""

    def __init__(self, sock: zmq.Socket, children, name: str, max_window: int):
        self.sock, self.name, self.max_window = sock, name, max_window
        self.allowed = None if children is None else frozenset(children)
        # by connection, not by member id: a second connection claiming a member's id gets a
        # copy of the stream (CURVE stops that) but never takes the member's place
        self.kids: dict[bytes, _Child] = {}
        self.max_kids = 64 if children is None else 2 * len(self.allowed)
        self.sent_chunks = self.invalid = self.dropped = 0
        self.stop_frames = None  # once STOP went down: children that join later get it too
        self._warned: set = set()

    def on_message(self, frames) -> None:
        """A CREDIT from a child (routing id first). Anything else is refused and logged once."""
        ident = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
        try:
            msg = wire.decode(frames[1:], kinds={Kind.CREDIT})
            k = msg.fields["credit"]
            if self.allowed is not None and msg.sender not in self.allowed:
                raise wire.WireError(
                    "not_child",
                    f"learner {msg.sender} is not a child of "
                    f"{self.name} in the broadcast (its children: learners "
                    f"{sorted(self.allowed)}); another config?",
                )
            if msg.sender < 0 or not 1 <= k <= self.max_window:
                raise wire.WireError(
                    "bad_credit",
                    f"CREDIT {k} from sender {msg.sender}: "
                    f"credit must be 1..{self.max_window}, sender >= 0",
                )
            sec = transport.security()
            if sec is not None and not sec.may_speak(frames[1], msg.sender):
                raise wire.WireError(
                    "forbidden", f"a key that may not speak as learner {msg.sender} sent its CREDIT"
                )
            if ident not in self.kids and len(self.kids) >= self.max_kids:
                raise wire.WireError(
                    "too_many", f"{self.name} already feeds {len(self.kids)} connections"
                )
        except wire.WireError as exc:
            self.invalid += 1
            if (ident, exc.code) not in self._warned:
                self._warned.add((ident, exc.code))
                log.warning("%s refused a message from %r: %s", self.name, ident, exc)
            return
        c = self.kids.get(ident)
        if c is None or msg.fields["reset"] or c.member != msg.sender:
            self.kids[ident] = _Child(ident, msg.sender, k, k)
        else:  # never beyond what the child granted at first: the bound on its queue
            c.credit = min(c.credit + k, c.window)

    def _send(self, c: _Child, frames, quiet: bool = False) -> bool:
        try:
            self.sock.send_multipart([c.ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ContextTerminated:  # the process is stopping, not the child gone
            raise
        except zmq.ZMQError as exc:  # gone (ROUTER_MANDATORY) or over its HWM: forget it
            (log.debug if quiet else log.warning)(
                "%s: dropped broadcast child learner %d: %s", self.name, c.member, exc
            )
            self.kids.pop(c.ident, None)
            self.dropped += 1
            return False
        return True

    def catch_up(self, v: Version | None) -> None:
        """Send ``v`` whole to every child that lacks it, is not getting a newer version chunk
        by chunk, and has credit for all of it; then STOP to those not told yet, if it came."""
        for c in list(self.kids.values()):
            if v is not None and c.sent < v.ts and c.passing is None and c.credit >= v.total:
                for frames in v.frames:
                    if not self._send(c, frames):
                        break
                    c.credit -= 1
                    self.sent_chunks += 1
                c.sent = v.ts
            if self.stop_frames is not None and not c.told_stop and c.passing is None:
                c.told_stop = self._send(c, self.stop_frames, quiet=True)

    def admit(self, ts: int, total: int) -> None:
        """Version ``ts`` starts arriving: children with credit for all of it get it chunk by
        chunk as it arrives; the others skip it for now."""
        for c in self.kids.values():
            c.passing = ts if c.sent < ts and c.credit >= total else None

    def pass_on(self, ts: int, frames) -> None:
        for c in list(self.kids.values()):
            if c.passing == ts and self._send(c, frames):
                c.credit -= 1
                self.sent_chunks += 1

    def passed(self, ts: int) -> None:
        for c in self.kids.values():
            if c.passing == ts:
                c.sent, c.passing = ts, None

    def all_told(self) -> bool:
        """Whether every planned child was told STOP (True when any child may connect)."""
        return self.allowed is None or self.allowed <= {
            c.member for c in self.kids.values() if c.told_stop
        }

    def stop(self, frames) -> None:
        self.stop_frames = frames
        for c in list(self.kids.values()):
            c.told_stop = self._send(c, frames, quiet=True)  # a child may have left already


def drain(sock: zmq.Socket, handle, copy: bool = True) -> None:
    """Pass up to _DRAIN queued messages of ``sock`` to ``handle`` (never blocks)."""
    transport.drain(sock, handle, _DRAIN, copy)


def router(ctx, bind: str, hwm: int):
    # children send CREDITs only (headers); a restarted child is a new connection
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=hwm, max_bytes=transport.frame_limit(0))
    return sock, transport.bind(sock, bind)


def pipe(ctx, name: str):
    """An inproc PAIR pipe: (owner end, I/O thread end)."""
    addr = f"inproc://rudra-{name}-{id(object())}"
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
    a.bind(addr)
    b.connect(addr)
    return a, b


class IOThread:
    """Start/close of an I/O thread that runs ``self._loop()`` (subclasses)."""

    error: BaseException | None = None
    endpoint: str | None = None
    _thread: threading.Thread | None = None
    _closing = False

    def start(self):
        """Start the I/O thread (once). Returns self. Not thread-safe."""
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            self._loop()
        except zmq.ContextTerminated as exc:  # the process is stopping (ctx.term()): no error
            self.error = exc
        except BaseException as exc:  # reported to the owner by check()
            self.error = exc
            log.error("%s: %s", self._name, exc)
        finally:
            for s in self._sockets():
                s.close(linger=transport.LINGER_MS)
            if (self.endpoint or "").startswith("ipc://"):  # libzmq leaves the file behind
                try:
                    os.unlink(self.endpoint[len("ipc://") :])
                except OSError:
                    pass

    def check(self) -> None:
        """Raise the I/O thread's error, if it failed (a silent upstream: TimeoutError)."""
        if self.error is not None:
            raise self.error

    def close(self, *cmd: bytes) -> None:
        """Stop the I/O thread and close the sockets. Blocks up to ~5 s. Idempotent."""
        if self._ctl.closed:
            return
        if self._thread is None:  # never started: the sockets are still ours
            for s in self._sockets():
                s.close(linger=0)
        elif self._thread.is_alive():
            try:
                self._ctl.send_multipart([b"close", *cmd], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._thread.join(5)
        self._ctl.close(linger=0)
