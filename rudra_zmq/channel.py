"""Requests to one server over one DEALER socket (``Channel``): numbered requests, asked
about when slow and sent again only when lost, late answers dropped, replies validated, an
ERROR reply raised as ``ServerError``. Learners and tree nodes reach their parent this way;
the socket comes from ``transport.py``, the frames from ``wire.py``.

A request is sent again only on evidence that it was lost, never because a round outlasted a
timer: on a slow link a hardsync round can take longer than ``runtime.retry_s``, and resending
then doubled the bytes on the busiest link. The evidence is the server's RECEIPT ``got:
false`` to a CHECK (a header sent after ``retry_ms`` without a reply: a restarted server, or
a connection that dropped the request), or the socket's monitor seeing the connection drop
and come back (the reply may have been lost with it; the server answers a resend as before).

A server that answers neither the request nor ``SILENT_CHECKS`` CHECKs sent ``retry_ms``
apart (stopped, hung, its host frozen: TCP keepalive sees nothing wrong while the kernel
still answers) is said to be silent, on the terminal (a notice), within a few ``retry_ms``
instead of only when ``timeout_ms`` runs out; the channel waits on, and says when it answers
again (a RECEIPT counts: a server busy with a long round still answers CHECKs).
"""

from __future__ import annotations

import itertools
import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec, timeline, transport, wire
from .notices import notice
from .outbox import Outbox

log = logging.getLogger("rudra_zmq.channel")
SILENT_CHECKS = 2  # CHECKs unanswered, retry_ms apart, before a server is said to be silent


class Channel:
    """One DEALER connection to a server: numbered requests and validated replies.

    Blocking calls (``request``, ``recv``) wait at most ``timeout_ms`` and then raise
    ``TimeoutError`` naming the peer, so a dead server never hangs a learner forever. A
    request unanswered for ``retry_ms`` is asked about (CHECK, a header) every ``retry_ms``;
    it is sent again, unchanged (same sequence number: the server applies a gradient once and
    answers a resend as before), only when the server says it never got it or the connection
    dropped and came back (module docstring). A reply that names another request (``x{re}``)
    is a late answer to an earlier send and is dropped. Sequence numbers start from the clock
    in microseconds, so a restarted sender never reuses one. Not thread-safe (owns one
    socket and its monitor).
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
        dtypes: wire.ModelDtypes = wire.FLOAT32,
        sndbuf: int = 0,
    ):
        self.endpoint = endpoint
        self.dtypes = dtypes  # the run's wire dtypes, which replies are checked against
        self.sender = sender
        self.name = name
        self.timeout_ms = timeout_ms
        self.sock = transport.make_socket(
            ctx,
            zmq.DEALER,
            hwm=hwm,
            identity=transport.new_routing_id(),
            max_bytes=max_bytes,
            sndbuf=sndbuf,
        )
        # A receive timeout instead of poll() before each recv: Socket.poll builds a Poller
        # per call, Python work on every round trip of the hot path. At most WAKE_MS, so a
        # long wait returns to Python (and its signal handlers) regularly.
        self.sock.setsockopt(
            zmq.RCVTIMEO,
            transport.WAKE_MS if timeout_ms < 0 else min(timeout_ms, transport.WAKE_MS),
        )
        self.out = Outbox(self.sock)  # its sends, a model in chunks tracked until taken whole
        self.link = LinkWatch(self.sock)  # before connect: it must see every connection
        transport.connect(self.sock, endpoint, sender)
        self._seq = itertools.count(time.time_ns() // 1000)
        self.retry_ms = retry_ms
        self.resent = 0  # requests sent again (for tests and logs)
        self.checks = 0  # CHECKs sent (a header each)
        self.late = 0  # late answers to requests sent twice, dropped
        # (seq, [frames] sent so far, in the order sent): the request awaiting its reply
        self._last: tuple[int, list] | None = None
        self._ahead = None  # [weights view, floats come ahead, gap seen]: parts of its reply
        self._final = None  # (kind, seq, ts, parts) of the request in parts: ``send_final``
        self._parts = 0  # how many messages the request awaiting its reply is in
        self.on_part = None  # called (at, n) once a part of a reply came ahead and is loaded
        self._asked_at = 0.0  # when the request was last sent or asked about (monotonic)
        self._sent_at = 0.0  # when the request awaiting its reply was first sent (monotonic)
        self._checks_before = 0  # ``checks`` when it was sent: the rest asked about it
        self.receipts = [0, 0]  # its RECEIPTs saying got, not got
        self.inc = 0  # the server incarnation we last heard from
        self._heard_at = time.monotonic()  # when the server last said anything
        self._unanswered = 0  # CHECKs sent since then
        self.silent_since: float | None = None  # when it was said to be silent (monotonic)

    def send(self, kind: wire.Kind, ts: int = 0, payloads=(), **fields) -> None:
        """Queue one request (zero-copy payloads: do not modify them until the reply)."""
        seq = next(self._seq)
        frames = wire.encode(kind, self.sender, seq, ts, self.inc, payloads, **fields)
        self._begin(seq, 1, None)
        self.send_part(frames)

    def send_parts(self, kind: wire.Kind, ts: int, parts, into) -> None:
        """Queue one request in parts (``wire.parts``; see ``parts``), all at once."""
        for frames in self.parts(kind, ts, parts, into):
            self.send_part(frames)

    def parts(self, kind: wire.Kind, ts: int, parts, into, last: int | None = None) -> list:
        """One request in parts (``wire.parts``): ``parts`` is (offset, payloads) per part,
        in order, each one message x{at, more} with the request's seq; returns the messages
        for ``send_part``, in order. The caller sends them in any order, part ``last``
        (default the final one: the one without x{more}) last: a caller with several
        servers sends part 0 to each, then part 1...; one pushing during backward sends
        each as it is computed. The payloads are read when sent, not here; a resend sends
        those sent by then, in the order sent (``resend``). The parts of the
        reply sent ahead (WEIGHTS x{at, more}, in any order) are decoded into ``into`` (the
        range's weights) as they come; the reply carries the rest (x{at})."""
        seq = next(self._seq)
        last = len(parts) - 1 if last is None else last
        more = {"more": True}
        msgs = [
            wire.encode(
                kind, self.sender, seq, ts, self.inc, p, at=at, **(more if i != last else {})
            )
            for i, (at, p) in enumerate(parts)
        ]
        self._begin(seq, len(msgs), [into, 0, False])
        self._final = (kind, seq, ts, parts)  # for ``send_final``
        return msgs

    def send_final(self, i: int, track: bool = False):
        """Queue part ``i`` of the request ``parts`` made with ``last=-1`` (every message
        x{more}) as its final message, without x{more}: a sender that picks the last part
        when it sends it (``learner/priority.py``, lowest offsets first). Returns
        ``send_part``'s tracker."""
        kind, seq, ts, parts = self._final
        at, payloads = parts[i]
        frames = wire.encode(kind, self.sender, seq, ts, self.inc, payloads, at=at)
        return self.send_part(frames, track)

    def _begin(self, seq: int, n: int, ahead) -> None:
        """A new request in ``n`` messages awaits its reply, none sent yet: its parts' ahead
        state, its clocks and counts (for ``tick`` and ``waiting``)."""
        self._last, self._parts, self._ahead = (seq, []), n, ahead
        self._asked_at = self._sent_at = time.monotonic()
        self._checks_before, self.receipts = self.checks, [0, 0]

    def send_part(self, frames, track: bool = False):
        """Queue one message of the request awaiting its reply (one ``parts`` made; zero-copy),
        and keep it for a ``resend``; with ``track``, returns its ``zmq.MessageTracker``
        (done once libzmq has taken it whole), else None."""
        if self._last is not None:
            self._last[1].append(frames)
        tracker = self.out.send(frames, track=track)
        timeline.sent(self.name, frames)
        return tracker

    def resend(self) -> None:
        """Send the request awaiting its reply again, unchanged: the messages sent of it so
        far, in the order sent. The parts of a request in parts not sent yet are its sender's
        to send, once (``learner/priority.py`` holds them in its queue: sent here too, they
        would reach the server twice, and a half codec's before they are narrowed)."""
        if self._last is not None:
            self.resent += 1  # first: whoever sees the copy arrive sees it counted
            self._asked_at = time.monotonic()
            for frames in self._last[1]:
                self.out.send(frames)

    def tick(self) -> None:
        """Between receives, with a request awaiting its reply: send it again if the
        connection dropped and came back since; else, once it was unanswered for
        ``retry_ms``, ask the server whether it got it (CHECK; its RECEIPT is handled where
        replies are read). Never blocks (a CHECK that finds the queue full is skipped)."""
        reconnected = self.link.reconnected()
        if self._last is None:
            return
        if reconnected:
            self.resend()
        elif time.monotonic() - self._asked_at >= self.retry_ms / 1000:
            self._asked_at = time.monotonic()
            if self._unanswered >= SILENT_CHECKS and self.silent_since is None:
                self.silent_since = self._asked_at
                notice(
                    log,
                    "the %s at %s has answered nothing for %.1f s (a request and %d CHECKs, "
                    "runtime.retry_s apart): is it stopped or hung? Waiting on (at most "
                    "runtime.timeout_s, %g s)",
                    self.name,
                    self.endpoint,
                    self._asked_at - max(self._heard_at, self._sent_at),
                    self._unanswered,
                    self.timeout_ms / 1000,
                )
            self.checks += 1  # first: whoever sees it arrive sees it counted
            if send_check(self.sock, self.sender, self._last[0], self.inc):
                self._unanswered += 1
            else:
                self.checks -= 1  # not connected, or the queue is full: the next tick asks

    def waiting(self) -> str:
        """What this channel awaits, for a timeout's message: the request, its parts' replies
        come ahead, the CHECKs and what their RECEIPTs said. Pure."""
        if self._last is None:
            return "no request outstanding"
        seq, sent = self._last
        text = f"request {seq} sent {time.monotonic() - self._sent_at:.1f} s ago"
        if self._parts > 1:
            text += f" in {self._parts} parts"
            if len(sent) < self._parts:
                text += f" ({len(sent)} sent)"
            if self._ahead is not None:
                text += f", {self._ahead[1]:,} floats of its reply came ahead"
                text += " (with a gap)" if self._ahead[2] else ""
        (got, lost), asked = self.receipts, self.checks - self._checks_before
        return (
            f"{text}; asked about {asked} times (the server said got {got}, not got {lost}); "
            f"on this channel {self.resent} resends, {self.late} late answers dropped"
        )

    def silence(self, timeout_ms: int) -> str:
        """What a timeout says of this channel: no reply within ``timeout_ms``, what to check
        and what the request awaited (``waiting``). Pure."""
        hint = (
            ""
            if transport.security() is None
            else "; with security.curve, is this key allow-listed there and the server key the same?"
        )
        return (
            f"no reply from the {self.name} at {self.endpoint} within {timeout_ms / 1000:g} s "
            f"(is it running?{hint}); {self.waiting()}"
        )

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
        most ``timeout_ms`` (in slices of WAKE_MS, so signal handlers run, and ``tick``)."""
        t0 = time.monotonic()
        while True:
            try:
                frames = self.sock.recv_multipart(copy=False)
            except zmq.Again:  # WAKE_MS passed: signal handlers have run; wait on or give up
                if self.timeout_ms >= 0 and time.monotonic() - t0 >= self.timeout_ms / 1000:
                    raise TimeoutError(self.silence(self.timeout_ms)) from None
                self.tick()
                continue
            msg = self._take(frames, kinds, numel)
            if msg is not None:
                return msg

    def poll_reply(self, kinds=None, numel: int | None = None) -> wire.Message | None:
        """``recv`` without waiting: the reply if it is queued (RECEIPTs and late answers
        before it are handled), else None. For callers that poll the socket themselves (and
        call ``tick`` between polls)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            msg = self._take(frames, kinds, numel)
            if msg is not None:
                return msg

    def _take(self, frames, kinds, numel) -> wire.Message | None:
        """The reply in ``frames``, validated; None for a RECEIPT (resending the request if
        the server never got it) or a late answer."""
        msg = wire.decode(frames, numel=numel, dtypes=self.dtypes)
        self._heard()
        timeline.received(self.name, msg)
        asked = None if self._last is None else self._last[0]
        if msg.kind == wire.Kind.RECEIPT:
            if msg.fields["re"] == asked:
                self.receipts[0 if msg.fields["got"] else 1] += 1
                if not msg.fields["got"]:
                    self.resend()  # lost on the way (a dropped connection, a restarted server)
            return None
        re = msg.fields.get("re")
        if re is not None and re != asked:
            self.late += 1  # a late answer to a request sent twice: dropped
            return None
        if msg.kind == wire.Kind.WEIGHTS and "at" in msg.fields:
            if self._part(msg):
                return None
        self._last = None  # a reply without x{re} (older servers' ERROR) is taken as it comes
        if msg.kind == wire.Kind.ERROR:
            raise ServerError(
                msg.fields["code"], f"{self.name} refused the request: {msg.fields['error']}"
            )
        if kinds is not None and msg.kind not in kinds and msg.kind != wire.Kind.STOP:
            raise wire.WireError("unexpected_kind", f"{self.name} answered {msg.kind.name}")
        if msg.inc:
            self.inc = msg.inc
        return msg

    def _heard(self) -> None:
        """The server said something: it is not silent (and is said to answer again if it
        was)."""
        now = time.monotonic()
        if self.silent_since is not None:
            notice(
                log,
                "the %s at %s answers again, after %.1f s of silence",
                self.name,
                self.endpoint,
                now - max(self._heard_at, self._sent_at),
            )
            self.silent_since = None
        self._heard_at, self._unanswered = now, 0

    def _part(self, msg: wire.Message) -> bool:
        """A WEIGHTS x{at} to the request in parts: a part ahead (x{more}) is decoded into
        its place (True: the reply is still to come); the reply itself, carrying the rest,
        is checked to follow what came ahead (False). Raises ``ServerError`` code rejoin
        when parts were lost (a connection that dropped): the server's WELCOME brings the
        whole range again."""
        at, ahead, n = msg.fields["at"], self._ahead, msg.payload_numel
        if msg.fields.get("more"):
            if ahead is not None and at + n <= ahead[0].shape[0]:
                codec.load(ahead[0][at : at + n], msg.payloads)
                ahead[1] += n
                if self.on_part is not None:
                    self.on_part(at, n)
            elif ahead is not None:
                ahead[2] = True
            return True
        if ahead is None or ahead[2] or ahead[1] + n != ahead[0].shape[0]:
            self._last = self._ahead = None
            raise ServerError(
                "rejoin",
                f"{self.name}: parts of its weights sent ahead of its reply were lost "
                f"(the reply carries {n:,} floats at {at:,}, "
                f"{0 if ahead is None else ahead[1]:,} came ahead)",
            )
        return False

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
        """Close the socket; a request still being sent gets ``LINGER_MS`` more, and one that
        libzmq may hold half-sent after that (a server that reads nothing) is never dropped
        half (``outbox``: libzmq 4.3.5 aborts if the connection ends just as one is;
        docs/wire.md, "Half-sent messages"). Blocks up to ``LINGER_MS``."""
        self.out.wait(transport.LINGER_MS)
        up = self.link.up()  # after the wait: a connection that ended meanwhile took its part
        self.link.close()
        self.out.close(transport.LINGER_MS, connected=up, wait=False)


def send_check(sock: zmq.Socket, sender: int, seq: int, inc: int = 0) -> bool:
    """Ask the server whether request ``seq`` of ``sender`` reached it (CHECK, a header; its
    RECEIPT comes like a reply). False, with nothing sent, when the socket is not connected
    or its queue is full. Never blocks."""
    try:
        sock.send_multipart(wire.encode(wire.Kind.CHECK, sender, seq, 0, inc), zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


class LinkWatch:
    """Whether the connection of a client socket dropped and came back: the evidence that a
    request on it, or its reply, was lost. Make it before ``connect``. Never blocks; not
    thread-safe (the socket's owner uses it); ``close()`` before the socket."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._dropped = False  # a drop seen, the reconnect not yet
        self._up = False  # a connection is up (as of the events read)
        self._back = False  # it came back since ``reconnected`` last said so

    def _read(self) -> None:
        """Take the monitor's events so far. Never blocks; never raises on a terminated
        context (the process is stopping: nothing more is learnt)."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:  # Again: no more; ETERM: the context is terminating
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._dropped, self._up = True, False
            elif event == zmq.EVENT_CONNECTED:
                self._up = True
                if self._dropped:
                    self._dropped, self._back = False, True

    def reconnected(self) -> bool:
        """Whether the connection dropped and came back since the last call."""
        self._read()
        back, self._back = self._back, False
        return back

    def up(self) -> bool:
        """Whether the socket's connection is up, as far as the events so far say."""
        self._read()
        return self._up

    def close(self) -> None:
        """Stop the monitor and close its socket; never raises on a terminated context (the
        owner's socket must still be closed after, or ``ctx.term()`` waits for it)."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:  # the context is terminating: closing the pair is what is left
            pass
        self._monitor.close(linger=0)


class ServerError(RuntimeError):
    """The server answered ERROR; ``code`` says why (e.g. bad_length, protocol)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
