"""How the parameter server hands out weights: one class per architecture, chosen at start.

- :class:`ReplyWeights` (``base``, ``adv``): weights travel in replies. A PUSHPULL, RELAY or
  PULL is answered when the sync engine says (``sync.Reply``: at once, or parked until a
  later timestamp exists: hardsync's update), WEIGHTS when the server is newer than the
  sender, else UPTODATE.
- :class:`BroadcastWeights` (``advstar``): every new version goes down the learners'
  broadcast (``broadcast.py``); gradients are answered ACK and pulls are refused.

Both send through the server's ``send(ident, kind, payloads=(), **fields)`` and read its
``ServerState``. Not thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

from .. import topology, wire
from ..sync import ProtocolViolation, Reply
from ..wire import Kind


def make_weights_out(cfg, state, send, ctx, broadcast: str | None):
    """The way this run's PS hands out weights (``architecture.kind``)."""
    if cfg.architecture.kind == "advstar":
        if not broadcast:
            raise ValueError(
                "architecture.kind=advstar: the parameter server needs a "
                "broadcast endpoint to bind (rudra-zmq ps --bcast-bind EP)"
            )
        return BroadcastWeights(state, send, ctx, broadcast, topology.broadcast_children(cfg, None))
    return ReplyWeights(state, send)


class ReplyWeights:
    """Weights in replies to PUSHPULL, RELAY and PULL (Rudra-base and Rudra-adv)."""

    endpoint = None  # no broadcast

    def __init__(self, state, send):
        self.state, self.send = state, send
        # replies the engine holds: (routing id, sender, seq, the request's ts, sync.Reply)
        self.parked: list[tuple[bytes, int, int, int, Reply]] = []

    @property
    def waiting(self) -> set[int]:
        """Senders whose reply is parked: the server owes them one."""
        return {p[1] for p in self.parked}

    def readdress(self, sender: int, ident: bytes) -> None:
        """``sender`` asked again on connection ``ident``: its parked reply goes there."""
        self.parked = [(ident, *p[1:]) if p[1] == sender else p for p in self.parked]

    def answer(
        self, ident: bytes, msg: wire.Message, sigma: int, reply: Reply | None = None
    ) -> None:
        """Answer a gradient that did not end training: ACK a PUSH, else as a pull, when
        ``reply`` (the arrival's; None: ask the engine now) says."""
        if msg.kind == Kind.PUSH:
            self.send(ident, Kind.ACK, sigma=sigma, re=msg.seq)
        else:
            self.pull(ident, msg, sigma, reply)

    def check_pull(self, msg: wire.Message) -> None:
        """Pulls are served."""

    def pull(
        self, ident: bytes, msg: wire.Message, sigma: int | None = None, reply: Reply | None = None
    ) -> None:
        """Park the reply if the engine holds it (``reply``, or the engine's word for the
        sender now); else WEIGHTS if the server is newer than ``msg.ts``, or UPTODATE."""
        reply = self.state.reply(msg.sender) if reply is None else reply
        if not self.state.engine.due(reply):
            self.parked.append((ident, msg.sender, msg.seq, msg.ts, reply))
            return
        extra = {"re": msg.seq} if sigma is None else {"sigma": sigma, "re": msg.seq}
        if self.state.engine.timestamp > msg.ts:
            frames, at = self.state.weights_for(msg.sender)
            self.send(ident, Kind.WEIGHTS, frames, **extra, **at)
        else:
            self.send(ident, Kind.UPTODATE, **extra)

    def updated(self, update) -> None:
        """A new version exists: nothing to publish (``release`` sends the replies it made
        due)."""

    def release(self, stop) -> None:
        """The parked replies the engine now says are due go (or ``stop(ident, sender, seq)``
        once training is done)."""
        parked, self.parked = self.parked, []
        for ident, sender, seq, ts, reply in parked:
            if self.state.done:
                stop(ident, sender, seq)
            elif not self.state.engine.due(reply):
                self.parked.append((ident, sender, seq, ts, reply))
            elif self.state.engine.timestamp > ts:
                frames, at = self.state.weights_for(sender)
                self.send(ident, Kind.WEIGHTS, frames, re=seq, **at)
            else:
                self.send(ident, Kind.UPTODATE, re=seq)

    def ahead(self, ready) -> None:
        """Send the parts of the next version just stepped (``ServerState.parts_ahead``:
        (part, its weights)) to the members whose request awaits them: WEIGHTS x{re, at,
        more}, stamped with the version they belong to; each part encoded once."""
        st = self.state
        for i, weights in ready:
            frames = st.codec.encode(weights, st.chunk_bytes)
            at = st.parts.round.bounds[i]
            for sender, seq in st.parts.round.ahead_to(i, st.engine.members):
                ident = st.identities.get(sender)
                if ident is not None:
                    ts = st.engine.timestamp + 1
                    self.send(ident, Kind.WEIGHTS, frames, ts=ts, re=seq, at=at, more=True)

    def close(self) -> None:
        """Nothing to release."""


class BroadcastWeights:
    """Rudra-adv*: each version goes down the broadcast; gradients are answered ACK."""

    def __init__(self, state, send, ctx, bind: str, children):
        from ..broadcast.root import BroadcastRoot

        self.state, self.send = state, send
        self.root = BroadcastRoot(
            ctx,
            bind,
            state.numel,
            chunk_bytes=state.chunk_bytes,
            children=children,
            wire_codec=state.codec,
        ).start()
        self.endpoint = self.root.endpoint
        # v0: the chain is up. No copy: a weight version is never written again while
        # anything refers to it (WeightVersions), the broadcast's frames included.
        self.root.publish(state.engine.timestamp, state.w, copy=False)

    waiting: set = frozenset()  # nothing is ever parked

    def readdress(self, sender: int, ident: bytes) -> None:
        """Nothing is parked."""

    def answer(
        self, ident: bytes, msg: wire.Message, sigma: int, reply: Reply | None = None
    ) -> None:
        """ACK every gradient at once: no weights in replies (a protocol that holds replies
        is refused under advstar by ``sync.check_protocol``)."""
        self.send(ident, Kind.ACK, sigma=sigma, re=msg.seq)

    def pull(
        self, ident: bytes, msg: wire.Message, sigma: int | None = None, reply: Reply | None = None
    ) -> None:
        """Refused (see ``check_pull``)."""
        self.check_pull(msg)

    def check_pull(self, msg: wire.Message) -> None:
        """Raise ProtocolViolation: weights come by the broadcast."""
        raise ProtocolViolation(
            f"{wire.sender_name(msg.sender)} sent {msg.kind.name}, but with architecture."
            "kind=advstar the parameter server serves no weights: they come by the learners' "
            "broadcast; push gradients with PUSH"
        )

    def release(self, stop) -> None:
        """Nothing is parked."""

    def ahead(self, ready) -> None:
        """Nothing goes ahead (wire.parts runs with architecture.kind=base only)."""

    def updated(self, update) -> None:
        """Publish the new version (and, at the end, STOP down the broadcast)."""
        self.root.publish(
            update.timestamp,
            self.state.w,
            done=self.state.done,
            copy=False,
            reason=f"training finished at epoch {update.epoch:.2f}",
        )

    def close(self) -> None:
        """Stop the broadcast's I/O thread."""
        self.root.close()
