"""How a tree node answers its children: one class per architecture, chosen at start, as
``server/weights.py`` is for the parameter server.

- :class:`ChildWeights` (``adv``): a child's gradient or pull is answered with the weights
  the parent returned (frames, or the leaf's board for a learner that pushed by shared
  memory) when they are newer than the child's, else UPTODATE; a PUSH is answered ACK.
- :class:`ChildAcks` (``advstar``): no weights travel down the tree (they come by the
  learners' broadcast); every gradient is answered ACK and pulls are refused.

Both send through the node's ``send(ident, kind, payloads=(), **fields)`` and read its
``NodeState``. Not thread-safe: owned by the tree node's thread.
"""

from __future__ import annotations

from .. import wire
from ..sync import ProtocolViolation
from ..wire import Kind
from .state import NodeState


def make_children_out(state: NodeState, send, shared):
    """The way this node answers its children (``architecture.kind``); ``shared`` is its
    ``leaf_shm`` strategy (whether a child reads its weights from the board)."""
    return ChildAcks(state, send) if state.advstar else ChildWeights(state, send, shared)


class ChildWeights:
    """Rudra-adv: children are answered with the weights the parent returned (frames, or a
    board reference for a learner that pushed by shared memory), or UPTODATE."""

    def __init__(self, state: NodeState, send, shared):
        self.state, self.send, self.shared = state, send, shared

    def check_pull(self, msg: wire.Message) -> None:
        """Pulls are served."""

    def answer(self, ident: bytes, kind: Kind, child_ts: int, re: int) -> None:
        """Answer a child's request ``re`` whose gradient (or pull) is done: ACK a PUSH; else
        newer weights or UPTODATE."""
        st = self.state
        if kind == Kind.PUSH:
            self.send(ident, Kind.ACK, re=re)
        elif st.ts > child_ts and self.shared.on_board(ident):
            self.send(ident, Kind.WEIGHTS, board=True, re=re)  # published with the weights
        elif st.ts > child_ts:
            self.send(ident, Kind.WEIGHTS, st.weights, re=re)
        else:
            self.send(ident, Kind.UPTODATE, re=re)


class ChildAcks:
    """Rudra-adv*: no weights travel down the tree; every gradient is answered ACK."""

    def __init__(self, state: NodeState, send):
        self.state, self.send = state, send

    def check_pull(self, msg: wire.Message) -> None:
        """Raise ProtocolViolation: weights come by the learners' broadcast."""
        raise ProtocolViolation(
            f"{wire.sender_name(msg.sender)} sent {msg.kind.name}, but with "
            f"architecture.kind=advstar tree node {self.state.id} serves no weights: they "
            "come by the learners' broadcast; push gradients with PUSH"
        )

    def answer(self, ident: bytes, kind: Kind, child_ts: int, re: int) -> None:
        """ACK."""
        self.send(ident, Kind.ACK, re=re)
