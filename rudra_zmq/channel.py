"""Requests to one server over one DEALER socket (``Channel``): numbered requests, sent again
when unanswered, late answers dropped, replies validated, an ERROR reply raised as
``ServerError``. Learners and tree nodes reach their parent this way; the socket comes from
``transport.py``, the frames from ``wire.py``.
"""

from __future__ import annotations

import itertools
import time

import zmq

from . import transport, wire


class Channel:
    """One DEALER connection to a server: numbered requests and validated replies.

    Blocking calls (``request``, ``recv``) wait at most ``timeout_ms`` and then raise
    ``TimeoutError`` naming the peer, so a dead server never hangs a learner forever. A
    request unanswered for ``retry_ms`` is sent again, unchanged (same sequence number: the
    server applies a gradient once and answers a resend as before); a reply that names
    another request (``x{re}``) is a late answer to an earlier send and is dropped. Sequence
    numbers start from the clock in microseconds, so a restarted sender never reuses one.
    Not thread-safe (owns one socket).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        sender: int,
        *,
        name: str = "server",
        timeout_ms: int = 60_000,
        hwm: int = 16,
        retry_ms: int = 5_000,
        max_bytes: int = -1,
    ):
        self.endpoint = endpoint
        self.sender = sender
        self.name = name
        self.timeout_ms = timeout_ms
        self.sock = transport.make_socket(
            ctx, zmq.DEALER, hwm=hwm, identity=transport.new_routing_id(), max_bytes=max_bytes
        )
        # A receive timeout instead of poll() before each recv: Socket.poll builds a Poller
        # per call, Python work on every round trip of the hot path. At most WAKE_MS, so a
        # long wait returns to Python (and its signal handlers) regularly.
        self.sock.setsockopt(
            zmq.RCVTIMEO,
            transport.WAKE_MS if timeout_ms < 0 else min(timeout_ms, transport.WAKE_MS),
        )
        transport.connect(self.sock, endpoint, sender)
        self._seq = itertools.count(time.time_ns() // 1000)
        self.retry_ms = retry_ms
        self.resent = 0  # requests sent again (for tests and logs)
        self.late = 0  # late answers to requests sent twice, dropped
        self._last: tuple[int, list] | None = None  # (seq, frames) awaiting its reply
        self.inc = 0  # the server incarnation we last heard from

    def send(self, kind: wire.Kind, ts: int = 0, payloads=(), **fields) -> None:
        """Queue one request (zero-copy payloads: do not modify them until the reply)."""
        seq = next(self._seq)
        frames = wire.encode(kind, self.sender, seq, ts, self.inc, payloads, **fields)
        self._last = (seq, frames)
        self.sock.send_multipart(frames, copy=False)

    def resend(self) -> None:
        """Send the request awaiting its reply again, unchanged (for callers that poll the
        socket themselves instead of waiting in ``recv``)."""
        if self._last is not None:
            self.resent += 1  # first: whoever sees the copy arrive sees it counted
            self.sock.send_multipart(self._last[1], copy=False)

    def drop_late(self) -> int:
        """Drop what is queued while no request is outstanding (late answers to a request
        sent twice); returns how many. Never blocks."""
        n = 0
        while True:
            try:
                self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.late += n
                return n
            n += 1

    def recv(self, kinds=None, numel: int | None = None) -> wire.Message:
        """Receive and validate one reply; raises TimeoutError, wire.WireError, or
        ``ServerError`` for an ERROR reply. A STOP passes whatever ``kinds`` says. Blocks at
        most ``timeout_ms`` (in slices of WAKE_MS, so signal handlers run)."""
        t0 = sent = time.monotonic()
        while True:
            try:
                msg = wire.decode(self.sock.recv_multipart(copy=False), numel=numel)
            except zmq.Again:  # WAKE_MS passed: signal handlers have run; wait on or give up
                now = time.monotonic()
                if self.timeout_ms >= 0 and now - t0 >= self.timeout_ms / 1000:
                    hint = (
                        ""
                        if transport.security() is None
                        else (
                            "; with security.curve, is this key allow-listed there and the "
                            "server key the same?"
                        )
                    )
                    raise TimeoutError(
                        f"no reply from the {self.name} at {self.endpoint} "
                        f"within {self.timeout_ms / 1000:g} s (is it "
                        f"running?{hint})"
                    ) from None
                if now - sent >= self.retry_ms / 1000:
                    self.resend()
                    sent = now
                continue
            re = msg.fields.get("re")
            if re is None or (self._last is not None and re == self._last[0]):
                break  # a reply without x{re} (older servers' ERROR) is taken as it comes
            self.late += 1  # a late answer to a request sent twice: dropped
        self._last = None
        if msg.kind == wire.Kind.ERROR:
            raise ServerError(
                msg.fields["code"], f"{self.name} refused the request: {msg.fields['error']}"
            )
        if kinds is not None and msg.kind not in kinds and msg.kind != wire.Kind.STOP:
            raise wire.WireError("unexpected_kind", f"{self.name} answered {msg.kind.name}")
        if msg.inc:
            self.inc = msg.inc
        return msg

    def request(
        self,
        kind: wire.Kind,
        ts: int = 0,
        payloads=(),
        *,
        reply_kinds=None,
        numel: int | None = None,
        **fields,
    ) -> wire.Message:
        """Send one request and wait for its reply (see ``recv``)."""
        self.send(kind, ts, payloads, **fields)
        return self.recv(reply_kinds, numel)

    def close(self) -> None:
        """Close the socket; a request still being sent gets ``LINGER_MS`` more. Never 0: libzmq
        4.3.5 aborts if the connection ends just as a half-sent multipart message is dropped
        (docs/wire.md, "Half-sent messages"); with 0, that happens as a run ends."""
        self.sock.close(linger=transport.LINGER_MS)


class ServerError(RuntimeError):
    """The server answered ERROR; ``code`` says why (e.g. bad_length, protocol)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
