"""When the parameter server stops waiting for learners: one silent for
``runtime.learner_timeout_s`` is evicted, training done with learners not yet told STOP is
said once, and no message from anyone for ``runtime.timeout_s`` ends the serving.

Rules over the ``ServerState`` with the time passed in: ``Liveness`` says whom to evict and
when to give up; the server acts (evicts, releases held replies). Not thread-safe: owned by
the parameter server's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from .. import wire
from ..notices import notice

log = logging.getLogger("rudra_zmq.ps")

EVICT_CHECK_S = 0.1  # how often the loop looks for silent learners (not per message)
WAIT_NOTE_S = 3.0  # training done this long with learners not yet told: say so


class Liveness:
    """The silence rules of one serving run, from ``runtime`` (the config's section);
    ``start(now)`` when serving starts."""

    def __init__(self, runtime):
        self.learner_timeout = runtime.learner_timeout_s  # 0: never evict
        self.timeout = runtime.timeout_s
        self.started = self._next_check = 0.0
        self._done_at: float | None = None  # when training ended (for the waiting note)
        self._noted_waiting = False

    def start(self, now: float) -> None:
        self.started = self._next_check = now

    def due(self, now: float) -> bool:
        """Whether to look for silent learners (and say who is waited for) now: every
        EVICT_CHECK_S."""
        if now < self._next_check:
            return False
        self._next_check = now + EVICT_CHECK_S
        return True

    def silent(self, state, now: float, waiting) -> Iterator[int]:
        """The learners to evict: silent for ``runtime.learner_timeout_s`` and not ``waiting``
        for a reply the server owes them (one that never said HELLO: ``runtime.timeout_s``
        from the start); none when that timeout is 0. Each is said (a notice) as it comes."""
        if not self.learner_timeout:
            return
        # a learner that never said HELLO gets runtime.timeout_s from the server's start
        never_by = self.started + self.timeout if state.tree is None else None
        for learner in state.silent(now, self.learner_timeout, waiting, never_by):
            notice(
                log,
                "learner %d sent nothing for %g s (runtime.learner_timeout_s; never: "
                "runtime.timeout_s from the start): evicted; it rejoins with a HELLO",
                learner,
                self.learner_timeout,
            )
            yield learner

    def note_waiting(self, state, now: float) -> None:
        """Say once, WAIT_NOTE_S after training ended, which learners the server still waits
        for (a lost host's): the run's end would otherwise be a silent wait of up to a minute."""
        if not state.done or self._noted_waiting:
            return
        if self._done_at is None:
            self._done_at = now
        elif now - self._done_at >= WAIT_NOTE_S:
            self._noted_waiting = True
            log.info(
                "training is done; waiting to tell learners %s to stop (each is evicted "
                "after runtime.learner_timeout_s=%g s of silence, or runtime.timeout_s=%g s "
                "from the start if never heard from)",
                sorted(state.untold),
                self.learner_timeout,
                self.timeout,
            )

    def idle(self, state, quiet_s: float) -> bool:
        """No message from anyone for ``quiet_s``: past ``runtime.timeout_s``, True (stop
        serving) if training is done, else raises TimeoutError; False before."""
        if quiet_s <= self.timeout:
            return False
        if state.done:
            log.warning(
                "training is done but learners %s never came back; exiting",
                sorted(set(range(state.learners)) - state.stopped),
            )
            return True
        raise TimeoutError(
            f"parameter server: no message from any learner for {self.timeout:.0f} s at "
            f"timestamp {state.engine.timestamp} (learners registered: "
            f"{sorted(i for i in state.identities if i >= 0)}, tree nodes: "
            f"{sorted(wire.node_id(s) for s in state.subtrees)}); is a learner or tree node dead?"
        )
