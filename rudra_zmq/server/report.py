"""What the parameter server tells the statistics server, and when.

- one ``update`` record per update (timestamp, epoch, ⟨σ⟩, every σ, α, gradient count),
  batched and sent every FLUSH_S so that a fast PS sends a few messages a second, not one per
  update;
- one ``ps`` record a second: updates/s, gradients/s, refused messages;
- a ``members`` record whenever λ changes (a learner evicted or rejoining), with λ and c,
  numbered and kept in the server's ``members.json`` first (``journal.py``);
- a ``restart`` record when a restarted server resumed (from a checkpoint or its learners'
  copy of its range: ``from``, and the updates ``lost``);
- a ``done`` record when training finished;
- its weights, to be evaluated (an EVAL), at the start and when ``EvalSchedule`` says.

What it leaves in the run directory at the end is ``end_files.py``'s.

Sends go through ``StatsClient``, which never blocks (a full queue drops and counts). Not
thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

import time

from .journal import Journal
from .restart_record import as_record

FLUSH_S = 0.5  # update records are batched this long
RATE_EVERY_S = 1.0  # a "ps" record this often
BATCH_ITEMS = 200  # update records per message


class PSReport:
    """The PS's metrics stream. ``stats``: a StatsClient, or None (then nothing is kept).
    ``place``: which of the run's servers this is (``shape.Server``, its range known): every
    record carries its ``record`` fields and every EVAL its
    ``eval_fields`` (with several servers, ``"server": I`` and the range), for the
    statistics server to tell the servers apart and join the ranges. ``journal``: where its
    ``members`` records are kept before they are sent (``journal.Journal``)."""

    def __init__(self, stats, place, journal: Journal):
        self.stats, self.journal = stats, journal
        self._server, self._range = place.record, place.eval_fields
        self._pending: list[dict] = []
        self._last_flush = self._last_rate = time.time()
        self._counts = (0, 0)

    def update(self, update) -> None:
        """Record one update (sync.Update); sent with the next flush."""
        if self.stats is None:
            return
        self._pending.append({**update.record(time.time()), **self._server})

    def _metric(self, rec: dict) -> None:
        """Send one record now, saying which server it is from (a sharded run)."""
        self.stats.metric({**rec, **self._server})

    def tick(self, ps, force: bool = False) -> None:
        """Send what is due (everything with ``force``); ``ps`` is the ParameterServer whose
        counters go into the rate record. Call regularly from the serving loop."""
        if self.stats is None:
            return
        now = time.time()
        if self._pending and (force or now - self._last_flush >= FLUSH_S):
            items, self._pending = self._pending, []
            for i in range(0, len(items), BATCH_ITEMS):
                self.stats.metric({"type": "batch", "items": items[i : i + BATCH_ITEMS]})
            self._last_flush = now
        if force or now - self._last_rate >= RATE_EVERY_S:
            dt = max(now - self._last_rate, 1e-9)
            eng = ps.state.engine
            upd, grads = eng.updates, eng.gradients_received
            self._metric(
                {
                    "type": "ps",
                    "t": now,
                    "ts": eng.timestamp,
                    "updates_per_s": (upd - self._counts[0]) / dt,
                    "gradients_per_s": (grads - self._counts[1]) / dt,
                    **_counters(ps),
                }
            )
            self._counts = (upd, grads)
            self._last_rate = now

    def evaluate(self, state) -> None:
        """Send the weights of ``state`` (a ServerState) to be evaluated (an EVAL). Does not
        block, except for the final weights: those wait for room (a statistics server being
        restarted)."""
        if self.stats is not None:
            eng = state.engine
            self.stats.eval_weights(
                eng.timestamp,
                eng.epoch,
                state.w,
                state.chunk_bytes,
                final=state.done,
                **self._range,
            )

    def done(self, ps) -> None:
        """The end-of-training record."""
        if self.stats is not None:
            self._metric(
                {
                    "type": "done",
                    "t": time.time(),
                    "ts": ps.state.engine.timestamp,
                    "epoch": ps.state.engine.epoch,
                    **_counters(ps),
                }
            )

    def members(self, learner: int, event: str, engine) -> None:
        """λ changed: ``learner`` was ``event`` (evicted | joined); kept in the server's
        ``members.json`` (``journal``: the statistics server reads it from there if the record
        never reaches it), then sent at once."""
        if self.stats is None:
            return
        rec = {
            "type": "members",
            "t": time.time(),
            "ts": engine.timestamp,
            "epoch": engine.epoch,
            "learner": learner,
            "event": event,
            "learners": len(engine.members),
            "c": engine.gradients_per_update,
        }
        self._metric(self.journal.add(rec))

    def restart(self, ps, record: dict | None = None) -> None:
        """This server resumed: restarted (``record``, its ``restart_record`` entry: from a
        checkpoint or its learners' copy of its range, the updates lost so far; the record is
        that entry, which the statistics server also reads from the server's files if this
        one never reaches it), or the run resumed from a checkpoint; sent at once."""
        if self.stats is None:
            return
        if record is not None:
            self._metric(as_record(record))
            return
        st = ps.state
        self._metric(
            {
                "type": "restart",
                "t": time.time(),
                "ts": st.engine.timestamp,
                "epoch": st.engine.epoch,
                "incarnation": ps.history.starts,
                "checkpoint": None if ps.resumed_from is None else str(ps.resumed_from),
            }
        )


class EvalSchedule:
    """Which updates' weights the PS sends to be evaluated: every ``train.eval_every_updates``
    updates, the first at or past each multiple of ``train.eval_every_epochs`` epochs (0: off
    for either), and the one that completes training. ``epoch``: where the server starts (a
    resumed one: the next multiple after it). Pure."""

    def __init__(self, train, epoch: float = 0.0):
        self.every_updates, self.every_epochs = train.eval_every_updates, train.eval_every_epochs
        self.next_epoch = self.every_epochs or float("inf")
        while self.next_epoch <= epoch:  # resumed: the next one due
            self.next_epoch += self.every_epochs

    def due(self, update, done: bool) -> bool:
        """Whether to evaluate the weights after ``update`` (sync.Update); ``done``: training
        is complete."""
        if not (
            (self.every_updates and update.timestamp % self.every_updates == 0)
            or update.epoch >= self.next_epoch
            or done
        ):
            return False
        while update.epoch >= self.next_epoch:
            self.next_epoch += self.every_epochs
        return True


def _counters(ps) -> dict:
    c = ps.state.counters
    return {
        "invalid": c.invalid,
        "duplicates": c.duplicates,
        "evictions": c.evictions,
        "lost_updates": c.lost_updates,
        "too_stale": ps.state.engine.too_stale,  # refused: σ > sync.max_staleness
    }
