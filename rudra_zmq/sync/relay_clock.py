"""A Rudra-adv tree node's side of the sync protocol: what its sum holds, and when to relay it.

Pure logic like the rest of the ``sync`` package, whose protocol rules it applies
(``rules.barrier``): no sockets, threads or clocks. A tree node's state (``tree/state.py``'s
``NodeState``) owns one; ``docs/architecture.md`` draws the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rules import NOW, ProtocolViolation, Reply, barrier


@dataclass
class RelayClock:
    """A Rudra-adv tree node's side of the protocol: what its sum holds, and when to relay it.

    The node adds each child's gradient (a learner's, or a child node's relayed sum) with its
    vector clock entries; ``ready`` says when to relay the sum to the parent, ``take`` moves
    the pending entries into the one relay in flight, ``answered`` ends it when the parent
    replies. Relay policy:

    - hardsync: once every learner below has contributed exactly one gradient at the node's
      weights timestamp (the root then updates after one relay from each of its children);
    - softsync/async: as soon as anything is pending and no relay is in flight, so gradients
      that arrive during a relay's round trip go together in the next one;
    - softsync/async with ``gather`` (``architecture.relay: gather``): once every learner
      below has a gradient pending (timestamps may differ), so each relay carries the whole
      subtree and the root's ingress falls by the fan-out factor, at the price of a
      barrier among the learners of one node (c still counts learner gradients at the root).

    A child is answered only when the relay carrying its gradient is answered, so each learner
    has at most one gradient anywhere in the tree: a clock never lists a learner twice, never
    holds more than the learners below, and the learner gets the weights the root returned
    for its gradient, as in Rudra-base. Not thread-safe; no I/O, never blocks.
    """

    protocol: str
    learners: frozenset
    timestamp: int = -1  # the newest weights timestamp this node holds
    gather: bool = False  # softsync/async: relay only sums of the whole subtree
    _pending: list = field(default_factory=list, repr=False)
    _in_flight: list = field(default_factory=list, repr=False)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def check(self, entries) -> None:
        """Raise :class:`ProtocolViolation` if ``add(entries)`` would refuse them."""
        if not entries:
            raise ProtocolViolation("a gradient sum must contain at least one gradient")
        held = {who for who, _ in self._pending} | {who for who, _ in self._in_flight}
        for learner, ts in entries:
            if learner not in self.learners:
                raise ProtocolViolation(
                    f"learner {learner} is not below this node (its "
                    f"learners: {sorted(self.learners)})"
                )
            if learner in held:
                raise ProtocolViolation(
                    f"learner {learner} sent a gradient while its previous one was not answered yet"
                )
            held.add(learner)
            if not 0 <= ts <= self.timestamp:
                raise ProtocolViolation(
                    f"learner {learner}'s gradient has timestamp {ts}, but this node only "
                    f"served weights up to {self.timestamp} (is it talking to a restarted node?)"
                )
            if barrier(self.protocol) and ts != self.timestamp:
                raise ProtocolViolation(
                    f"hardsync: learner {learner} pushed a gradient of timestamp {ts} but the "
                    f"weights are at {self.timestamp}; it must pull before the next gradient"
                )

    def add(self, entries) -> None:
        """Account the gradients of one child's message (all checked first)."""
        entries = [(int(who), int(t)) for who, t in entries]
        self.check(entries)
        self._pending.extend(entries)

    @property
    def ready(self) -> bool:
        """Whether to relay now (see the class docstring)."""
        if self._in_flight or not self._pending:
            return False
        if barrier(self.protocol) or self.gather:
            return len(self._pending) == len(self.learners)
        return True

    def take(self) -> list[tuple[int, int]]:
        """The pending entries, now the relay in flight (the clock to send)."""
        if not self.ready:
            raise RuntimeError("take() called while not ready to relay")
        self._in_flight, self._pending = self._pending, []
        return list(self._in_flight)

    def reply(self, learner: int) -> Reply:
        """When a child's PULL may be answered: with a barrier protocol (hardsync), a learner
        whose gradient this node holds gets newer weights than the node's, once they are
        here; otherwise now (from the node's weights, or UPTODATE). Pure."""
        held = self._pending + self._in_flight
        if barrier(self.protocol) and any(who == learner for who, _ in held):
            return Reply(self.timestamp + 1)
        return NOW

    def due(self, reply: Reply) -> bool:
        """Whether a pull this clock held may be answered now (see ``sync.SyncEngine.due``)."""
        return reply.after is None or self.timestamp >= reply.after

    def answered(self, timestamp: int) -> list[tuple[int, int]]:
        """The parent answered the relay in flight; the node now holds weights of
        ``timestamp``. Returns the entries that relay carried."""
        done, self._in_flight = self._in_flight, []
        self.timestamp = max(self.timestamp, timestamp)
        return done
