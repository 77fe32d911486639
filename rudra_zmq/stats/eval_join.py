"""The statistics server's join of the servers' EVALs: each of the K servers of the cluster's
shape (``shape.ClusterShape``) sends the weights of its range, and one evaluation needs all
K (one server's EVAL is a whole evaluation, joined at once).

The slices of one evaluation are those the servers send as they cross the same epoch
boundary: every server receives every learner's gradient, so each counts the same epochs
(under n-softsync and async with its own timestamp: the record keeps server 0's as ``ts`` and
every server's in ``server_ts``). The final weights' slices are joined whatever their epochs
(a server restarted from a checkpoint counts again what it lost). At most ``MAX_OPEN``
evaluations wait for their missing slices; an older incomplete one is dropped (counted).
No sockets, no clock; not thread-safe (the statistics server's thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import codec

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
    """Joins the EVAL slices of the servers of ``shape`` (a ``ClusterShape`` sized to the
    model)."""

    def __init__(self, shape):
        self.shape = shape
        self.open: dict = {}  # key (epoch, or "final") -> {server index: EVAL}
        self.dropped = 0  # incomplete evaluations given up (MAX_OPEN newer ones came)

    def refusal(self, msg) -> str | None:
        """Why the EVAL ``msg`` cannot be a slice of this run, or None."""
        i = self.shape.eval_server(msg.fields)
        if i is None:
            ranges = [s.share.key for s in self.shape.servers]
            return (
                f"an EVAL of range {msg.fields.get('range')!r}; this run's "
                f"{len(ranges)} servers serve {ranges}"
            )
        share = self.shape.servers[i].share
        if msg.payload_numel != share.numel:
            return (
                f"an EVAL of range {share} with {msg.payload_numel:,} floats, not {share.numel:,}"
            )
        return None

    def add(self, msg) -> Joined | None:
        """Take one slice (checked with :meth:`refusal` first); returns the whole evaluation
        once every server's slice is in, else None."""
        i = self.shape.eval_server(msg.fields)
        key = "final" if msg.fields.get("final") else float(msg.fields["epoch"])
        slot = self.open.pop(key, {})
        slot[i] = msg
        if len(slot) < len(self.shape.servers):
            self.open[key] = slot  # (re)inserted last: the newest
            while len(self.open) > MAX_OPEN:
                del self.open[next(iter(self.open))]
                self.dropped += 1
            return None
        parts = [slot[k] for k in range(len(self.shape.servers))]
        return Joined(
            parts[0].ts,
            {
                "epoch": min(float(m.fields["epoch"]) for m in parts),
                **self.shape.eval_record([m.ts for m in parts]),
            },
            self._whole(parts),
        )

    def _whole(self, parts) -> list:
        """The servers' payloads as the whole vector's: end to end when their shares are
        ranges in order (no copy); stripes are decoded and put in place (one float32 copy)."""
        servers = self.shape.servers
        if all(s.share.contiguous for s in servers):
            return [p for m in parts for p in m.payloads]
        whole = np.empty(self.shape.numel, np.float32)
        for s, m in zip(servers, parts):
            local = np.empty(s.share.numel, np.float32)
            codec.load(local, m.payloads)
            s.share.scatter(local, whole)
        return [whole]
