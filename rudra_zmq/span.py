"""The range ``[lo, hi)`` of a model's flat parameter vector that one parameter server serves.

Today one server serves the whole vector (``Span.whole(numel)``); a sharded run gives each of
k servers one span of ``split(numel, k)``. The optimizer's parameter segments (per-layer
learning-rate and weight-decay multipliers) are per element, so a segment that crosses a
span's boundary is clipped to the span (``Span.clip``): each server updates its elements
exactly as the whole-vector server would. Pure: no I/O; thread-safe (immutable).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Elements ``lo`` up to (not including) ``hi`` of a flat vector of ``total`` floats."""

    lo: int
    hi: int
    total: int

    def __post_init__(self):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in self.astuple()):
            raise ValueError(f"range {self.astuple()!r}: lo, hi and total must be integers")
        if not 0 <= self.lo < self.hi <= self.total:
            raise ValueError(
                f"range [{self.lo}, {self.hi}) of a vector of {self.total} floats: "
                "it needs 0 <= lo < hi <= total (is the model the one the range "
                "was planned for?)"
            )

    @classmethod
    def whole(cls, numel: int) -> Span:
        """The whole vector of ``numel`` floats (what one unsharded server serves)."""
        return cls(0, numel, numel)

    @classmethod
    def from_meta(cls, value, total: int) -> Span:
        """The span a checkpoint's ``meta["range"]`` ([lo, hi]) names in a vector of ``total``
        floats; None (a checkpoint written before servers had ranges) is the whole vector.
        Raises ValueError for anything else."""
        if value is None:
            return cls.whole(total)
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"checkpoint range {value!r}: expected [lo, hi]")
        return cls(value[0], value[1], total)

    def astuple(self) -> tuple[int, int, int]:
        return self.lo, self.hi, self.total

    @property
    def numel(self) -> int:
        """How many floats the span holds."""
        return self.hi - self.lo

    @property
    def is_whole(self) -> bool:
        """Whether the span is the whole vector."""
        return self.lo == 0 and self.hi == self.total

    def clip(self, segments) -> list[tuple]:
        """The (start, stop, lr_mult, decay_mult) ``segments`` of the whole vector that overlap
        the span, clipped to it and shifted to offsets within it (0 is ``lo``)."""
        return [
            (max(a, self.lo) - self.lo, min(b, self.hi) - self.lo, *rest)
            for a, b, *rest in segments
            if a < self.hi and b > self.lo
        ]

    def __str__(self) -> str:
        whole = " (the whole vector)" if self.is_whole else ""
        return f"[{self.lo:,}, {self.hi:,}) of {self.total:,}{whole}"


def split(numel: int, k: int) -> list[Span]:
    """``k`` contiguous spans covering a vector of ``numel`` floats, sizes differing by at most
    one (the first ``numel % k`` one larger). Raises ValueError unless 1 <= k <= numel."""
    if not isinstance(k, int) or not 1 <= k <= numel:
        raise ValueError(f"cannot split {numel:,} floats into {k!r} ranges: give 1 to {numel:,}")
    size, extra = divmod(numel, k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [Span(a, b, numel) for a, b in itertools.pairwise(bounds)]


def part_bounds(numel: int, parts: int) -> list[int]:
    """The offsets cutting a range of ``numel`` floats into ``parts`` contiguous parts as
    :func:`split` sizes them (fewer when the range has fewer floats): ``[0, ..., numel]``.
    Learner and server compute them alike from ``wire.parts`` (``docs/wire.md``). Pure."""
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a whole number >= 1, got {parts!r}")
    return [s.lo for s in split(numel, min(parts, numel))] + [numel]
