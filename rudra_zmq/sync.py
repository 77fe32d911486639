"""The synchronization protocol engine: pure logic, no sockets, threads or clocks.

The parameter server (and the tree nodes, and the in-process simulator) feed it each gradient's
arrival as ``(learner, gradient timestamp)``; it answers, deterministically:

- the gradient's staleness σ = (PS timestamp at arrival) − (gradient timestamp);
- the factor to scale this gradient by before it is summed (``per_gradient`` policy);
- whether the sum is now complete, and if so an :class:`Update`: which gradients it averages
  (the vector clock), ⟨σ⟩, the learning rate α for this update and the averaging factor 1/c;
- when the sender may have its reply (a :class:`Reply`): now, or once the weights of a later
  timestamp exist. Servers park a reply the engine holds and send it when :meth:`SyncEngine.due`
  says so; the simulator resumes a learner the same way.

Protocols (λ learners): ``hardsync`` updates after one gradient from every learner (c = λ) and
holds each learner's reply until that update, n-``softsync`` after c = ⌊λ/n⌋ from any learners,
``async`` after every gradient (c = 1); both answer at once. Learning-rate policies:
``constant`` (α0), ``staleness`` (α0/⟨σ⟩, ⟨σ⟩ < 1 counting as 1) and ``per_gradient`` (each
gradient scaled by 1/max(σᵢ, 1)); α0 follows a step schedule (:class:`LRSchedule`). Tree
nodes' relayed sums are accounted by :meth:`SyncEngine.receive_many` (c counts learner
gradients, not messages); each node decides when to relay with a ``relay_clock.RelayClock``,
which takes its protocol rules from here. A new protocol is a new rule in this module: the
functions above :class:`ProtocolViolation` and the engine's ``check`` and ``reply``. Tables
and the schedule: ``docs/protocols.md``.

Not thread-safe: one owner (the PS loop, or a tree node's loop) drives an engine or clock.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

PROTOCOLS = ("hardsync", "softsync", "async")
LR_POLICIES = ("constant", "staleness", "per_gradient")


def check_protocol(protocol: str, n: int, learners: int, broadcast: bool = False) -> None:
    """Raise ValueError, naming the value, unless ``protocol`` with ``n`` and ``learners`` (λ)
    is a protocol this engine runs; with ``broadcast`` (``architecture.kind: advstar``, whose
    servers answer every gradient ACK at once and never hold a reply), unless it runs
    there too. Pure."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"sync.protocol is {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    if learners < 1:
        raise ValueError(f"sync.learners must be >= 1, got {learners}")
    if protocol == "softsync" and not 1 <= n <= learners:
        raise ValueError(
            f"sync.n must be between 1 and sync.learners={learners} for softsync, "
            f"got {n} (n = learners is async)"
        )
    if broadcast and barrier(protocol):
        raise ValueError(
            "architecture.kind=advstar is asynchronous by design (learners never "
            "wait for weights; they adopt whatever the broadcast brought), so "
            f"sync.protocol={protocol} is not supported: use softsync or async, or "
            "architecture.kind=adv for it through a PS tree"
        )


def barrier(protocol: str) -> bool:
    """Whether every update takes exactly one gradient from each learner, computed on the
    newest weights (hardsync): older gradients are refused, each learner's reply waits for the
    update, and a tree node relays only whole subtrees. Pure."""
    return protocol == "hardsync"


def gradients_per_update(protocol: str, n: int, alive: int) -> int:
    """c: λ for hardsync, ⌊λ/n⌋ for n-softsync, 1 for async, where λ is ``alive`` (the
    learners alive, counted as at least 1). Pure."""
    alive = max(alive, 1)
    if barrier(protocol):
        return alive
    if protocol == "async":
        return 1
    return max(alive // n, 1)


def nominal_staleness(protocol: str, n: int, learners: int) -> int:
    """The σ a protocol is named by, as the paper's tables write it: 0 for hardsync, n for
    n-softsync, λ for async. Pure."""
    return {"hardsync": 0, "softsync": n, "async": learners}[protocol]


def protocol_label(protocol: str, n) -> str:
    """How runs name a protocol: ``hardsync``, ``softsync n=2``, ``async``. Pure."""
    return f"{protocol} n={n}" if protocol == "softsync" else protocol


class ProtocolViolation(ValueError):
    """A gradient that the protocol cannot accept; the engine's state is unchanged."""


class Rejoin(ProtocolViolation):
    """A learner that is no longer a member (evicted, or the server restarted): it must say
    HELLO again and continue from the current weights."""


@dataclass(frozen=True)
class Reply:
    """When a server may answer a sender, as the engine decides it: at once (``after`` None,
    :data:`NOW`), or once the weights of timestamp ``after`` exist. The reply itself is the
    server's (weights if newer than the sender's, else UPTODATE); ask :meth:`SyncEngine.due`
    (or ``RelayClock.due``) whether it may go."""

    after: int | None = None


NOW = Reply()


@dataclass(frozen=True)
class LRSchedule:
    """α0 and its step schedule; see the module docstring for the policies."""

    base_lr: float
    policy: str = "constant"
    steps: tuple[float, ...] = ()
    gamma: float = 0.1

    def __post_init__(self):
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr must be a positive finite number, got {self.base_lr!r}")
        if self.policy not in LR_POLICIES:
            raise ValueError(f"lr policy {self.policy!r} is not one of {', '.join(LR_POLICIES)}")
        if list(self.steps) != sorted(self.steps) or any(s < 0 for s in self.steps):
            raise ValueError(f"lr steps must be ascending epochs >= 0, got {list(self.steps)}")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"lr gamma must be positive, got {self.gamma!r}")

    def base_at(self, epoch: float) -> float:
        """α0 after the step schedule at ``epoch`` (steps take effect once the epoch is reached)."""
        return self.base_lr * self.gamma ** bisect.bisect_right(self.steps, epoch)


@dataclass(frozen=True)
class Update:
    """One weight update as decided by the engine.

    ``timestamp`` is the PS timestamp the update produces (the previous one + 1);
    ``learners``/``timestamps``/``sigmas`` are the vector clock of the gradients it averages,
    in arrival order; the PS applies ``w ← step(w, lr, g_scale · Σ scaleᵢ·gᵢ)``.
    """

    timestamp: int
    learners: tuple[int, ...]
    timestamps: tuple[int, ...]
    sigmas: tuple[int, ...]
    mean_sigma: float
    lr: float
    g_scale: float
    epoch: float


@dataclass(frozen=True)
class Arrival:
    """The engine's answer to one gradient: its σ, its scale, the update it completes, and
    when its sender may have its reply (``reply``; see :meth:`SyncEngine.reply`)."""

    learner: int
    timestamp: int
    sigma: int
    scale: float
    update: Update | None
    reply: Reply = NOW


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

    Membership (elastic λ): ``members`` are the learners the protocol waits for, all λ at
    start. :meth:`leave` drops one (an evicted or departed learner: c is recomputed from the
    members alive, hardsync's barrier no longer waits for it), :meth:`join` takes one back; its
    gradients are refused (:class:`Rejoin`) while it is out. ``state_dict``/``load_state``
    are what a checkpoint keeps.

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
        )

    def __post_init__(self):
        check_protocol(self.protocol, self.n, self.n_learners)
        if self.members is None:
            self.members = set(range(self.n_learners))
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
        if self._pending and len(self._pending) >= self.gradients_per_update:
            return self._make_update()
        return None

    def join(self, learner: int) -> None:
        """``learner`` is waited for again (from the next gradient it sends)."""
        if not 0 <= learner < self.n_learners:
            raise ProtocolViolation(
                f"learner id {learner} is out of range 0..{self.n_learners - 1} (sync.learners)"
            )
        self.members.add(learner)

    def state_dict(self) -> dict:
        """The engine's state as plain JSON-able values (for a checkpoint). Pure."""
        return {
            "timestamp": self.timestamp,
            "gradients_received": self.gradients_received,
            "updates": self.updates,
            "pending": [list(p) for p in self._pending],
            "members": sorted(self.members),
        }

    def load_state(self, d: dict) -> None:
        """Restore what ``state_dict`` returned (the schedule comes from the config)."""
        self.timestamp, self.updates = int(d["timestamp"]), int(d["updates"])
        self.gradients_received = int(d["gradients_received"])
        self._pending = [tuple(int(v) for v in p) for p in d["pending"]]
        self._pending_learners = {p[0] for p in self._pending}
        self.members = {int(m) for m in d["members"]}

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
        if barrier(self.protocol):
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
        self.check(learner, grad_ts)
        sigma = self.timestamp - grad_ts
        scale = 1.0 / max(sigma, 1) if self.lr.policy == "per_gradient" else 1.0
        self._pending.append((learner, grad_ts, sigma))
        self._pending_learners.add(learner)
        self.gradients_received += 1
        update = None
        if len(self._pending) >= self.gradients_per_update:
            update = self._make_update()
        return Arrival(learner, grad_ts, sigma, scale, update, self.reply((learner,)))

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
        update = None
        if len(self._pending) >= self.gradients_per_update:
            update = self._make_update()
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
        hardsync: once the update that a pending gradient of theirs belongs to exists;
        softsync and async: now. Pure."""
        if barrier(self.protocol) and not self._pending_learners.isdisjoint(learners):
            return Reply(self.timestamp + 1)
        return NOW

    def due(self, reply: Reply) -> bool:
        """Whether a reply the engine held may go now. Servers and the simulator ask again
        after every change of the engine's state (gradient, update, leave). Pure."""
        return reply.after is None or self.timestamp >= reply.after

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
            self.timestamp, learners, stamps, sigmas, mean_sigma, lr, 1.0 / len(sigmas), epoch
        )
        self._pending.clear()
        self._pending_learners.clear()
        return update
