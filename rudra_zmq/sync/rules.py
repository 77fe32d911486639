"""The protocol rules of the sync engine (``rudra_zmq.sync``): which protocols and bounds a
run may ask for, c, the σ a protocol is named by, the refusals, a reply's timing and the
learning-rate schedule. Pure functions and frozen values; no state."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

PROTOCOLS = ("hardsync", "softsync", "async")
LR_POLICIES = ("constant", "staleness", "per_gradient")


def check_protocol(
    protocol: str,
    n: int,
    learners: int,
    broadcast: bool = False,
    max_staleness: int | None = None,
    tree: bool = False,
) -> None:
    """Raise ValueError, naming the value, unless ``protocol`` with ``n``, ``learners`` (λ)
    and ``max_staleness`` is a protocol this engine runs; with ``broadcast``
    (``architecture.kind: advstar``, whose servers answer every gradient ACK at once and
    never hold a reply) or ``tree`` (``adv``), unless it runs there too. Pure."""
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
    if max_staleness is not None:
        _check_max_staleness(protocol, max_staleness, broadcast, tree)


def _check_max_staleness(protocol: str, s, broadcast: bool, tree: bool) -> None:
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise ValueError(
            f"sync.max_staleness must be a whole number of updates >= 0 (or null for no "
            f"bound), got {s!r}"
        )
    if barrier(protocol):
        raise ValueError(
            "sync.max_staleness bounds softsync and async; hardsync's σ is always 0: "
            "remove sync.max_staleness or use sync.protocol=softsync"
        )
    if broadcast or tree:
        kind = "advstar" if broadcast else "adv"
        raise ValueError(
            f"sync.max_staleness needs a server that holds each learner's reply (SSP's "
            f"wait); architecture.kind={kind} answers through "
            f"{'the broadcast' if broadcast else 'tree nodes that relay sums'}: use "
            "architecture.kind=base, or remove sync.max_staleness"
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


class TooStale(Rejoin):
    """A gradient older than ``max_staleness`` updates (one computed before an eviction or a
    restart): refused, never applied; its learner says HELLO again for the current weights."""


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
