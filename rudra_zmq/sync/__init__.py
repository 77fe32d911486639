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
``async`` after every gradient (c = 1); both answer at once. With ``max_staleness`` s
(bounded staleness, SSP's rule, softsync and async), no update may take the timestamp more
than s past the weights any member is computing on: the update waits for the slowest
learner's gradient, the senders of the gradients it holds wait for it (their replies are
held), and a gradient with σ > s that arrives anyway is refused (:class:`TooStale`) and
counted, never applied. Learning-rate policies:
``constant`` (α0), ``staleness`` (α0/⟨σ⟩, ⟨σ⟩ < 1 counting as 1) and ``per_gradient`` (each
gradient scaled by 1/max(σᵢ, 1)); α0 follows a step schedule (:class:`LRSchedule`). Tree
nodes' relayed sums are accounted by :meth:`SyncEngine.receive_many` (c counts learner
gradients, not messages); each node decides when to relay with a ``relay_clock.RelayClock``,
which takes its protocol rules from here. A new protocol is a new rule in this package: the
functions of ``rules.py`` and the engine's ``check``, ``reply`` and ``_update_due``. Tables
and the schedule: ``docs/protocols.md``.

Not thread-safe: one owner (the PS loop, or a tree node's loop) drives an engine or clock.
"""

from .decisions import Arrival, Update
from .engine import SyncEngine
from .rules import (
    LR_POLICIES,
    NOW,
    PROTOCOLS,
    LRSchedule,
    ProtocolViolation,
    Rejoin,
    Reply,
    TooStale,
    barrier,
    check_protocol,
    gradients_per_update,
    nominal_staleness,
    protocol_label,
)

__all__ = [
    "LR_POLICIES",
    "NOW",
    "PROTOCOLS",
    "Arrival",
    "LRSchedule",
    "ProtocolViolation",
    "Rejoin",
    "Reply",
    "SyncEngine",
    "TooStale",
    "Update",
    "barrier",
    "check_protocol",
    "gradients_per_update",
    "nominal_staleness",
    "protocol_label",
]
