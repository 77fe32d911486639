"""A Rudra-adv tree node: sums its children's gradients and relays one sum to its parent.

The node sits between its children (learners for a leaf, tree nodes for an inner node) and
its parent (an inner node or the root parameter server)::

    children --DEALER--> [ROUTER  tree node  DEALER] --RELAY--> parent
     HELLO, PUSHPULL,       sum buffer, vector        HELLO, RELAY x{wait, clock}
     PULL, RELAY            clock, cached weights     <- WELCOME, WEIGHTS/UPTODATE, STOP

To its children it looks like a parameter server (they speak HELLO/PUSHPULL/PULL/RELAY to
it); to its parent it looks like one client. One thread owns both sockets, polled together.

- HELLO: checked against the tree the config plans (``topology``). The node learns the model
  signature and size from its first child (so it never imports torch), says HELLO upstream
  with the learners below it, and answers its children's HELLOs with the parent's weights.
- PUSH/PUSHPULL (learners) and RELAY (child nodes): checked by a :class:`~rudra_zmq.sync.
  RelayClock` and summed in place into the sum buffer (the first gradient is copied, the
  rest accumulated, by the compiled kernels). The child is answered when the relay carrying
  its gradient is answered: with the weights the parent returned (WEIGHTS), or UPTODATE.
- Relay: hardsync once every learner below has contributed, with ``wait`` (the root answers
  after its update); softsync/async as soon as anything is pending and no relay is in flight.
- PULL (no gradient): answered at once from the cached weights, or parked until newer ones.
- STOP from the parent: every child is told STOP at its next request (waiting ones at once);
  the node returns once every learner below it has been told.

Rudra-adv* (``architecture.kind: advstar``): the same tree carries the gradients up, but no
weights down. Learners PUSH and are answered ACK (or STOP) when the relay carrying their
gradient is answered; the root answers relays ACK, whose header ts tells the node the root's
timestamp. PULL and PUSHPULL are refused: weights reach the learners by their broadcast
(``roles/broadcast.py``). A learner may hold a version newer than any reply the node has seen,
so the node accepts any gradient timestamp >= 0 and the root checks it against its own.

Shared memory (``architecture.leaf_shm``, ``shm.py``): a learner on the leaf's host says
HELLO x{shm: token} and the leaf maps its two gradient slots; the leaf makes one weight board
(not under advstar) and answers WELCOME x{shm: board token}. That learner then pushes
x{slot} with no payload (the leaf sums the slot as it would a frame) and is answered WEIGHTS
x{board: true}: the leaf publishes each new version to the board once, for all its learners.
Whatever fails (no /dev/shm room, another host, a non-x86 CPU) leaves that learner on ZeroMQ
payloads; the board's name is unlinked once every learner below has pushed.

Copies, and why: none for weights — the parent's WEIGHTS frames are received zero-copy, kept
as the cache (never written) and sent on to children zero-copy. Gradients are summed into one
of two buffers; the other is the relay in flight, which ZeroMQ may still read until the parent
answers, so it is written again only after that. Never hangs: a parent silent for
``runtime.timeout_s`` while a request is in flight, or children silent that long, raises.
"""
from __future__ import annotations

import logging
import os
import secrets
import time

import numpy as np
import zmq

from .. import kernels, shm, topology, transport, wire
from ..sync import ProtocolViolation, RelayClock, learners_wait
from ..wire import Kind

log = logging.getLogger("rudra_zmq.tree_node")

_REQUESTS = {Kind.HELLO, Kind.PUSH, Kind.PULL, Kind.PUSHPULL, Kind.BYE, Kind.RELAY}


class TreeNode:
    """Tree node ``node_id`` of the config's tree, bound at ``bind``, relaying to ``parent``.

    ``serve_forever()`` runs it in the calling thread. Not thread-safe: construct and serve
    from one thread.
    """

    def __init__(self, cfg, node_id: int, bind: str, parent: str, ctx: zmq.Context | None = None):
        self.cfg = cfg
        self.tree = topology.plan(cfg)
        self.spec = self.tree.node(node_id)
        self.id = node_id
        self.sender = wire.node_sender(node_id)
        self.lam = cfg.sync.learners
        self.hardsync = learners_wait(cfg.sync.protocol)
        self.advstar = cfg.architecture.kind == "advstar"
        self.clock = RelayClock(cfg.sync.protocol, self.spec.subtree,
                                gather=cfg.architecture.relay == "gather")
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        self.timeout = cfg.runtime.timeout_s
        self.inc = secrets.randbits(62) + 1
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = transport.make_socket(self.ctx, zmq.ROUTER,
                                          hwm=max(64, 4 * len(self.spec.subtree)))
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.endpoint = transport.bind(self.sock, bind)
        up = "the root" if self.spec.parent is None else f"tree node {self.spec.parent}"
        self.parent = transport.Channel(self.ctx, parent, self.sender, name=f"parent ({up})",
                                        timeout_ms=int(self.timeout * 1000), hwm=4)
        self.numel: int | None = None        # learned from the first child's HELLO
        self.signature: str | None = None
        self.welcome: dict | None = None     # the parent's WELCOME fields, once it answered
        self.weights: list = []              # the newest weights (parent's frames, read-only)
        self.identities: dict[int, bytes] = {}
        self.subtrees: dict[int, frozenset] = {}
        self.hellos: list[tuple[bytes, int]] = []            # waiting for the parent's WELCOME
        self.waiting: list[tuple[bytes, int, Kind, int]] = []  # gradients in the pending sum
        self.flight: list[tuple[bytes, int, Kind, int]] = []   # gradients in the relay in flight
        self.parked: list[tuple[bytes, int, int]] = []         # PULL wait=True: (id, sender, ts)
        self._sum = self._spare = None       # sum being built / free or in flight
        self._summed = 0                     # gradients in _sum
        self._asked: float | None = None     # when the request to the parent in flight was sent
        self.stop_reason: str | None = None
        self.stopped: set[int] = set()
        self.relays = self.gradients = self.invalid = 0
        self._seq = 0
        self._warned: set = set()
        self.leaf_shm = cfg.architecture.leaf_shm and self.spec.is_leaf
        self.board: shm.WeightBoard | None = None        # made at the first shm HELLO
        self.slots: dict[int, shm.GradientSlots] = {}    # learner -> its mapped slots
        self.by_board: set[bytes] = set()                # children whose last push was by slot
        self._pushed: set[int] = set()                   # learners that pushed (board unlink)
        self._no_shm: str | None = None                  # why the board could not be made

    @property
    def ts(self) -> int:
        return self.clock.timestamp

    # ------------------------------------------------------------------ children
    def _send(self, ident: bytes, kind: Kind, payloads=(), **fields) -> None:
        self._seq += 1
        frames = wire.encode(kind, self.sender, self._seq, max(self.ts, 0), self.inc, payloads,
                             **fields)
        try:
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # that child is gone (ROUTER_MANDATORY) or misbehaves
            log.warning("could not send %s to %r: %s", kind.name, ident, exc)

    def _refuse(self, ident: bytes, sender, code: str, message: str) -> None:
        self.invalid += 1
        if (ident, code) not in self._warned:
            self._warned.add((ident, code))
            log.warning("refused a message from %s (%r): %s", sender, ident, message)
        self._send(ident, Kind.ERROR, code=code, error=message)

    def _answer(self, ident: bytes, kind: Kind, child_ts: int) -> None:
        """Answer a child whose gradient (or pull) is done: newer weights, else UPTODATE
        (ACK for a PUSH, and for everything under advstar: no weights travel down the tree)."""
        if kind == Kind.PUSH or self.advstar:
            self._send(ident, Kind.ACK)
        elif self.ts > child_ts and ident in self.by_board:
            self._send(ident, Kind.WEIGHTS, board=True)  # published when the weights came
        elif self.ts > child_ts:
            self._send(ident, Kind.WEIGHTS, self.weights)
        else:
            self._send(ident, Kind.UPTODATE)

    def _stop(self, ident: bytes, sender: int) -> None:
        self.stopped |= self.tree.below(sender)
        self._send(ident, Kind.STOP, reason=self.stop_reason)

    def handle(self, frames) -> None:
        """Process one message from a child (routing id first). Never raises for bad input."""
        if len(frames) < 2:
            return
        ident = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
        try:
            msg = wire.decode(frames[1:], kinds=_REQUESTS, numel=self.numel, learners=self.lam,
                              slots=self.leaf_shm)
        except wire.WireError as exc:
            self._refuse(ident, "unknown sender", exc.code, str(exc))
            return
        if self.stop_reason is not None:
            self._stop(ident, msg.sender)
            return
        try:
            if msg.kind == Kind.HELLO:
                self._hello(ident, msg)
            elif self.identities.get(msg.sender) != ident or msg.inc not in (0, self.inc):
                raise ProtocolViolation(f"{wire.sender_name(msg.sender)} has not said HELLO to "
                                        f"tree node {self.id} on this connection")
            elif self.advstar and msg.kind in (Kind.PULL, Kind.PUSHPULL):
                raise ProtocolViolation(
                    f"{wire.sender_name(msg.sender)} sent {msg.kind.name}, but with "
                    f"architecture.kind=advstar tree node {self.id} serves no weights: they "
                    "come by the learners' broadcast; push gradients with PUSH")
            elif msg.kind == Kind.BYE:
                self.stopped |= self.tree.below(msg.sender)
                self._send(ident, Kind.ACK)
            elif msg.kind == Kind.PULL:
                if self.ts > msg.ts or not msg.fields["wait"]:
                    self._answer(ident, Kind.PULL, msg.ts)
                else:
                    self.parked.append((ident, msg.sender, msg.ts))
            else:
                self._gradient(ident, msg)
        except ProtocolViolation as exc:
            self._refuse(ident, msg.sender, "protocol", str(exc))

    def _hello(self, ident: bytes, msg: wire.Message) -> None:
        f, who = msg.fields, wire.sender_name(msg.sender)
        below = self.tree.check_child(self.id, msg.sender, f.get("subtree"))
        if self.signature is not None and (f["model"], f["numel"]) != (self.signature,
                                                                       self.numel):
            raise ProtocolViolation(
                f"{who} runs a model with {f['numel']:,} parameters (signature {f['model']}); "
                f"tree node {self.id} relays {self.numel:,} ({self.signature}). Is {who} "
                "running another model config?")
        if self.signature is None:  # the first child: say HELLO upstream with its model
            self.signature, self.numel = f["model"], f["numel"]
            self.parent.send(Kind.HELLO, model=self.signature, numel=self.numel,
                             subtree=sorted(self.spec.subtree))
            self._asked = time.time()
        self.identities[msg.sender] = ident
        self.subtrees[msg.sender] = below
        if self.leaf_shm and "shm" in f:
            self._map_slots(msg.sender, f["shm"])
        if self.welcome is None:
            self.hellos.append((ident, msg.sender))
        else:
            self._welcome(ident, msg.sender)

    def _welcome(self, ident: bytes, sender: int) -> None:
        extra = {}
        if sender in self.slots:  # accepted: the board's token ("" under advstar: no board)
            extra["shm"] = self.board.token if self.board is not None else ""
        self._send(ident, Kind.WELCOME, self.weights, **self.welcome, **extra)

    def _map_slots(self, learner: int, token: str) -> None:
        """leaf_shm: map ``learner``'s gradient slots (making the board first, once). Any
        failure leaves that learner on ZeroMQ payloads (no shm in its WELCOME)."""
        old = self.slots.pop(learner, None)   # a learner saying HELLO again
        if old is not None:
            old.close()
        try:
            if self._no_shm is not None:
                raise shm.ShmUnavailable(self._no_shm)
            if self.board is None and not self.advstar:
                try:
                    self.board = shm.WeightBoard.create(shm.new_token(), self.id, self.numel)
                except (shm.ShmUnavailable, OSError) as exc:
                    self._no_shm = f"no weight board: {exc}"
                    raise
                if self.welcome is not None:
                    self.board.publish(self.ts, self.weights)
            self.slots[learner] = shm.GradientSlots.attach(token, self.id, learner, self.numel)
            log.info("tree node %d: learner %d trades through shared memory", self.id, learner)
        except (shm.ShmUnavailable, OSError, ValueError) as exc:
            log.warning("tree node %d: learner %d stays on ZeroMQ payloads: %s", self.id,
                        learner, exc)

    def _gradient(self, ident: bytes, msg: wire.Message) -> None:
        is_node = wire.node_id(msg.sender) is not None
        if (msg.kind == Kind.RELAY) != is_node:
            raise ProtocolViolation(f"{wire.sender_name(msg.sender)} sent {msg.kind.name}; "
                                    "learners push gradients, tree nodes relay sums")
        if is_node:
            entries = msg.clock
            topology.Tree.check_clock(msg.sender, entries, self.subtrees[msg.sender])
        else:
            entries = [(msg.sender, msg.ts)]
        parts = msg.payloads
        if msg.in_shm:
            if msg.sender not in self.slots:
                raise ProtocolViolation(f"{wire.sender_name(msg.sender)} pushed from a shared-"
                                        f"memory slot, but tree node {self.id} did not map its "
                                        "slots (no usable HELLO x{shm}); send the payload")
            parts = [self.slots[msg.sender].slot(msg.fields["slot"])]
        if self.advstar:  # the learner's version came by broadcast; the root checks it
            self.clock.timestamp = max(self.clock.timestamp, max(t for _, t in entries))
        self.clock.add(entries)                  # raises before the sum is touched
        if self._sum is None:
            self._sum, self._spare = (np.empty(self.numel, np.float32) for _ in range(2))
        off = 0
        for part in parts:
            n = part.shape[0]
            if self._summed:
                kernels.accumulate(self._sum[off:off + n], part)
            else:  # the first gradient of this sum: a copy instead of zeroing, then adding
                kernels.copy_into(self._sum[off:off + n], part)
            off += n
        self._summed += len(entries)
        self.gradients += len(entries)
        self.waiting.append((ident, msg.sender, msg.kind, msg.ts))
        if msg.in_shm and self.board is not None:
            self.by_board.add(ident)
        else:
            self.by_board.discard(ident)
        if self.board is not None and not is_node:
            self._pushed.add(msg.sender)
            if self.board.owner and self._pushed >= self.spec.subtree:
                self.board.unlink()  # every learner has mapped it or never will: no name left

    # ------------------------------------------------------------------ parent
    def _maybe_relay(self) -> None:
        if self.stop_reason is not None or self._asked is not None or not self.clock.ready:
            return
        clock = self.clock.take()
        buf, self._sum, self._spare = self._sum, self._spare, self._sum
        self._summed = 0
        self.flight, self.waiting = self.waiting, []
        self.parent.send(Kind.RELAY, self.ts, wire.chunk(buf, self.chunk_bytes),
                         wait=self.hardsync, clock=[list(e) for e in clock])
        self._asked = time.time()
        self.relays += 1

    def _from_parent(self) -> None:
        kinds = ({Kind.WELCOME} if self.welcome is None else
                 {Kind.ACK} if self.advstar else {Kind.WEIGHTS, Kind.UPTODATE})
        try:
            msg = self.parent.recv(kinds, numel=self.numel)
        except transport.ServerError as exc:
            for ident, sender in self.hellos:  # the parent refused our HELLO: say why
                self._send(ident, Kind.ERROR, code=exc.code, error=str(exc))
            raise RuntimeError(f"tree node {self.id}: {exc}") from None
        self._asked = None
        if msg.kind == Kind.STOP:
            self.stop_reason = msg.fields["reason"]
            for ident, sender, *_ in self.flight + self.waiting + self.parked + self.hellos:
                self._stop(ident, sender)
            self.flight, self.waiting, self.parked, self.hellos = [], [], [], []
            return
        if msg.kind == Kind.WELCOME:
            self.welcome = dict(msg.fields)
            self.weights, self.clock.timestamp = msg.payloads, msg.ts
            if self.board is not None:
                self.board.publish(msg.ts, self.weights)
            for ident, sender in self.hellos:
                self._welcome(ident, sender)
            self.hellos = []
            return
        if msg.kind == Kind.WEIGHTS and msg.ts > self.ts:
            self.weights = msg.payloads          # zero-copy frames: never written, safe to share
            if self.board is not None:           # before any child is told to read it
                self.board.publish(msg.ts, self.weights)
        self.clock.answered(msg.ts if msg.kind in (Kind.WEIGHTS, Kind.ACK) else self.ts)
        for ident, _sender, kind, child_ts in self.flight:
            self._answer(ident, kind, child_ts)
        self.flight = []
        parked, self.parked = self.parked, []
        for ident, sender, child_ts in parked:
            if self.ts > child_ts:
                self._answer(ident, Kind.PULL, child_ts)
            else:
                self.parked.append((ident, sender, child_ts))

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event=None) -> int:
        """Serve until training is done and every learner below was told, or ``stop_event``
        is set. Blocks. Raises TimeoutError (a silent parent or silent children) or
        RuntimeError (the parent refused us) with a message naming the node and the peer."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.parent.sock, zmq.POLLIN)
        last_child = time.time()
        try:
            while not (stop_event is not None and stop_event.is_set()):
                if self.stop_reason is not None and self.stopped >= self.spec.subtree:
                    break
                events = dict(poller.poll(100))
                if self.parent.sock in events:
                    self._from_parent()
                if self.sock in events:
                    transport.drain(self.sock, self.handle)
                    last_child = time.time()
                self._maybe_relay()
                self._check_time(last_child)
                if self.stop_reason is not None and time.time() - last_child > self.timeout:
                    log.warning("training is done but learners %s never came back; exiting",
                                sorted(self.spec.subtree - self.stopped))
                    break
        finally:
            self.close()
        log.info("tree node %d: %d relays carrying %d gradients, %d refused messages",
                 self.id, self.relays, self.gradients, self.invalid)
        return 0

    def _check_time(self, last_child: float) -> None:
        now = time.time()
        if self._asked is not None and now - self._asked > self.timeout:
            raise TimeoutError(
                f"tree node {self.id}: no reply from its {self.parent.name} at "
                f"{self.parent.endpoint} within {self.timeout:.0f} s (runtime.timeout_s); is "
                "the parent running?")
        if self._asked is None and self.stop_reason is None and now - last_child > self.timeout:
            raise TimeoutError(
                f"tree node {self.id}: no message from any child for {self.timeout:.0f} s at "
                f"timestamp {self.ts} (children registered: "
                f"{[wire.sender_name(s) for s in sorted(self.identities)]}); is a child dead?")

    def close(self) -> None:
        for seg in [*self.slots.values(), *([self.board] if self.board is not None else [])]:
            seg.close()                      # the board's creator: unlinks it if still named
        self.parent.close()
        self.sock.close(linger=transport.LINGER_MS)
        if self.endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
        if self._own_ctx:
            self.ctx.term()


def serve(cfg, node_id: int, bind: str, parent: str) -> int:
    """Entry point of ``rudra-zmq node``: run one tree node until training ends."""
    node = TreeNode(cfg, node_id, bind, parent)
    print(f"{node.spec.describe()}; listening on {node.endpoint}, parent {parent}", flush=True)
    return node.serve_forever()
