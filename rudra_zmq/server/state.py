"""The parameter server's state: what a checkpoint saves and restores, and nothing else.

Weights (immutable versions), momentum and gradient sum (``update.Updater``) of the range of
the model's flat vector this server serves (``shape.Span``: the whole vector when the run has
one server), the sync engine (timestamp, pending gradients, learning-rate schedule), who registered on
which connection, the server's incarnation, who was told to stop, and counters. Pure data and
the rules that change it: no sockets, no sends. The serving role (``server/ps.py``) decodes a
message, calls one method here and sends what it returns.

Not thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

import numpy as np

from .. import codec, topology, wire
from ..results import record_fields as fields
from ..shape import Share, parts_in
from ..sync import Arrival, ProtocolViolation, Rejoin, Reply, SyncEngine
from .parts import PartedUpdates
from .update import Updater
from .versions import WeightVersions


@dataclass
class Counters:
    """What the server counts (reported to the statistics server and in logs)."""

    invalid: int = 0  # requests refused (bad wire data or a protocol violation)
    undelivered: int = 0  # replies ZeroMQ could not deliver (the peer was gone)
    sent: int = 0  # messages sent: the ``seq`` of the next header
    duplicates: int = 0  # gradients received again (a resend or a replay), not applied
    evictions: int = 0  # learners dropped for silence (runtime.learner_timeout_s)
    lost_updates: int = 0  # updates a learner had seen that the restored checkpoint lacked


COUNTERS = ("invalid", "duplicates", "evictions", "lost_updates")  # what a checkpoint keeps
ARRAYS = ("w", "v", "acc")  # weights, momentum, the gradient sum being built


_ID = 2**63  # incarnations and message seqs are random or clock-made int64s
_ENGINE = {
    "timestamp": fields.integer(),
    "gradients_received": fields.integer(),
    "updates": fields.integer(),
    "pending": fields.Field(
        "a list of [learner, timestamp, σ] of integers >= 0",
        lambda v: isinstance(v, list) and all(fields.integers().ok(p) and len(p) == 3 for p in v),
    ),
    "members": fields.integers(),
    "too_stale": fields.integer().optional(),
    "protocol": fields.Field(
        "[protocol, n, hardsync since] (a string, an integer or null, an integer or null)",
        lambda v: (
            isinstance(v, list)
            and len(v) == 3
            and isinstance(v[0], str)
            and all(x is None or fields.integer().ok(x) for x in v[1:])
        ),
    ).optional(),
}


def _by_sender(value_ok, what: str, nodes: bool = False) -> fields.Field:
    """An object whose keys are sender ids written as strings -- learners from 0 (and, with
    ``nodes``, tree nodes below 0: ``wire.node_sender``) -- each value ``value_ok``."""
    key = re.compile(r"-?\d{1,18}" if nodes else r"\d{1,18}")
    return fields.Field(
        f"an object of {'sender' if nodes else 'learner'} id -> {what}",
        lambda v: (
            isinstance(v, dict) and all(key.fullmatch(k) and value_ok(x) for k, x in v.items())
        ),
    )


def _pair(v) -> bool:
    return fields.integers().ok(v) and len(v) == 2


META_FIELDS = {
    "numel": fields.integer(1),
    "range": fields.Field(
        "[lo, hi] with 0 <= lo < hi, or stripes [[lo, hi], ...]",
        lambda v: _pair(v) or (isinstance(v, list) and bool(v) and all(_pair(p) for p in v)),
    ).optional(),  # a checkpoint from before ranges: the whole vector
    "signature": fields.text(),
    "engine": fields.mapping(),
    "incarnations": fields.integers(0, _ID),
    "applied": _by_sender(
        lambda x: (
            isinstance(x, list)
            and len(x) == 2
            and fields.integer(0, _ID).ok(x[0])
            and (x[1] is None or fields.integer().ok(x[1]))
        ),
        "[seq, σ or null]",
        nodes=True,
    ),
    "steps": _by_sender(fields.integer().ok, "an integer >= 0"),
    "done": fields.flag(),
    "counters": fields.Field(
        f"an object of counts >= 0 named {', '.join(COUNTERS)}",
        lambda v: (
            isinstance(v, dict)
            and set(v) <= set(COUNTERS)
            and all(map(fields.integer().ok, v.values()))
        ),
    ),
}


def check_meta(meta, learners: int | None = None) -> None:
    """Raise record_fields.DamagedRecord (a ValueError) naming the field and its value when a
    checkpoint's ``meta`` is not what ``snapshot`` writes (``META_FIELDS``), or names a
    learner beyond ``learners`` (λ, when given); a checkpoint that fails is damaged
    (``checkpoint.load_latest`` falls back to the one before). Pure."""
    fields.check(meta, META_FIELDS, "meta")
    engine = fields.check(meta["engine"], _ENGINE, "meta.engine")
    if learners is not None:
        ids = [("meta.engine.members", m) for m in engine["members"]]
        ids += [("meta.engine.pending", p[0]) for p in engine["pending"]]
        ids += [("meta.steps", int(k)) for k in meta["steps"]]
        for where, learner in ids:
            if learner >= learners:
                raise fields.DamagedRecord(
                    f"{where} names learner {learner}; this run has λ={learners} "
                    f"(ids 0..{learners - 1})"
                )
    key = meta.get("range")
    if key is not None:
        try:
            Share.from_key(key, meta["numel"])
        except ValueError as exc:
            raise fields.DamagedRecord(
                f"meta: range is {key}; expected [lo, hi] with lo < hi <= numel "
                f"({meta['numel']}), or such stripes in order ({exc})"
            ) from None


class ServerState:
    """One parameter server's state for the run ``cfg``, starting from ``weights``.

    Args:
        cfg: the run's Config.
        weights, segments, signature: the model's initial flat weights, their (start, stop,
            lr_mult, decay_mult) segments and the model signature learners must match.
        epoch_size: samples in one epoch (for the engine's epoch count).
        share: the share of the flat vector this server serves (``shape.Share``: a range or
            stripes; None: the whole vector). Gradients pushed to it, the weights it sends and
            its checkpoints are its local vector (the stripes end to end).
        parts: how many parts it travels in (``shape.Server.parts``); None: as
            ``shape.parts_in`` counts for its size (one server, or ranges).
    """

    def __init__(
        self,
        cfg,
        weights: np.ndarray,
        segments,
        signature: str,
        epoch_size: int,
        share: Share | None = None,
        parts: int | None = None,
    ):
        s = cfg.sync
        self.updater = Updater(weights, segments, cfg.optimizer, share)
        self.engine = SyncEngine.of(cfg, epoch_size)
        self.share = self.updater.share
        self.numel = self.updater.numel  # floats served: every payload's size
        self.model_numel = self.share.total  # the learners' model (their HELLO's numel)
        self.chunk_bytes = cfg.runtime.chunk_mib << 20  # the frames weights go out in
        self.codec = codec.for_weights(cfg)  # ... and their encoding
        self.signature = signature
        self.learners = s.learners
        self.epochs = cfg.train.epochs
        self.incarnation = secrets.randbits(62) + 1  # tells learners this server restarted
        self.incarnations = [self.incarnation]  # every incarnation of this run, oldest first
        self.restored_ts: int | None = None  # the checkpoint timestamp we started from
        self.lost_base = self.lost_now = 0  # lost updates: before / in this incarnation
        self.applied: dict[int, tuple] = {}  # sender -> (last seq, its σ; None for a HELLO)
        self.steps: dict[int, int] = {}  # learner -> gradients accepted (data step)
        self.last_heard: dict[int, float] = {}  # learner -> when it last sent anything
        self.welcomes: list = []  # HELLOs whose WELCOME the engine holds: (id, sender, seq, Reply)
        self.tree = topology.tree_of(cfg)
        self.identities: dict[int, bytes] = {}  # sender -> its connection's routing id
        self.subtrees: dict[int, frozenset] = {}  # tree node sender -> learners below it
        self.stopped: set[int] = set()  # learners told STOP (directly or below)
        self.done = False  # the last update reached train.epochs
        self.counters = Counters()
        self.log = None  # an arrival_log.ArrivalLog: the engine's events, for replay
        # hardsync in parts (server/parts.py), if the range has two or more
        p = parts_in(self.numel, cfg.wire.parts, cfg.wire.bucket_mb) if parts is None else parts
        self.parts = PartedUpdates(self.updater, self.engine, p) if p > 1 else None

    @property
    def w(self) -> np.ndarray:
        """The current weights of ``share`` (never written again: safe to send zero-copy)."""
        return self.updater.w

    def weights_for(self, sender: int) -> tuple[list[np.ndarray], dict]:
        """The current weights for ``sender``'s reply: (frames, fields); only the elements
        not sent ahead to it this round (x{at}: ``parts``), else the whole range."""
        if self.parts is None:
            return self.weight_frames(), {}
        lo, hi = self.parts.round.tail(sender, self.engine.timestamp)
        if (lo, hi) == (0, self.numel):
            return self.weight_frames(), {}
        return self.codec.encode(self.w[lo:hi], self.chunk_bytes), {"at": lo}

    def weight_frames(self) -> list[np.ndarray]:
        """The current weights as payload frames of at most ``runtime.chunk_mib`` in the run's
        codec (float32: views, no copy; half: narrowed once per version), in order: together they are
        ``share``'s local vector."""
        return self.codec.encode(self.w, self.chunk_bytes, key=self.engine.timestamp)

    @property
    def untold(self) -> set[int]:
        """Member learners not yet told STOP (an evicted one is no longer a member)."""
        return self.engine.members - self.stopped

    @property
    def all_stopped(self) -> bool:
        """Whether training is over and every member learner was told (an evicted one that
        never came back is not waited for)."""
        return self.done and not self.untold

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
            raise ProtocolViolation(
                f"{who} says HELLO as a tree node, but this server runs "
                "architecture.kind=base (is it running another config?)"
            )
        elif not 0 <= sender < self.learners:
            raise ProtocolViolation(
                f"learner id {sender} is out of range 0..{self.learners - 1} (sync.learners)"
            )
        if f["numel"] != self.model_numel or f["model"] != self.signature:
            raise ProtocolViolation(
                f"{who} runs a model with {f['numel']:,} parameters (signature "
                f"{f['model']}); this server holds {self.model_numel:,} ({self.signature}). "
                f"Is {who} running another model config?"
            )
        wanted = f.get("range", [0, self.model_numel])  # none: the whole vector
        if wanted != self.share.key:
            raise ProtocolViolation(
                f"{who} expects range {wanted} of the parameters; this server serves "
                f"{self.share}: does it run with the same number of servers, their "
                "endpoints in the order of their ranges, the same wire.parts and "
                "wire.stripes?"
            )
        self.identities[sender] = ident
        if wire.node_id(sender) is not None:
            self.subtrees[sender] = below
        # at most once: nothing sent before this HELLO may be applied any more (a late copy
        # of an old HELLO does not move the window back)
        last = self.applied.get(sender)
        if last is None or msg.seq > last[0]:
            self.applied[sender] = (msg.seq, None)
        had = f.get("had", -1)  # the newest timestamp this learner saw (a restarted PS)
        if self.restored_ts is not None and had - self.restored_ts > self.lost_now:
            self.lost_now = had - self.restored_ts
            self.counters.lost_updates = self.lost_base + self.lost_now

    def reply(self, sender: int) -> Reply:
        """When ``sender`` may have the reply to a PULL, a gradient it sent again or a HELLO
        again: the engine's word for it (for a tree node, for the learners below it). A
        hardsync sender with a gradient in the pending update waits for that update, or it
        would push twice for one timestamp. Pure."""
        return self.engine.reply(self.subtrees.get(sender) or (sender,))

    def admit(self, ident: bytes, sender: int, seq: int) -> bool:
        """A registered sender's HELLO (request ``seq``): True if it is welcomed now; else its
        WELCOME waits until the engine's ``reply`` is due (``welcomes_due``)."""
        reply = self.reply(sender)
        if self.engine.due(reply):
            return True
        self.welcomes.append((ident, sender, seq, reply))
        return False

    def welcomes_due(self) -> list[tuple[bytes, int, int]]:
        """The held HELLOs (ident, sender, seq) due now, every one once training is done (to
        be told STOP); the others stay held."""
        due = [w for w in self.welcomes if self.done or self.engine.due(w[3])]
        self.welcomes = [w for w in self.welcomes if not (self.done or self.engine.due(w[3]))]
        return [w[:3] for w in due]

    def where(self, sender: int) -> dict:
        """A sender's WELCOME fields for its data: x{step} (a learner) or x{steps} (a tree
        node: each learner below it)."""
        if sender not in self.subtrees:
            return {"step": self.steps.get(sender, 0)}
        return {"steps": [[i, self.steps.get(i, 0)] for i in sorted(self.subtrees[sender])]}

    def heard(self, sender: int, now: float) -> None:
        """``sender`` sent a request, or was answered one it waited for, at ``now``: a
        learner's silence (``silent``) starts here. Tree nodes are not watched."""
        if sender >= 0:
            self.last_heard[sender] = now

    def refused(self) -> None:
        """Count one refused request (bad wire data or a protocol violation)."""
        self.counters.invalid += 1

    def join(self, sender: int, now: float):
        """A registered learner becomes a member again (elastic λ); returns True if it was
        out (λ changed). Tree nodes are not members: the learners below them are."""
        self.last_heard[sender] = now
        if sender < 0:
            return False
        was_out = sender not in self.engine.members
        self.engine.join(sender)  # a member's HELLO too: it goes on from the current weights
        if self.log is not None:
            self.log.join(sender)
        if was_out:
            self.stopped.discard(sender)
        return was_out

    def evict(self, learner: int):
        """Stop waiting for ``learner`` (silent too long): it must say HELLO to come back.
        Returns the update its leaving completes (the caller applies it), or None."""
        self.identities.pop(learner, None)
        self.last_heard.pop(learner, None)
        self.counters.evictions += 1
        if self.log is not None:
            self.log.leave(learner)
        update = self.engine.leave(learner)
        if update is not None:
            self._apply((), 1.0, update, 0)
        return update

    def silent(
        self, now: float, timeout_s: float, waiting=(), never_by: float | None = None
    ) -> list[int]:
        """Members that sent nothing for ``timeout_s`` and are not ``waiting`` for a reply the
        server owes them (a reply the engine holds) nor, once training is done, told STOP
        (finished, not lost; one that said BYE before is evicted as usual); with ``never_by``,
        also members never heard from by that time (learners that never started). Pure."""
        late = never_by is not None and now > never_by
        quiet = (
            i
            for i in self.engine.members
            if i not in waiting and not (self.done and i in self.stopped)
        )
        return sorted(
            i
            for i in quiet
            if (now - self.last_heard[i] > timeout_s if i in self.last_heard else late)
        )

    def is_sent_before(self, msg: wire.Message) -> bool:
        """Whether ``msg`` belongs to a request this sender sent before its last one applied
        (a part resent with its request). Pure."""
        last = self.applied.get(msg.sender)
        return last is not None and msg.seq <= last[0]

    def is_duplicate(self, msg: wire.Message) -> bool:
        """Whether a gradient was applied already (a resend of the last one: answer it as
        before, apply nothing). Raises ProtocolViolation for anything older (a replay)."""
        last = self.applied.get(msg.sender)
        if last is None or msg.seq > last[0]:
            return False
        self.counters.duplicates += 1
        if msg.seq == last[0] and last[1] is not None:
            return True
        raise ProtocolViolation(
            f"{wire.sender_name(msg.sender)} sent sequence number "
            f"{msg.seq}, not newer than the {last[0]} it sent before (a "
            "replayed message): refused"
        )

    def check_sender(self, ident: bytes, msg: wire.Message) -> None:
        """Raise ProtocolViolation unless ``msg`` comes from a registered sender on its own
        connection, for this incarnation, of a kind its role may send."""
        who = wire.sender_name(msg.sender)
        if msg.inc not in (0, self.incarnation):  # 0: a client that never heard from us
            raise Rejoin(
                f"{who} talks to server incarnation {msg.inc}, this is "
                f"{self.incarnation} (the server restarted): say HELLO again"
            )
        if self.identities.get(msg.sender) != ident:
            raise Rejoin(f"{who} has not said HELLO on this connection (or was evicted)")
        is_node = msg.sender in self.subtrees
        if msg.kind == wire.Kind.RELAY and not is_node:
            raise ProtocolViolation(f"{who} sent RELAY; only tree nodes relay gradient sums")
        if msg.kind in (wire.Kind.PUSH, wire.Kind.PUSHPULL) and is_node:
            raise ProtocolViolation(
                f"{who} sent {msg.kind.name}; tree nodes send their gradient sums as RELAY"
            )
        if msg.kind == wire.Kind.RELAY:
            topology.Tree.check_clock(msg.sender, msg.clock, self.subtrees[msg.sender])

    def push(self, msg: wire.Message) -> Arrival:
        """Account and apply one learner's gradient (PUSH/PUSHPULL). Returns the engine's
        ``sync.Arrival``: σ, the update it completed (applied) or None, and when the sender
        may have its reply. Raises ProtocolViolation before touching any weights. Does not
        block beyond the kernels."""
        if self.parts is not None:
            raise ProtocolViolation(
                f"{wire.sender_name(msg.sender)} sent a whole gradient; this server takes "
                f"them in wire.parts={self.parts.round.parts} parts: is it running another "
                "config?"
            )
        return self._arrived(msg, msg.payloads)

    def push_part(self, msg: wire.Message) -> Arrival | None:
        """Account one part of a learner's gradient (PUSHPULL x{at, more}, ``parts``):
        summed; the last, with every part before it in, is the gradient's arrival (returns
        as ``push``), else None. Raises ProtocolViolation before anything changes."""
        if self.parts is None:
            raise ProtocolViolation(
                f"{wire.sender_name(msg.sender)} sent a gradient in parts; this server takes "
                "whole ones (wire.parts=1): is it running another config?"
            )
        self.engine.check(msg.sender, msg.ts)
        f = msg.fields
        if not self.parts.take(
            msg.sender, msg.seq, f.get("at", 0), msg.payloads, "more" in f, msg.payload_numel
        ):
            return None
        return self._arrived(msg, ())

    def parts_ahead(self) -> list:
        """Step the parts every member has sent (``PartedUpdates.ahead``); [] without parts."""
        return self.parts.ahead() if self.parts is not None else []

    def _arrived(self, msg: wire.Message, payloads) -> Arrival:
        arrival = self.engine.receive(msg.sender, msg.ts)
        step = self.steps.get(msg.sender, 0)  # the learner's minibatch of this gradient
        if self.log is not None:
            self.log.gradient(msg.sender, msg.ts, step)
        self._apply(payloads, arrival.scale, arrival.update, 1)
        self.applied[msg.sender] = (msg.seq, arrival.sigma)
        self.steps[msg.sender] = step + 1
        return arrival

    def relay(self, msg: wire.Message) -> Arrival:
        """Account and apply a tree node's RELAY (the sum of the gradients its clock lists);
        returns and raises as ``push``."""
        entries = msg.clock  # checked against the tree by check_sender
        arrival = self.engine.receive_many(entries)
        self._apply(msg.payloads, 1.0, arrival.update, len(entries))
        self.applied[msg.sender] = (msg.seq, arrival.sigma)
        for learner, _ in entries:
            self.steps[learner] = self.steps.get(learner, 0) + 1
        return arrival

    def _apply(self, payloads, scale: float, update, count: int) -> None:
        if self.parts is not None:  # the parts are in the sum already
            if update is not None:
                self.parts.finish(update)
        elif payloads or update is not None:
            self.updater.receive(payloads, scale, update, count)
        if update is not None and update.epoch >= self.epochs:
            self.done = True

    def mark_stopped(self, sender: int) -> None:
        """``sender`` was told STOP or said BYE: a tree node passes it to every learner below."""
        self.stopped |= self.tree.below(sender) if self.tree else {sender}

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> tuple[dict, dict]:
        """(arrays, meta): everything a restarted server needs, for ``checkpoint.save``. The
        arrays are the live buffers of ``share`` (no copy): save them before the next update;
        meta ``numel`` is the model's size and ``range`` the share's key ([lo, hi], or
        [[lo, hi], ...] for stripes: ``shape.Share.key``). Pure."""
        u, c = self.updater, self.counters
        meta = {
            "numel": self.model_numel,
            "range": self.share.key,
            "signature": self.signature,
            "engine": self.engine.state_dict(),
            "incarnations": self.incarnations,
            "applied": {str(k): list(v) for k, v in self.applied.items()},
            "steps": {str(k): v for k, v in self.steps.items()},
            "done": self.done,
            "counters": {name: getattr(c, name) for name in COUNTERS},
        }
        return dict(zip(ARRAYS, (u.w, u.v, u.acc), strict=True)), meta

    def restore(self, arrays: dict, meta: dict) -> None:
        """Continue from a ``snapshot`` (a checkpoint), as a new incarnation: every learner
        must say HELLO again. A checkpoint without a ``range`` (written before servers had
        ranges) holds the whole vector. Raises ValueError if the checkpoint holds another
        model or another range of it."""
        if meta["numel"] != self.model_numel or meta["signature"] != self.signature:
            raise ValueError(
                f"the checkpoint holds a model of {meta['numel']:,} parameters "
                f"({meta['signature']}); this run's model has "
                f"{self.model_numel:,} ({self.signature}): was the model config "
                "changed?"
            )
        saved = Share.from_key(meta.get("range"), meta["numel"])
        if saved != self.share:
            raise ValueError(
                f"the checkpoint holds range {saved} of the model's parameters; "
                f"this server serves range {self.share}: restore each server from "
                "its own range's checkpoints (was the number of servers changed? "
                "checkpoints written before stripes restore with wire.stripes=false)"
            )
        for name in ARRAYS:
            if arrays[name].shape != (self.numel,) or arrays[name].dtype != np.float32:
                raise ValueError(
                    f"checkpoint array {name!r} is {arrays[name].dtype} "
                    f"{arrays[name].shape}, expected float32 ({self.numel},)"
                )
        u = self.updater
        u.versions = WeightVersions(np.ascontiguousarray(arrays["w"]))
        u.v[:] = arrays["v"]
        u.acc[:] = arrays["acc"]
        self.engine.load_state(meta["engine"])
        self.incarnations = [int(i) for i in meta["incarnations"]] + [self.incarnation]
        self.applied = {
            int(k): (int(v[0]), None if v[1] is None else int(v[1]))
            for k, v in meta["applied"].items()
        }
        self.steps = {int(k): int(v) for k, v in meta["steps"].items()}
        # every learner says HELLO again (and is told STOP then, if training is over); a run
        # resumed with more train.epochs goes on
        self.stopped = set()
        self.done = self.engine.epoch >= self.epochs
        for k, v in meta["counters"].items():
            setattr(self.counters, k, int(v))
        self.restored_ts = self.engine.timestamp
        self.lost_base, self.lost_now = self.counters.lost_updates, 0
