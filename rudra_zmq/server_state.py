"""The parameter server's state: what a checkpoint saves and restores, and nothing else.

Weights (immutable versions), momentum and gradient sum (``update.Updater``), the sync engine
(timestamp, pending gradients, learning-rate schedule), who registered on which connection,
the server's incarnation, who was told to stop, and counters. Pure data and the rules that
change it: no sockets, no sends. The serving role (``roles/ps.py``) decodes a message, calls
one method here and sends what it returns.

Not thread-safe: owned by the parameter server's thread.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from . import topology, wire
from .sync import LRSchedule, ProtocolViolation, SyncEngine
from .update import Updater


@dataclass
class Counters:
    """What the server counts (reported to the statistics server and in logs)."""

    invalid: int = 0        # requests refused (bad wire data or a protocol violation)
    undelivered: int = 0    # replies ZeroMQ could not deliver (the peer was gone)
    sent: int = 0           # messages sent: the ``seq`` of the next header


class ServerState:
    """One parameter server's state for the run ``cfg``, starting from ``weights``.

    Args:
        cfg: the run's Config.
        weights, segments, signature: the initial flat weights, their (start, stop, lr_mult,
            decay_mult) segments and the model signature learners must match.
        epoch_size: samples in one epoch (for the engine's epoch count).
    """

    def __init__(self, cfg, weights: np.ndarray, segments, signature: str, epoch_size: int):
        s, o = cfg.sync, cfg.optimizer
        self.updater = Updater(weights, segments, o)
        self.engine = SyncEngine(
            s.protocol, s.learners, LRSchedule(o.lr, o.lr_policy, tuple(o.lr_steps), o.lr_gamma),
            n=s.n, batch_size=s.batch_size, epoch_size=epoch_size)
        self.numel = self.updater.numel
        self.chunk_bytes = cfg.runtime.chunk_mib << 20   # the frames weights go out in
        self.signature = signature
        self.learners = s.learners
        self.epochs = cfg.train.epochs
        self.incarnation = secrets.randbits(62) + 1   # tells learners this server restarted
        self.tree = topology.plan(cfg) if cfg.architecture.kind != "base" else None
        self.identities: dict[int, bytes] = {}        # sender -> its connection's routing id
        self.subtrees: dict[int, frozenset] = {}      # tree node sender -> learners below it
        self.stopped: set[int] = set()                # learners told STOP (directly or below)
        self.done = False                             # the last update reached train.epochs
        self.counters = Counters()

    @property
    def w(self) -> np.ndarray:
        """The current weights (never written again: safe to send zero-copy)."""
        return self.updater.w

    def weight_frames(self) -> list[np.ndarray]:
        """The current weights as payload frames of at most ``runtime.chunk_mib`` (views, no
        copy)."""
        return wire.chunk(self.w, self.chunk_bytes)

    @property
    def all_stopped(self) -> bool:
        """Whether training is over and every learner was told."""
        return self.done and self.stopped >= set(range(self.learners))

    def register(self, ident: bytes, msg: wire.Message) -> None:
        """Accept a HELLO from ``msg.sender`` on connection ``ident``: it must be a learner or
        tree node this run plans, with this server's model. Raises ProtocolViolation (nothing
        changed) otherwise."""
        sender, f = msg.sender, msg.fields
        who = wire.sender_name(sender)
        below = None
        if self.tree is not None:
            below = self.tree.check_child(None, sender, f.get("subtree"))
        elif wire.node_id(sender) is not None or "subtree" in f:
            raise ProtocolViolation(f"{who} says HELLO as a tree node, but this server runs "
                                    "architecture.kind=base (is it running another config?)")
        elif not 0 <= sender < self.learners:
            raise ProtocolViolation(f"learner id {sender} is out of range 0.."
                                    f"{self.learners - 1} (sync.learners)")
        if f["numel"] != self.numel or f["model"] != self.signature:
            raise ProtocolViolation(
                f"{who} runs a model with {f['numel']:,} parameters (signature "
                f"{f['model']}); this server holds {self.numel:,} ({self.signature}). Is "
                f"{who} running another model config?")
        self.identities[sender] = ident
        if wire.node_id(sender) is not None:
            self.subtrees[sender] = below

    def check_sender(self, ident: bytes, msg: wire.Message) -> None:
        """Raise ProtocolViolation unless ``msg`` comes from a registered sender on its own
        connection, for this incarnation, of a kind its role may send."""
        who = wire.sender_name(msg.sender)
        if self.identities.get(msg.sender) != ident:
            raise ProtocolViolation(f"{who} has not said HELLO on this connection")
        if msg.inc not in (0, self.incarnation):
            raise ProtocolViolation(f"{who} talks to server incarnation {msg.inc}, this is "
                                    f"{self.incarnation} (the server restarted): say HELLO again")
        is_node = msg.sender in self.subtrees
        if msg.kind == wire.Kind.RELAY and not is_node:
            raise ProtocolViolation(f"{who} sent RELAY; only tree nodes relay gradient sums")
        if msg.kind in (wire.Kind.PUSH, wire.Kind.PUSHPULL) and is_node:
            raise ProtocolViolation(f"{who} sent {msg.kind.name}; tree nodes send their "
                                    "gradient sums as RELAY")

    def push(self, msg: wire.Message):
        """Account and apply one learner's gradient (PUSH/PUSHPULL). Returns (σ, the
        ``sync.Update`` it completed or None). Raises ProtocolViolation before touching any
        weights. Does not block beyond the kernels."""
        arrival = self.engine.receive(msg.sender, msg.ts)
        self._apply(msg.payloads, arrival.scale, arrival.update, 1)
        return arrival.sigma, arrival.update

    def relay(self, msg: wire.Message):
        """Account and apply a tree node's RELAY (the sum of the gradients its clock lists);
        returns and raises as ``push``."""
        entries = msg.clock
        topology.Tree.check_clock(msg.sender, entries, self.subtrees[msg.sender])
        arrival = self.engine.receive_many(entries)
        self._apply(msg.payloads, 1.0, arrival.update, len(entries))
        return arrival.sigma, arrival.update

    def _apply(self, payloads, scale: float, update, count: int) -> None:
        self.updater.receive(payloads, scale, update, count)
        if update is not None and update.epoch >= self.epochs:
            self.done = True

    def mark_stopped(self, sender: int) -> None:
        """``sender`` was told STOP or said BYE: a tree node passes it to every learner below."""
        self.stopped |= self.tree.below(sender) if self.tree else {sender}
