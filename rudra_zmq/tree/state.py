"""A Rudra-adv tree node's state: what a checkpoint of the node would hold.

The sum of the children's gradients being built and the one in flight to the parent, the
vector clock of each (``relay_clock.RelayClock``), who waits for which relay, the parent's newest
weights (its received frames, never written), registrations, incarnation, who was told to
stop, and counters. Pure data and the rules that change it: no sockets, no sends
(``tree/node.py`` does the talking, and changes this state only through its methods).

Not thread-safe: owned by the tree node's thread.
"""

from __future__ import annotations

import secrets

import numpy as np

from .. import codec, topology, wire
from ..shape import ClusterShape
from ..sync import ProtocolViolation, Rejoin
from ..sync.relay_clock import RelayClock
from ..typed_yaml import ConfigError


class NodeState:
    """Tree node ``node_id`` of the tree of server ``server``'s range (``shape.ClusterShape``:
    one tree per range, each relaying only its range; one server's tree relays the whole
    vector). Raises ValueError for a server the shape does not have."""

    def __init__(self, cfg, node_id: int, server: int = 0):
        self.shape = ClusterShape.of(cfg)
        self.place = self.shape.server(server)  # its range once the first child says the size
        self.tree = topology.plan(cfg)
        self.spec = self.tree.node(node_id)
        self.id = node_id
        self.advstar = cfg.architecture.kind == "advstar"
        self.clock = RelayClock(
            cfg.sync.protocol, self.spec.subtree, gather=cfg.architecture.relay == "gather"
        )
        self.incarnation = secrets.randbits(62) + 1
        self.numel: int | None = None  # floats relayed: the range's (first child's HELLO)
        self.model_numel: int | None = None  # the model's (the same HELLO)
        self.range: list[int] | None = None  # [lo, hi]: its range (the first child's HELLO)
        self.signature: str | None = None
        self.welcome: dict | None = None  # the parent's WELCOME fields, once it answered
        self.weights: list = []  # the newest weights (parent's frames, read-only)
        self.identities: dict[int, bytes] = {}
        self.subtrees: dict[int, frozenset] = {}
        # Who waits for what; each entry ends with the request's seq (replies echo it, x{re})
        self.hellos: list[tuple[bytes, int, int]] = []  # waiting for the parent's WELCOME
        self.waiting: list[tuple[bytes, int, wire.Kind, int, int]] = []  # in the pending sum
        self.flight: list[tuple[bytes, int, wire.Kind, int, int]] = []  # in the relay in flight
        self.parked: list = []  # PULLs the clock holds: (id, sender, its Reply, ts, seq)
        self.rejoins: list[tuple[bytes, int, int]] = []  # HELLOs of children held above
        self.seqs: dict[int, int] = {}  # child -> seq of its last gradient (at most once)
        self.steps: dict[int, int] = {}  # learner below -> its data step (parent's + ours)
        self._sum = self._spare = None  # the sum being built / the one in flight
        self._summed = 0  # gradients in _sum
        self.stop_reason: str | None = None
        self.stopped: set[int] = set()
        self.relays = self.gradients = self.invalid = 0

    @property
    def ts(self) -> int:
        """The newest weights timestamp this node holds (-1 before the parent's WELCOME)."""
        return self.clock.timestamp

    @property
    def done(self) -> bool:
        """Whether the parent said STOP (training is over): every request is answered STOP."""
        return self.stop_reason is not None

    @property
    def finished(self) -> bool:
        """Whether the parent said STOP and every learner below was told."""
        return self.stop_reason is not None and self.stopped >= self.spec.subtree

    def register(self, ident: bytes, msg: wire.Message) -> bool:
        """Accept a child's HELLO (checked against the planned tree and the model of the first
        child). Returns True for the first child: the node must then say HELLO upstream.
        Raises ProtocolViolation (nothing changed) otherwise."""
        f, who = msg.fields, wire.sender_name(msg.sender)
        below = self.tree.check_child(self.id, msg.sender, f.get("subtree"))
        first = self.signature is None
        if not first and (f["model"], f["numel"]) != (self.signature, self.model_numel):
            raise ProtocolViolation(
                f"{who} runs a model with {f['numel']:,} parameters (signature {f['model']}); "
                f"tree node {self.id} relays {self.model_numel:,} ({self.signature}). Is {who} "
                "running another model config?"
            )
        place = self.place
        if first:  # the model's size is the first child's: the plan gives this node's range in it
            try:
                place = self.shape.sized(f["numel"]).server(place.index)
            except ConfigError as exc:  # more servers than the model has parameters
                raise ProtocolViolation(f"{who}: {exc}") from None
        wanted, mine = f.get("range"), place.share.key
        if (wanted or [0, f["numel"]]) != mine:  # none: the whole vector
            raise ProtocolViolation(
                f"{who} sends range {wanted} of the parameters; tree node {self.id} relays "
                f"range {mine} (server {place.index}): does it run with the same "
                "architecture.servers, its leaves in range order?"
            )
        if first:
            self.place, self.range, self.numel = place, mine, place.share.numel
            self.signature, self.model_numel = f["model"], f["numel"]
        self.identities[msg.sender] = ident
        self.subtrees[msg.sender] = below
        return first

    def refused(self) -> None:
        """Count one refused request (bad wire data or a protocol violation)."""
        self.invalid += 1

    def check_sender(self, ident: bytes, msg: wire.Message) -> None:
        """Raise ProtocolViolation unless ``msg`` comes from a registered child on its own
        connection, for this incarnation."""
        if self.identities.get(msg.sender) != ident or msg.inc not in (0, self.incarnation):
            raise Rejoin(
                f"{wire.sender_name(msg.sender)} has not said HELLO to tree node "
                f"{self.id} on this connection (did the node restart?)"
            )

    def is_duplicate(self, ident: bytes, msg: wire.Message) -> bool:
        """Whether a gradient is the child's last one sent again (its reply now goes to
        ``ident``). Raises ProtocolViolation for an older one (a replay)."""
        last = self.seqs.get(msg.sender)
        if last is None or msg.seq > last:
            return False
        if msg.seq < last:
            raise ProtocolViolation(
                f"{wire.sender_name(msg.sender)} sent sequence number "
                f"{msg.seq}, older than its last {last} (a replay)"
            )
        for queue in (self.waiting, self.flight):
            queue[:] = [(ident, *e[1:]) if e[1] == msg.sender else e for e in queue]
        return True

    def admit(self, ident: bytes, sender: int, seq: int) -> bool:
        """A registered child's HELLO (request ``seq``): True if it is welcomed now; else it
        waits for the parent's WELCOME (``welcomed``) or, restarted while its old gradient is
        held above, for that relay's answer (``rejoins_due``)."""
        if self.welcome is None:
            self.hellos.append((ident, sender, seq))
        elif self.held(sender):
            self.rejoins.append((ident, sender, seq))
        else:
            return True
        return False

    def park(self, ident: bytes, msg: wire.Message, reply) -> None:
        """A PULL the clock holds (``reply``, from ``clock.reply``, not due yet): released by
        ``pulls_due`` once the clock says (or told STOP)."""
        self.parked.append((ident, msg.sender, reply, msg.ts, msg.seq))

    def held(self, sender: int) -> bool:
        """Whether ``sender``'s gradient is in the pending sum or the relay in flight."""
        return any(e[1] == sender for e in self.waiting + self.flight)

    def entries(self, msg: wire.Message) -> list[tuple[int, int]]:
        """The (learner, gradient timestamp) pairs a gradient message carries (checked)."""
        is_node = wire.node_id(msg.sender) is not None
        if (msg.kind == wire.Kind.RELAY) != is_node:
            raise ProtocolViolation(
                f"{wire.sender_name(msg.sender)} sent {msg.kind.name}; "
                "learners push gradients, tree nodes relay sums"
            )
        if not is_node:
            return [(msg.sender, msg.ts)]
        topology.Tree.check_clock(msg.sender, msg.clock, self.subtrees[msg.sender])
        return msg.clock

    def add(self, ident: bytes, msg: wire.Message, entries, pieces) -> None:
        """Add a child's gradient (contiguous ``pieces``: frames of any model dtype, or a
        float32 shared slot) to the pending sum. Raises ProtocolViolation before the sum is
        touched. Does not block beyond the kernels."""
        if self.advstar:  # the learner's version came by broadcast; the root checks it
            self.clock.timestamp = max(self.clock.timestamp, max(t for _, t in entries))
        self.clock.add(entries)
        if self._sum is None:
            self._sum, self._spare = (np.empty(self.numel, np.float32) for _ in range(2))
        if self._summed:
            codec.add(self._sum, pieces)
        else:  # the first gradient of this sum: a copy instead of zeroing, then adding
            codec.load(self._sum, pieces)
        self._summed += len(entries)
        self.gradients += len(entries)
        for learner, _ in entries:
            self.steps[learner] = self.steps.get(learner, 0) + 1
        self.waiting.append((ident, msg.sender, msg.kind, msg.ts, msg.seq))
        self.seqs[msg.sender] = msg.seq

    def welcomed(self, fields: dict, weights: list, ts: int) -> list:
        """The parent's WELCOME x``fields`` with ``weights`` of ``ts``: keep what children are
        welcomed with and, from x{steps}, each learner's data step (entries that are not
        [learner below, step >= 0] are ignored). Returns the HELLOs that waited for it
        (ident, sender, seq), to be welcomed now."""
        self.welcome = {k: fields[k] for k in ("learners", "protocol")}
        for e in fields.get("steps", ()):
            if (
                isinstance(e, list)
                and len(e) == 2
                and all(type(v) is int for v in e)
                and e[0] in self.spec.subtree
                and e[1] >= 0
            ):
                self.steps[e[0]] = e[1]
        self.weights, self.clock.timestamp = weights, ts
        hellos, self.hellos = self.hellos, []
        return hellos

    def where(self, child: int) -> dict:
        """A child's WELCOME fields for its data: x{step} (a learner) or x{steps} (a node)."""
        if child in self.subtrees and wire.node_id(child) is not None:
            return {"steps": [[i, self.steps.get(i, 0)] for i in sorted(self.subtrees[child])]}
        return {"step": self.steps.get(child, 0)}

    def take_relay(self):
        """(sum buffer, clock) to relay now, or None. The buffer stays untouched until the
        parent answers (ZeroMQ may still read it)."""
        if self.stop_reason is not None or not self.clock.ready:
            return None
        clock = self.clock.take()
        buf, self._sum, self._spare = self._sum, self._spare, self._sum
        self._summed = 0
        self.flight, self.waiting = self.waiting, []
        self.relays += 1
        return buf, clock

    def answered(self, ts: int, weights=None) -> list:
        """The parent answered the relay in flight with ``weights`` of ``ts`` (None: no new
        weights). Returns the children that relay carried, to be answered."""
        if weights is not None and ts > self.ts:
            self.weights = weights
        self.clock.answered(ts)
        flight, self.flight = self.flight, []
        return flight

    def rejoins_due(self) -> list:
        """The restarted children (ident, sender, seq) whose old gradient has been answered:
        to be welcomed now; the others keep waiting."""
        due = [r for r in self.rejoins if not self.held(r[1])]
        self.rejoins = [r for r in self.rejoins if self.held(r[1])]
        return due

    def pulls_due(self) -> list:
        """The parked pulls (ident, sender, child's ts, seq) the clock now lets go: to be
        answered now; the others stay parked."""
        due = [p for p in self.parked if self.clock.due(p[2])]
        self.parked = [p for p in self.parked if not self.clock.due(p[2])]
        return [(ident, sender, ts, seq) for ident, sender, _, ts, seq in due]

    def stop(self, reason: str) -> list:
        """The parent said STOP: returns every child waiting for anything (to be told)."""
        self.stop_reason = reason
        told = self.flight + self.waiting + self.parked + self.hellos + self.rejoins
        self.flight, self.waiting, self.parked, self.hellos, self.rejoins = [], [], [], [], []
        return told

    def mark_stopped(self, sender: int) -> None:
        """``sender`` was told STOP or said BYE (for a tree node: every learner below it)."""
        self.stopped |= self.tree.below(sender)
