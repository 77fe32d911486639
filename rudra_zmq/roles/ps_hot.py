"""The parameter server's hot request, served in C (``fastio.HotPS``).

With c = 1 (async, or n-softsync with n = λ) every PUSHPULL is one whole update: check it,
step, answer with the new weights. Done in Python that costs about as much as the round trip
itself on a 2-core machine, where the ZeroMQ I/O threads leave every Python line cold
(bench/RESULTS.md). So before each receive the server *arms* HotPS with what the next update
will be -- the learning rate of the epoch that the next gradient completes (before the
staleness policy, which needs σ), the timestamp, the weights, momentum and a free buffer for
the next version -- and HotPS serves a PUSHPULL that fits entirely in C: receive, validate
(the shape of wire.decode's hot messages, the learner's registered connection, the server's
incarnation, 0 <= ts <= timestamp), apply the momentum step with the same kernel, send WEIGHTS.

Only then does Python account the gradient in the sync engine, exactly as the general path
would (``_hot_served``): the engine stays the one authority on timestamps, σ and α, and the
server checks that it decided the same update that was applied (any difference is a bug and
stops the server). Everything else -- another kind, a malformed or refused message, a
gradient in parts, the update that ends training -- goes to ``handle`` untouched.

A reply that the general path would stream in parts (``runtime.stream_parts``) is streamed the
same way: each part's WPART leaves as soon as the kernel finished it, then WEIGHTS x{parts}.

Served hot only when nothing else could apply: architecture base without broadcast, momentum
SGD, protocol async or softsync with c = 1, a gradient pushed whole (not in parts), replies of
one frame per message (an unstreamed model within one ``runtime.chunk_mib`` chunk, or parts
within one), no gradient in parts open, and for a streamed reply no learner parked on a pull.
"""
from __future__ import annotations

import logging

from .. import fastio
from ..sync import learners_wait

log = logging.getLogger("rudra_zmq.ps")


class HotPathMixin:
    """The hot request of ParameterServer; call ``_init_hot`` at the end of ``__init__``."""

    def _init_hot(self) -> None:
        cfg, o = self.cfg, self.cfg.optimizer
        one_frame = self.part_floats < self.numel or 4 * self.numel <= self.chunk_bytes
        fits = (cfg.runtime.hot_path and self.broadcast is None and self.tree is None
                and o.momentum > 0
                and not learners_wait(cfg.sync.protocol) and self.engine.gradients_per_update == 1
                and one_frame and -(-self.numel // self.part_floats) <= fastio.HOT_MAX_PARTS)
        self.hot = fastio.HotPS(self.sock, self.numel, cfg.sync.learners, self.inc,
                                self.segments, o.momentum, o.weight_decay,
                                self.io.pins) if fits else None
        self._hot_policy = fastio.POLICIES[o.lr_policy]
        self._hot_out = None       # the buffer HotPS was armed with
        self.hot_updates = 0       # updates served hot (PS metrics; tests)

    def _arm_hot(self) -> None:
        """Arm HotPS for the next request, if it may serve one (see the module docstring)."""
        hot = self.hot
        if hot is None or hot.is_armed:
            return
        e = self.engine
        nxt = e.epoch_at(e.gradients_received + 1)   # the epoch the next gradient completes
        if (self.done or e.pending or self._parts or self._cut is not None or self._held
                or nxt >= self.cfg.train.epochs or (self.parked and self.part_floats < self.numel)):
            return      # (a streamed reply goes to the parked learners too: general path)
        self.io.prune()    # sends libzmq finished with free their weight versions for reuse
        self._hot_out = self.versions.next_buffer()
        hot.arm(e.lr.base_at(nxt), self._hot_policy, e.timestamp, self._seq + 1, self.w,
                self.v, self._hot_out, self.part_floats)

    def _disarm_hot(self) -> None:
        """Before the general path runs: it may change what HotPS was armed with."""
        if self.hot is not None and self.hot.is_armed:
            self.hot.disarm()
            self.versions.give_back(self._hot_out)
            self._hot_out = None

    def _hot_served(self) -> None:
        """HotPS applied an update and replied: account it as the general path would."""
        h, out = self.hot, self._hot_out
        self._hot_out = None
        arrival = self.engine.receive(h.sender, h.grad_ts)
        update = arrival.update
        if (update is None or update.timestamp != h.new_ts or arrival.sigma != h.sigma
                or update.lr != h.lr or update.g_scale * arrival.scale != h.g_scale):
            raise RuntimeError(
                f"internal error: the compiled hot path applied an update to timestamp "
                f"{h.new_ts} (σ {h.sigma}, α {h.lr!r}, scale {h.g_scale!r}) but the sync "
                f"engine decided {update} for learner {h.sender}'s gradient of timestamp "
                f"{h.grad_ts}; please report this")
        self.versions.publish(out)
        self._seq = h.reply_seq
        self.hot_updates += 1
        if h.send_failures:
            self.undelivered += h.send_failures
            log.warning("could not reply WEIGHTS to learner %d: %s", h.sender,
                        fastio.strerror(h.send_errno))
        self._after_update(update)
