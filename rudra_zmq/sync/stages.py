"""Protocols that change during a run (beyond the paper): a schedule of protocols by epoch
(``sync.schedule``) and an n chosen to hold ⟨σ⟩ near a target (``sync.target_staleness``).

Both are decided after each update from what the engine knows (the epoch, the update's σ), so
the parameter server and the simulator change at the same update. A switch happens right after
an update, when nothing is pending. Pure; ``Stages`` is owned by one engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .rules import PROTOCOLS, barrier, check_protocol

ADAPT_EVERY = 20  # updates between two choices of n (target_staleness)


@dataclass(frozen=True)
class Stage:
    """From ``epoch`` on, ``protocol`` with ``n`` (n of n-softsync; 1 for the others)."""

    epoch: float
    protocol: str
    n: int = 1


def parse_schedule(items, learners: int) -> tuple[Stage, ...]:
    """``sync.schedule``'s strings (``"EPOCH PROTOCOL [N]"``, e.g. ``"12 softsync 4"``,
    ``"13 hardsync"``) as stages, checked: epochs > 0 and ascending, each a protocol this
    engine runs with ``learners`` (λ). Raises ValueError naming the entry. Pure."""
    stages = []
    for i, item in enumerate(items):
        parts = str(item).split()
        where = f"sync.schedule[{i}] is {item!r}"
        try:
            epoch, protocol = float(parts[0]), parts[1]
            n = int(parts[2]) if len(parts) == 3 else (learners if protocol == "async" else 1)
        except (IndexError, ValueError):
            raise ValueError(
                f"{where}: expected 'EPOCH PROTOCOL [N]', e.g. '12 softsync 4' or '13 hardsync'"
            ) from None
        if len(parts) > 3 or not math.isfinite(epoch) or epoch <= 0:
            raise ValueError(f"{where}: expected 'EPOCH PROTOCOL [N]' with an epoch > 0")
        if protocol not in PROTOCOLS:
            raise ValueError(f"{where}: the protocol is one of {', '.join(PROTOCOLS)}")
        check_protocol(protocol, n, learners)
        if stages and epoch <= stages[-1].epoch:
            raise ValueError(f"{where}: the epochs must ascend (after {stages[-1].epoch:g})")
        stages.append(Stage(epoch, protocol, n))
    return tuple(stages)


def check_target(target, protocol: str, learners: int, schedule) -> None:
    """Raise ValueError unless ``sync.target_staleness`` ``target`` can run: softsync, a
    number in (0, λ], no schedule beside it. Pure."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target:
        raise ValueError(f"sync.target_staleness must be a number > 0 (or null), got {target!r}")
    if protocol != "softsync":
        raise ValueError(
            f"sync.target_staleness chooses the n of n-softsync: set sync.protocol=softsync "
            f"(it is {protocol})"
        )
    if target > learners:
        raise ValueError(
            f"sync.target_staleness={target:g} is above λ={learners}, the ⟨σ⟩ of async"
        )
    if schedule:
        raise ValueError("sync.target_staleness and sync.schedule both set n: give one")


class Stages:
    """What the engine's protocol and n become after each update: the stage of the schedule
    the epoch is in, or (target staleness) every ADAPT_EVERY updates the n that moves the
    window's ⟨σ⟩ toward the target."""

    def __init__(self, schedule=(), target: float | None = None):
        self.schedule, self.target = tuple(schedule), target
        self._sigmas: list[float] = []

    def after(self, update, protocol: str, n: int, learners: int) -> tuple[str, int] | None:
        """The (protocol, n) to switch to after ``update`` (a ``sync.Update``) made under
        ``protocol`` and ``n`` with ``learners`` members, or None to stay. Pure but for the
        window of σ it keeps."""
        if self.schedule:
            due = [s for s in self.schedule if s.epoch <= update.epoch]
            if due and (due[-1].protocol, due[-1].n) != (protocol, n):
                return due[-1].protocol, due[-1].n
            return None
        if self.target is None or barrier(protocol):
            return None
        self._sigmas.extend(update.sigmas)
        if len(self._sigmas) < ADAPT_EVERY * max(learners // n, 1):
            return None
        mean = sum(self._sigmas) / len(self._sigmas)
        self._sigmas.clear()
        # ⟨σ⟩ grows about in proportion to n (n(λ-1)/λ at equal speeds): scale n by the
        # ratio, at most doubling or halving per choice
        ratio = min(max(self.target / max(mean, 0.05), 0.5), 2.0)
        new = min(max(round(n * ratio), 1), max(learners, 1))
        return (protocol, new) if new != n else None
