"""The statistics server's join of a sharded run's EVALs: each of the K servers
(``architecture.servers``) sends the weights of its range, and one evaluation needs all K.

The slices of one evaluation are those the servers send as they cross the same epoch
boundary: every server receives every learner's gradient, so each counts the same epochs
(under n-softsync and async with its own timestamp: the record keeps server 0's as ``ts`` and
every server's in ``server_ts``). The final weights' slices are joined whatever their epochs
(a server restarted from a checkpoint counts again what it lost). At most ``MAX_OPEN``
evaluations wait for their missing slices; an older incomplete one is dropped (counted).
Pure: no sockets, no clock; not thread-safe (the statistics server's thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..span import split

MAX_OPEN = 8  # incomplete evaluations kept (a slice lost in a full queue never comes)


@dataclass
class Joined:
    """One whole evaluation, shaped like the ``wire.Message`` of an unsharded EVAL: ``ts``
    (server 0's), ``fields`` (``epoch``, ``server_ts``) and ``payloads`` (every server's
    chunks, in range order)."""

    ts: int
    fields: dict
    payloads: list = field(default_factory=list)


class EvalJoin:
    """Joins the EVAL slices of the K servers of a model of ``numel`` floats."""

    def __init__(self, numel: int, servers: int):
        self.ranges = [[s.lo, s.hi] for s in split(numel, servers)]
        self.open: dict = {}  # key (epoch, or "final") -> {server index: EVAL}
        self.dropped = 0  # incomplete evaluations given up (MAX_OPEN newer ones came)

    def refusal(self, msg) -> str | None:
        """Why the EVAL ``msg`` cannot be a slice of this run, or None."""
        rng = msg.fields.get("range")
        if rng not in self.ranges:
            return (
                f"an EVAL of range {rng!r}; this run's {len(self.ranges)} servers serve "
                f"{self.ranges}"
            )
        want = rng[1] - rng[0]
        if msg.payload_numel != want:
            return f"an EVAL of range {rng} with {msg.payload_numel:,} floats, not {want:,}"
        return None

    def add(self, msg) -> Joined | None:
        """Take one slice (checked with :meth:`refusal` first); returns the whole evaluation
        once its K slices are in, else None."""
        i = self.ranges.index(msg.fields["range"])
        key = "final" if msg.fields.get("final") else float(msg.fields["epoch"])
        slot = self.open.pop(key, {})
        slot[i] = msg
        if len(slot) < len(self.ranges):
            self.open[key] = slot  # (re)inserted last: the newest
            while len(self.open) > MAX_OPEN:
                del self.open[next(iter(self.open))]
                self.dropped += 1
            return None
        parts = [slot[k] for k in range(len(self.ranges))]
        return Joined(
            parts[0].ts,
            {
                "epoch": min(float(m.fields["epoch"]) for m in parts),
                "server_ts": [m.ts for m in parts],
            },
            [p for m in parts for p in m.payloads],
        )
