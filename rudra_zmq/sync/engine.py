"""The sync engine (``rudra_zmq.sync``): what each gradient arrival does to the protocol's
state -- σ, the update it completes, when its sender may have its reply. Pure logic, no
sockets, threads or clocks; not thread-safe (one owner drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .decisions import Arrival, Update
from .rules import (
    NOW,
    LRSchedule,
    ProtocolViolation,
    Rejoin,
    Reply,
    TooStale,
    barrier,
    check_protocol,
    gradients_per_update,
    protocol_label,
)
from .stages import Stages, parse_schedule


@dataclass
class SyncEngine:
    """Decides when the PS updates, with which gradients and at which learning rate.

    Args:
        protocol: ``hardsync``, ``softsync`` or ``async``.
        n_learners: λ.
        lr: the learning-rate schedule and policy.
        n: the n of n-softsync (ignored by hardsync and async).
        batch_size: µ, samples per gradient (to count epochs).
        epoch_size: samples per epoch (to count epochs); 0 leaves the epoch at 0.
        timestamp: the starting weights timestamp.
        max_staleness: s, the bound on σ (bounded staleness); None for none.

    Membership (elastic λ): ``members`` are the learners the protocol waits for, all λ at
    start. :meth:`leave` drops one (an evicted or departed learner: c is recomputed from the
    members alive, hardsync's barrier no longer waits for it), :meth:`join` takes one back; its
    gradients are refused (:class:`Rejoin`) while it is out. ``state_dict``/``load_state``
    are what a checkpoint keeps. ``too_stale`` counts the gradients refused for σ > s.

    Not thread-safe; performs no I/O and never blocks.
    """

    protocol: str
    n_learners: int
    lr: LRSchedule
    n: int = 1
    batch_size: int = 1
    epoch_size: int = 0
    timestamp: int = 0
    gradients_received: int = 0
    updates: int = 0
    _pending: list = field(default_factory=list, repr=False)
    _pending_learners: set = field(default_factory=set, repr=False)
    members: set = None
    max_staleness: int | None = None
    too_stale: int = 0
    schedule: tuple = ()  # stages.Stage: protocols by epoch
    target_staleness: float | None = None  # the ⟨σ⟩ an adaptive n holds
    # bounded staleness: per member, the oldest timestamp its next gradient can carry
    _computing_on: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg, epoch_size: int = 0) -> SyncEngine:
        """The engine a run's config (``cfg.sync``, ``cfg.optimizer``) asks for: the one place
        a protocol's parameters go from the config into the engine. Pure."""
        s, o = cfg.sync, cfg.optimizer
        return cls(
            s.protocol,
            s.learners,
            LRSchedule(o.lr, o.lr_policy, tuple(o.lr_steps), o.lr_gamma),
            n=s.n,
            batch_size=s.batch_size,
            epoch_size=epoch_size,
            max_staleness=s.max_staleness,
            schedule=parse_schedule(s.schedule, s.learners),
            target_staleness=s.target_staleness,
        )

    def __post_init__(self):
        check_protocol(self.protocol, self.n, self.n_learners, max_staleness=self.max_staleness)
        if self.members is None:
            self.members = set(range(self.n_learners))
        self._computing_on = dict.fromkeys(self.members, self.timestamp)
        dynamic = self.schedule or self.target_staleness is not None
        self._stages = Stages(self.schedule, self.target_staleness) if dynamic else None
        self._hardsync_since: int | None = None  # a schedule switched to hardsync here
        if self.batch_size < 1 or self.epoch_size < 0:
            raise ValueError(
                f"batch_size must be >= 1 and epoch_size >= 0, got {self.batch_size}, "
                f"{self.epoch_size}"
            )

    @property
    def gradients_per_update(self) -> int:
        """c for the members alive (see :func:`gradients_per_update`)."""
        return gradients_per_update(self.protocol, self.n, len(self.members))

    def leave(self, learner: int) -> Update | None:
        """``learner`` is no longer waited for (dead, hung, or gone). Gradients it already
        sent stay in the pending sum. Returns the update its leaving completes (hardsync's
        barrier, or a smaller softsync c), which the caller must apply, or None."""
        self.members.discard(learner)
        self._computing_on.pop(learner, None)
        if self._update_due():
            return self._make_update()
        return None

    def join(self, learner: int) -> None:
        """``learner`` is waited for again (from the next gradient it sends), or, a member
        already, goes on from the current weights (its HELLO after a refusal)."""
        if not 0 <= learner < self.n_learners:
            raise ProtocolViolation(
                f"learner id {learner} is out of range 0..{self.n_learners - 1} (sync.learners)"
            )
        self.members.add(learner)
        self._computing_on[learner] = self.timestamp  # it is welcomed with these weights

    def state_dict(self) -> dict:
        """The engine's state as plain JSON-able values (for a checkpoint). Pure."""
        return {
            "timestamp": self.timestamp,
            "gradients_received": self.gradients_received,
            "updates": self.updates,
            "pending": [list(p) for p in self._pending],
            "members": sorted(self.members),
            "too_stale": self.too_stale,
            "protocol": [self.protocol, self.n, self._hardsync_since],
        }

    def load_state(self, d: dict) -> None:
        """Restore what ``state_dict`` returned (the schedule comes from the config)."""
        self.timestamp, self.updates = int(d["timestamp"]), int(d["updates"])
        self.gradients_received = int(d["gradients_received"])
        self._pending = [tuple(int(v) for v in p) for p in d["pending"]]
        self._pending_learners = {p[0] for p in self._pending}
        self.members = {int(m) for m in d["members"]}
        self.too_stale = int(d.get("too_stale", 0))
        if "protocol" in d:  # where a schedule or an adaptive n had taken it
            self.protocol, self.n, self._hardsync_since = d["protocol"]
        # what learners computed on before the restart is not known: they rejoin, and a
        # gradient from before it that is too stale is refused (TooStale)
        self._computing_on = dict.fromkeys(self.members, self.timestamp)

    @property
    def epoch(self) -> float:
        """Epochs of data consumed by the gradients received so far."""
        return self.epoch_at(self.gradients_received)

    def epoch_at(self, gradients: int) -> float:
        """Epochs of data consumed once ``gradients`` gradients have been received (0 without
        an epoch size). Pure."""
        if not self.epoch_size:
            return 0.0
        return gradients * self.batch_size / self.epoch_size

    @property
    def pending(self) -> int:
        """Gradients summed since the last update."""
        return len(self._pending)

    @property
    def pending_learners(self) -> frozenset:
        """The learners whose gradients are summed since the last update."""
        return frozenset(self._pending_learners)

    def check(self, learner: int, grad_ts: int) -> None:
        """Raise :class:`ProtocolViolation` if ``receive`` would refuse this gradient."""
        if not 0 <= learner < self.n_learners:
            raise ProtocolViolation(
                f"learner id {learner} is out of range: this run has λ={self.n_learners} "
                f"learners (ids 0..{self.n_learners - 1})"
            )
        if learner not in self.members:
            raise Rejoin(
                f"learner {learner} is not a member any more (it was silent for too "
                "long, or left): say HELLO again to rejoin at the current weights"
            )
        if grad_ts > self.timestamp:
            raise ProtocolViolation(
                f"learner {learner} pushed a gradient with timestamp {grad_ts}, newer than the "
                f"server's {self.timestamp} (is it talking to a restarted server?)"
            )
        if grad_ts < 0:
            raise ProtocolViolation(f"learner {learner} sent a negative timestamp {grad_ts}")
        s = self.max_staleness
        if s is not None and self.timestamp - grad_ts > s:
            raise TooStale(
                f"learner {learner} pushed a gradient of timestamp {grad_ts} at the server's "
                f"{self.timestamp}: σ = {self.timestamp - grad_ts} > sync.max_staleness={s}; "
                "refused, not applied: say HELLO again to go on from the current weights"
            )
        if barrier(self.protocol):
            since = self._hardsync_since
            if grad_ts != self.timestamp and since is not None and grad_ts < since:
                raise Rejoin(
                    f"learner {learner} pushed a gradient of timestamp {grad_ts}, computed "
                    f"before sync.schedule switched to hardsync at {since}: say HELLO again"
                )
            if grad_ts != self.timestamp:
                raise ProtocolViolation(
                    f"hardsync: learner {learner} pushed a gradient of timestamp {grad_ts} but "
                    f"the server is at {self.timestamp}; hardsync learners must pull the new "
                    "weights before computing the next gradient"
                )
            if learner in self._pending_learners:
                raise ProtocolViolation(
                    f"hardsync: learner {learner} pushed twice for timestamp {self.timestamp}; "
                    "each update takes exactly one gradient from every learner"
                )

    def receive(self, learner: int, grad_ts: int) -> Arrival:
        """Account one gradient; return its σ, its scale and the update it completes, if any.

        Raises :class:`ProtocolViolation` (state unchanged) for a gradient the protocol refuses.
        When an update is returned the engine's timestamp has already advanced: the caller must
        apply it before answering any pull.
        """
        try:
            self.check(learner, grad_ts)
        except TooStale:
            self.too_stale += 1
            raise
        sigma = self.timestamp - grad_ts
        scale = 1.0 / max(sigma, 1) if self.lr.policy == "per_gradient" else 1.0
        self._pending.append((learner, grad_ts, sigma))
        self._pending_learners.add(learner)
        self.gradients_received += 1
        update = self._make_update() if self._update_due(learner) else None
        reply = self.reply((learner,))
        self._computing_on[learner] = self.timestamp if reply.after is None else reply.after
        return Arrival(learner, grad_ts, sigma, scale, update, reply)

    def receive_many(self, entries) -> Arrival:
        """Account one relayed sum of several learners' gradients (Rudra-adv tree nodes).

        ``entries`` is the vector clock of the sum: one ``(learner, gradient timestamp)`` per
        gradient it contains. Each counts as one gradient toward c (c counts learner
        gradients, not relayed messages), so an update happens at the first arrival that
        brings the count to c or beyond, and averages every gradient it holds (g_scale =
        1/count). All entries are checked before any is accounted (state unchanged on
        :class:`ProtocolViolation`). The ``per_gradient`` policy is refused: its per-gradient
        scale depends on σ at the root, which the node that summed the gradients cannot know.
        The returned Arrival's ``sigma`` is the largest σ of the entries; its ``scale`` is 1.
        """
        entries = [(int(who), int(t)) for who, t in entries]
        if not entries:
            raise ProtocolViolation("a relayed gradient must contain at least one gradient")
        if self.lr.policy == "per_gradient":
            raise ProtocolViolation(
                "the per_gradient learning-rate policy needs each gradient "
                "separately; relayed sums support constant or staleness"
            )
        seen = set()
        for learner, ts in entries:
            self.check(learner, ts)
            if barrier(self.protocol) and learner in seen:
                raise ProtocolViolation(
                    f"hardsync: learner {learner} appears twice in one relayed gradient"
                )
            seen.add(learner)
        for learner, ts in entries:
            self._pending.append((learner, ts, self.timestamp - ts))
            self._pending_learners.add(learner)
        self.gradients_received += len(entries)
        sigma = max(self.timestamp - ts for _, ts in entries)
        update = self._make_update() if self._update_due() else None
        return Arrival(
            entries[0][0],
            min(t for _, t in entries),
            sigma,
            1.0,
            update,
            self.reply(learner for learner, _ in entries),
        )

    def reply(self, learners) -> Reply:
        """When a sender whose gradients come from ``learners`` (a learner's own id, or the
        learners of a tree node's relay) may have its reply, as things stand: after its
        gradient was accounted (``Arrival.reply``), or when it pulls or says HELLO again.
        hardsync, and an update that bounded staleness holds back: once the update that a
        pending gradient of theirs belongs to exists; otherwise now. Pure."""
        held = barrier(self.protocol) or self._held_back()
        if held and not self._pending_learners.isdisjoint(learners):
            return Reply(self.timestamp + 1)
        return NOW

    def _update_due(self, arriving: int | None = None) -> bool:
        """Whether the pending gradients make an update now: c of them, and (bounded
        staleness) the next timestamp no more than s past the weights of any member
        computing; ``arriving`` (the sender of the gradient just accounted) is not: it is
        answered at the new timestamp, or waits for it."""
        if not self._pending or len(self._pending) < self.gradients_per_update:
            return False
        return self._within_bound(arriving)

    def _within_bound(self, arriving: int | None = None) -> bool:
        if self.max_staleness is None:
            return True
        oldest = min(
            (t for m, t in self._computing_on.items() if m != arriving), default=self.timestamp
        )
        return self.timestamp + 1 - oldest <= self.max_staleness

    def _held_back(self) -> bool:
        """Whether c gradients are pending but bounded staleness holds their update back."""
        return (
            self.max_staleness is not None
            and len(self._pending) >= self.gradients_per_update
            and not self._within_bound()
        )

    def due(self, reply: Reply) -> bool:
        """Whether a reply the engine held may go now. Servers and the simulator ask again
        after every change of the engine's state (gradient, update, leave). Pure."""
        return reply.after is None or self.timestamp >= reply.after

    def next_lr(self) -> float:
        """The learning rate of the update that completes once every member's gradient is
        in (hardsync's round; σ = 0): what a server stepping parts ahead uses. Pure."""
        coming = len(self.members - self._pending_learners)  # ⟨σ⟩ = 0: no staleness division
        return self.lr.base_at(self.epoch_at(self.gradients_received + coming))

    def _make_update(self) -> Update:
        learners, stamps, sigmas = zip(*self._pending)
        mean_sigma = sum(sigmas) / len(sigmas)
        epoch = self.epoch
        lr = self.lr.base_at(epoch)
        if self.lr.policy == "staleness":
            lr /= max(mean_sigma, 1.0)
        self.timestamp += 1
        self.updates += 1
        update = Update(
            self.timestamp,
            learners,
            stamps,
            sigmas,
            mean_sigma,
            lr,
            1.0 / len(sigmas),
            epoch,
            protocol_label(self.protocol, self.n) if self._stages else None,
        )
        self._pending.clear()
        self._pending_learners.clear()
        if self._stages is not None:
            change = self._stages.after(update, self.protocol, self.n, self.n_learners)
            if change is not None:  # nothing is pending: the next gradient is under it
                if barrier(change[0]) and not barrier(self.protocol):
                    self._hardsync_since = self.timestamp
                self.protocol, self.n = change
        return update
