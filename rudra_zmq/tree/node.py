"""A Rudra-adv tree node: sums its children's gradients and relays one sum to its parent.

To its children (learners for a leaf, tree nodes for an inner node) it looks like a parameter
server (HELLO, PUSH/PUSHPULL, PULL, RELAY); to its parent (an inner node or the root PS) it looks
like one client, sending HELLO x{subtree} and RELAY x{clock}. One thread owns both
sockets (ROUTER to the children, DEALER to the parent), polled together.

- Every HELLO is checked against the tree the config plans (``topology``); the model's size and
  signature come from the first child, so the node never imports torch.
- Gradients are checked by a :class:`~rudra_zmq.sync.relay_clock.RelayClock` and summed in place.
  A child is answered when the relay carrying its gradient is answered: WEIGHTS or UPTODATE, or
  ACK under advstar, where PULL and PUSHPULL are refused. PULLs are served from the cached
  weights when the clock says (``RelayClock.reply``).
- STOP from the parent reaches every child at its next request (waiting ones at once); the node
  returns once every learner below it has been told.

Copies: none for weights (the parent's frames are kept as the cache, never written, and sent on
zero-copy). Gradients are summed into one of two buffers; the other is the relay in flight,
written again only after the parent answers. Never hangs: a parent silent for
``runtime.timeout_s`` while a request is in flight, or children silent that long, raises. State:
``state.NodeState`` (changed through its methods only); requests: ``server/serving.py``; answers to
children: ``weights.py``; shared memory or payloads: ``leaf_shm.py`` (one strategy, chosen
at start); relay rules: ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from .. import codec, transport, wire
from ..channel import Channel, ServerError
from ..outbox import Outbox
from ..server.serving import Serving
from ..wire import Kind
from .leaf_shm import make_shared
from .state import NodeState
from .weights import make_children_out

log = logging.getLogger("rudra_zmq.tree_node")


class TreeNode:
    """Tree node ``node_id`` of the config's tree, bound at ``bind``, relaying to ``parent``.

    ``serve_forever()`` runs it in the calling thread. Not thread-safe: construct and serve
    from one thread.
    """

    def __init__(
        self,
        cfg,
        node_id: int,
        bind: str,
        parent: str,
        ctx: zmq.Context | None = None,
        server: int = 0,
    ):
        self.cfg = cfg
        self.state = NodeState(cfg, node_id, server)
        self.spec, self.id = self.state.spec, node_id
        self.sender = wire.node_sender(node_id)
        self.lam = cfg.sync.learners
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        self.codec = codec.for_gradients(cfg)  # how the relayed sums are encoded
        self.timeout = cfg.runtime.timeout_s
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = transport.make_socket(
            self.ctx,
            zmq.ROUTER,
            hwm=max(64, 4 * len(self.spec.subtree)),
            max_bytes=transport.frame_limit(self.chunk_bytes),
            sndbuf=cfg.runtime.sndbuf_kib << 10,
        )
        self.out = Outbox(self.sock, head=2)  # to its children; chunked sums tracked (outbox)
        self.endpoint = transport.bind(self.sock, bind)
        up = "the root" if self.spec.parent is None else f"tree node {self.spec.parent}"
        up += self.state.place.of_range
        self.parent = Channel(
            self.ctx,
            parent,
            self.sender,
            name=f"parent ({up})",
            timeout_ms=int(self.timeout * 1000),
            hwm=4,
            retry_ms=int(cfg.runtime.retry_s * 1000),
            max_bytes=transport.frame_limit(self.chunk_bytes),
            dtypes=codec.dtypes(cfg),
            sndbuf=cfg.runtime.sndbuf_kib << 10,
        )
        # chosen once: slots and board (a leaf with architecture.leaf_shm) or payloads only
        self.shared = make_shared(cfg, self.spec, self.state.advstar)
        self.children_out = make_children_out(self.state, self._send, self.shared)
        self._asked: float | None = None  # when the request to the parent in flight was sent
        self._seq = 0
        self.serving = Serving(
            self.sock,
            self.sender,
            self.state,
            {
                Kind.HELLO: self.on_hello,
                Kind.PULL: self.on_pull,
                Kind.PUSH: self.on_gradient,
                Kind.PUSHPULL: self.on_gradient,
                Kind.RELAY: self.on_gradient,
            },
            send=self._send,
            stop=self._stop,
            dtypes=codec.dtypes(cfg),
            learners=self.lam,
            log=log,
            slots=self.shared.takes_slots,
        )

    @property
    def ts(self) -> int:
        return self.state.ts

    # ------------------------------------------------------------------ children
    def _send(self, ident: bytes, kind: Kind, payloads=(), **fields) -> None:
        self._seq += 1
        frames = wire.encode(
            kind,
            self.sender,
            self._seq,
            max(self.ts, 0),
            self.state.incarnation,
            payloads,
            **fields,
        )
        self.serving.deliver(self.out, ident, frames, kind, self.cfg.runtime.retry_s)

    def _stop(self, ident: bytes, sender: int, re: int) -> None:
        self.state.mark_stopped(sender)
        self._send(ident, Kind.STOP, reason=self.state.stop_reason, re=re)

    def handle(self, frames) -> None:
        """Process one message from a child (routing id first) down the request path
        (``Serving.handle``). Never raises for bad input."""
        self.serving.handle(frames)

    def on_hello(self, ident: bytes, msg: wire.Message) -> None:
        """Register the child; the first one makes the node say HELLO upstream. Answered
        once the parent's WELCOME is here."""
        st = self.state
        first = st.register(ident, msg)
        if st.done:  # after training: a planned child is told STOP
            self._stop(ident, msg.sender, msg.seq)
            return
        if first:  # x{had} and its copy of the range: what its first child saw and holds
            had = {"had": msg.fields["had"]} if "had" in msg.fields else {}
            self.parent.send(  # (a restarted root takes its range back from the freshest)
                Kind.HELLO,
                0,
                msg.payloads if had else (),
                model=st.signature,
                numel=st.model_numel,
                range=st.range,  # its range, from the plan
                subtree=sorted(self.spec.subtree),
                **had,
            )
            self._asked = time.time()
        self.shared.hello(msg, st.numel, st.weights if st.welcome is not None else None, st.ts)
        if st.admit(ident, msg.sender, msg.seq):  # else after the parent's WELCOME, or a
            self._welcome(ident, msg.sender, msg.seq)  # restarted one's held gradient's answer

    def _welcome(self, ident: bytes, sender: int, re: int) -> None:
        self._send(
            ident,
            Kind.WELCOME,
            self.state.weights,
            **self.state.welcome,
            **self.shared.welcome_fields(sender),
            **self.state.where(sender),
            re=re,
        )

    def on_pull(self, ident: bytes, msg: wire.Message) -> None:
        """Answered from the cached weights when the clock says (at once, or parked until
        newer ones are here)."""
        self.children_out.check_pull(msg)
        reply = self.state.clock.reply(msg.sender)
        if self.state.clock.due(reply):
            self.children_out.answer(ident, Kind.PULL, msg.ts, msg.seq)
        else:
            self.state.park(ident, msg, reply)

    def on_gradient(self, ident: bytes, msg: wire.Message) -> None:
        """PUSH/PUSHPULL from a learner or RELAY from a child node: into the pending sum."""
        if msg.kind == Kind.PUSHPULL:
            self.children_out.check_pull(msg)
        st = self.state
        if st.is_duplicate(ident, msg):  # a resend: held (answered later) or answered again
            if not st.held(msg.sender):
                self.children_out.answer(ident, msg.kind, msg.ts, msg.seq)
            return
        entries = st.entries(msg)
        st.add(ident, msg, entries, self.shared.pieces(msg))  # raises before the sum changes
        self.shared.pushed(ident, msg)

    # ------------------------------------------------------------------ parent
    def _maybe_relay(self) -> None:
        if self._asked is not None:
            return
        relay = self.state.take_relay()
        if relay is not None:
            buf, clock = relay
            self.parent.send(
                Kind.RELAY,
                self.ts,
                self.codec.encode(buf, self.chunk_bytes),
                clock=[list(e) for e in clock],
            )
            self._asked = time.time()

    def _from_parent(self) -> None:
        if self._asked is None:  # nothing in flight: late answers to a request sent twice
            self.parent.drop_late()
            return
        st = self.state
        kinds = (
            {Kind.WELCOME}
            if st.welcome is None
            else {Kind.ACK}
            if st.advstar
            else {Kind.WEIGHTS, Kind.UPTODATE}
        )
        try:
            msg = self.parent.poll_reply(kinds, numel=st.numel)
        except ServerError as exc:
            for ident, _sender, seq in st.hellos:  # the parent refused our HELLO: say why
                self._send(ident, Kind.ERROR, code=exc.code, error=str(exc), re=seq)
            # "rejoin": the parent restarted; so does this node (the launcher restarts it)
            # and its children rejoin it, so nothing below is counted twice
            raise RuntimeError(f"tree node {self.id}: {exc}") from None
        if msg is None:  # a RECEIPT, or a late answer
            return
        self._asked = None
        if msg.kind == Kind.STOP:
            for ident, sender, *_, seq in st.stop(msg.fields["reason"]):
                self._stop(ident, sender, seq)
        elif msg.kind == Kind.WELCOME:
            hellos = st.welcomed(msg.fields, msg.payloads, msg.ts)
            self.shared.publish(msg.ts, st.weights)
            for ident, sender, seq in hellos:
                self._welcome(ident, sender, seq)
        else:
            self._answered(msg)

    def _answered(self, msg: wire.Message) -> None:
        """The parent answered our relay: new weights (board first), then the children."""
        st = self.state
        weights = msg.payloads if msg.kind == Kind.WEIGHTS else None
        if weights is not None and msg.ts > st.ts:
            self.shared.publish(msg.ts, weights)  # before any child is told to read it
        ts = msg.ts if msg.kind in (Kind.WEIGHTS, Kind.ACK) else st.ts
        for ident, _sender, kind, child_ts, seq in st.answered(ts, weights):
            self.children_out.answer(ident, kind, child_ts, seq)
        for ident, sender, seq in st.rejoins_due():
            self._welcome(ident, sender, seq)
        for ident, _sender, child_ts, seq in st.pulls_due():
            self.children_out.answer(ident, Kind.PULL, child_ts, seq)

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event=None) -> int:
        """Serve until training is done and every learner below was told, or ``stop_event``
        is set. Blocks. Raises TimeoutError (a silent parent or silent children) or
        RuntimeError (the parent refused us) with a message naming the node and the peer."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.parent.sock, zmq.POLLIN)
        last_child = time.time()
        st = self.state
        try:
            while not (stop_event is not None and stop_event.is_set()) and not (
                st.finished and time.time() >= self.serving.stay_until
            ):
                events = dict(poller.poll(100))
                if self.parent.sock in events:
                    self._from_parent()
                if self.sock in events:
                    transport.drain(self.sock, self.handle)
                    last_child = time.time()
                self._maybe_relay()
                self._check_time(last_child)
                if st.stop_reason is not None and time.time() - last_child > self.timeout:
                    log.warning(
                        "training is done but learners %s never came back; exiting",
                        sorted(self.spec.subtree - st.stopped),
                    )
                    break
        finally:
            self.close()
        log.info(
            "tree node %d: %d relays carrying %d gradients, %d refused messages",
            self.id,
            st.relays,
            st.gradients,
            st.invalid,
        )
        return 0

    def _check_time(self, last_child: float) -> None:
        now, st = time.time(), self.state
        if self._asked is not None:
            self.parent.tick()  # asks whether the parent got it; resends only if it was lost
        if self._asked is not None and now - self._asked > self.timeout:
            raise TimeoutError(
                f"tree node {self.id}: no reply from its {self.parent.name} at "
                f"{self.parent.endpoint} within {self.timeout:.0f} s (runtime.timeout_s); is "
                "the parent running?"
            )
        if self._asked is None and st.stop_reason is None and now - last_child > self.timeout:
            raise TimeoutError(
                f"tree node {self.id}: no message from any child for {self.timeout:.0f} s at "
                f"timestamp {self.ts} (children registered: "
                f"{[wire.sender_name(s) for s in sorted(st.identities)]}); is a child dead?"
            )

    def close(self) -> None:
        """Close the sockets and unmap shared memory."""
        self.shared.close()
        self.parent.close()
        over = self.state.stop_reason is not None  # the STOPs just queued get time to leave
        self.out.close(transport.closing_linger_ms(self.cfg.runtime.retry_s, over))
        if self.endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self.endpoint[len("ipc://") :])
            except OSError:
                pass
        if self._own_ctx:
            transport.term(self.ctx)


def serve(cfg, node_id: int, bind: str, parent: str, server: int = 0) -> int:
    """Entry point of ``rudra-zmq node``: run one tree node (of server ``server``'s range's
    tree) until training ends."""
    node = TreeNode(cfg, node_id, bind, parent, server=server)
    print(f"{node.spec.describe()}; listening on {node.endpoint}, parent {parent}", flush=True)
    return node.serve_forever()
