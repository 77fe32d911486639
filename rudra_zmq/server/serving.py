"""The request path of the servers learners talk to: the PS (``ps.py``) and the tree node
(``tree/node.py``), each of which holds one :class:`Serving` and gives it its handlers.

One ROUTER message goes::

    wire.decode -> authorise (the connection's key may speak as the sender)
      CHECK:  RECEIPT x{got}: whether the sender's request with that seq reached this server
      HELLO:  the id must not be held by another live connection ("in_use") -> handlers[HELLO]
      others: state.check_sender -> heard -> STOP once training is over -> handlers[kind]
              (BYE is answered here: ACK, the sender marked stopped)

A bad message, or a ``ProtocolViolation`` raised by the state or a handler, is refused: an
ERROR reply with a code and a text that says what was wrong (the texts are here), counted by
``state.refused()`` and logged at most once per sender and code every few seconds. Nothing the
peer sends makes ``handle`` raise.

The state gives ``numel``, ``identities``, ``done``, ``check_sender(ident, msg)``,
``mark_stopped(sender)`` and ``refused()``; the server gives ``send(ident, kind, payloads=(),
**fields)`` and ``stop(ident, sender, seq)``. Not thread-safe: owned by the server's thread.
"""

from __future__ import annotations

import time

import zmq

from .. import transport, wire
from ..sync import ProtocolViolation, Rejoin
from ..wire import Kind
from .throttled_log import ThrottledLog

REQUESTS = frozenset(
    {Kind.HELLO, Kind.PUSH, Kind.PULL, Kind.PUSHPULL, Kind.BYE, Kind.RELAY, Kind.CHECK}
)


class Serving:
    """The request path of the server whose ROUTER socket is ``sock``, speaking as ``me``.

    Args:
        sock: the server's ROUTER socket (read by the server's loop, asked here whether a
            peer is still connected).
        me: the server's sender id (``wire.SENDER_PS`` or ``wire.node_sender(k)``).
        state: the server's state (``ServerState`` or ``NodeState``).
        handlers: Kind -> handler(ident, msg) for HELLO, PUSH, PUSHPULL, RELAY and PULL.
        send, stop: the server's reply and its STOP (which marks the sender stopped).
        learners: λ, the bound on learner ids the wire checks.
        log: the server's logger (refusals are warnings there).
        heard: called (sender, now) for each request that passed the sender check, or None.
        slots: accept gradients in shared-memory slots (a leaf with ``architecture.leaf_shm``).
        dtypes: the run's wire dtypes (``codec.dtypes(cfg)``), which payloads are checked against.
    """

    def __init__(
        self,
        sock,
        me: int,
        state,
        handlers: dict,
        *,
        send,
        stop,
        learners: int,
        log,
        heard=None,
        slots: bool = False,
        dtypes: wire.ModelDtypes = wire.FLOAT32,
        parts: bool = False,
    ):
        self.sock, self.me, self.state = sock, me, state
        self.handlers = {**handlers, Kind.BYE: self.bye}
        self.send, self.stop, self.heard = send, stop, heard
        self.learners, self.slots, self.dtypes, self.parts = learners, slots, dtypes, parts
        self.warn = ThrottledLog(log)
        self.security = transport.security()
        self.seen: dict[int, int] = {}  # sender -> the seq of its newest request received
        self.refused_parts: dict[int, int] = {}  # sender -> its request refused within a copy
        self.lost: set[bytes] = set()  # connections a reply could not be queued to (EAGAIN)
        self.stay_until = 0.0  # the server serves at least until then (time.time())

    def handle(self, frames) -> None:
        """Take one ROUTER message (routing id first) down the request path. Never raises for
        bad input; does not block beyond the handler."""
        if len(frames) < 2:
            return  # no routing id + header: nothing to answer
        ident = bytes(frames[0])
        try:
            msg = wire.decode(
                frames[1:],
                kinds=REQUESTS,
                numel=self.state.numel,
                learners=self.learners,
                slots=self.slots,
                dtypes=self.dtypes,
            )
        except wire.WireError as exc:
            self.refuse(ident, "unknown sender", exc.code, str(exc))
            return
        if self.security is not None and not self.security.may_speak(frames[1], msg.sender):
            self.refuse(
                ident,
                msg.sender,
                "forbidden",
                f"this connection's key may not speak as {wire.sender_name(msg.sender)}",
                re=msg.seq,
            )
            return
        if msg.kind == Kind.CHECK:  # before the sender check: an honest answer to anyone
            # a reply this connection could not be given counts as never got: the sender asks
            # again and is answered as before (a duplicate), instead of waiting for it
            got = ident not in self.lost and self.seen.get(msg.sender, -1) >= msg.seq
            self.lost.discard(ident)
            self.send(ident, Kind.RECEIPT, re=msg.seq, got=got)
            return
        if msg.is_part:  # one part of a request (wire.parts)
            if not self.parts:
                self._refuse_request(
                    ident,
                    msg,
                    "unexpected_field",
                    f"{msg.kind.name} x{{at, more}} (a gradient in parts): this server takes "
                    "whole gradients (wire.parts=1; is the sender running another config?)",
                )
                return
        else:  # a request in parts is seen once all of it is in (the handler's ``saw``)
            self.saw(msg.sender, msg.seq)
        try:
            if msg.kind == Kind.HELLO:  # checked by its handler (a HELLO counts once accepted)
                if self._in_use(ident, msg.sender):
                    self.refuse(
                        ident,
                        msg.sender,
                        "in_use",
                        f"{wire.sender_name(msg.sender)} "
                        "is connected already (is a second one running with this id?)",
                        re=msg.seq,
                    )
                    return
            else:
                self.state.check_sender(ident, msg)
                if self.heard is not None:
                    self.heard(msg.sender, time.time())
                if self.state.done:  # (a request in parts is told once, at its last part)
                    if not msg.fields.get("more"):
                        self.stop(ident, msg.sender, msg.seq)
                    return
            self.handlers[msg.kind](ident, msg)
        except ProtocolViolation as exc:
            code = "rejoin" if isinstance(exc, Rejoin) else "protocol"
            self._refuse_request(ident, msg, code, str(exc))

    def _refuse_request(self, ident: bytes, msg: wire.Message, code: str, message: str) -> None:
        """``refuse`` once per copy of a request: the parts after the one refused, up to the
        copy's last (the one without x{more}, whatever its offset: ``wire.priority`` sends
        part 0 last), are dropped (one ERROR and one count, not one per part); a copy sent
        again (``Channel.resend``) is answered again."""
        if msg.is_part:
            more = msg.fields.get("more", False)
            if self.refused_parts.get(msg.sender) == msg.seq:  # within a copy refused
                if not more:  # its last part: a copy sent again is a new one
                    del self.refused_parts[msg.sender]
                return
            if more:
                self.refused_parts[msg.sender] = msg.seq
        self.refuse(ident, msg.sender, code, message, re=msg.seq)

    def deliver(self, out, ident: bytes, frames, kind: Kind, retry_s: float) -> bool:
        """Queue ``frames`` to ``ident`` on ``out`` (the server's Outbox) without blocking;
        return whether it was queued. A peer that is gone (ROUTER_MANDATORY) or whose queue is
        full (EAGAIN: ``not_queued``, its next CHECK hears "not got") loses the message, with a
        throttled warning: each peer has at most one request in flight, so a full queue means
        it misbehaves, and the server never stalls for it."""
        try:
            out.send([ident, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                self.not_queued(ident, retry_s)
            self.warn.warning(
                ("undelivered", ident), "could not send %s to %r: %s", kind.name, ident, exc
            )
            return False
        return True

    def not_queued(self, ident: bytes, retry_s: float) -> None:
        """A reply to ``ident`` found its queue full (EAGAIN): that connection's next CHECK
        hears "not got", and the server stays ``retry_s`` + 1 s for it (were it a STOP, the
        learner asks again within ``retry_s``). Connections marked so earlier that are gone
        (``transport.peer_connected``) are forgotten: only one still there can ask, so the set
        follows the live connections, not every one a long run has seen."""
        gone = [i for i in self.lost if not transport.peer_connected(self.sock, i, self.me)]
        self.lost.difference_update(gone)
        self.lost.add(ident)
        self.stay_until = max(self.stay_until, time.time() + retry_s + 1)

    def saw(self, sender: int, seq: int) -> None:
        """Request ``seq`` of ``sender`` reached this server (a CHECK about it hears "got");
        its seqs only grow (Channel), even across restarts."""
        self.seen[sender] = max(seq, self.seen.get(sender, -1))

    def _in_use(self, ident: bytes, sender: int) -> bool:
        """Whether another connection that is still up holds ``sender`` (one evicted or gone
        is taken over by the new HELLO)."""
        old = self.state.identities.get(sender)
        return (
            old is not None and old != ident and transport.peer_connected(self.sock, old, self.me)
        )

    def refuse(self, ident: bytes, sender, code: str, message: str, re=None) -> None:
        """Answer ERROR x{code, error} (x{re} when the request's seq is known); count and log
        it. Nothing else changes."""
        self.state.refused()
        self.warn.warning(
            (ident, code), "refused a message from %s (%r): %s", sender, ident, message
        )
        self.send(ident, Kind.ERROR, code=code, error=message, **({} if re is None else {"re": re}))

    def bye(self, ident: bytes, msg: wire.Message) -> None:
        """BYE: the sender leaves cleanly (a tree node's BYE covers the learners below it)."""
        self.state.mark_stopped(msg.sender)
        self.send(ident, Kind.ACK, re=msg.seq)
