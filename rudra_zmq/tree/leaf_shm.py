"""How a tree node takes its children's gradients and hands them weights, chosen at start
(``make_shared``): by shared memory with the learners on a leaf's host (:class:`LeafShm`,
``architecture.leaf_shm``) or by ZeroMQ payloads only (:class:`NoShm`: inner nodes, or the
option off). The node calls the same methods on either.

A learner says HELLO x{shm: token}; the leaf maps its two gradient slots (``shm.py``) and,
unless under advstar, makes one weight board for all its learners, answering WELCOME
x{shm: board token} ("" under advstar: no board). Such a learner then pushes x{slot} with no
payload and is answered WEIGHTS x{board: true}: each new version is published to the board
once. Whatever fails (no /dev/shm room, another host, a non-x86 CPU) leaves that learner on
ZeroMQ payloads; the board's name is unlinked once every learner below has pushed.

Not thread-safe: owned by the tree node's thread.
"""

from __future__ import annotations

import logging

from .. import shm, wire
from ..sync import ProtocolViolation

log = logging.getLogger("rudra_zmq.tree_node")


def make_shared(cfg, spec, advstar: bool):
    """The node ``spec``'s way with its children's memory: :class:`LeafShm` for a leaf with
    ``architecture.leaf_shm``, else :class:`NoShm`."""
    if cfg.architecture.leaf_shm and spec.is_leaf:
        return LeafShm(spec.id, spec.subtree, advstar)
    return NoShm()


class NoShm:
    """Children on ZeroMQ payloads only: no slot is mapped, no board is made. The wire refuses
    a push from a slot (``takes_slots`` False); a HELLO x{shm} is welcomed without x{shm}."""

    takes_slots = False  # wire.decode: no x{slot} pushes

    def hello(self, msg: wire.Message, numel: int, weights, ts: int) -> None:
        """Nothing to map."""

    def welcome_fields(self, learner: int) -> dict:
        """No x{shm}: the learner stays on payloads."""
        return {}

    def pieces(self, msg: wire.Message) -> list:
        """The gradient's frames."""
        return msg.payloads

    def pushed(self, ident: bytes, msg: wire.Message) -> None:
        """Nothing to note."""

    def on_board(self, ident: bytes) -> bool:
        """False: weights travel in frames."""
        return False

    def publish(self, ts: int, weights) -> None:
        """No board."""

    def close(self) -> None:
        """Nothing mapped."""


class LeafShm:
    """Node ``node_id``'s mapped slots and its board, for ``subtree`` (its learners)."""

    takes_slots = True  # wire.decode: a push may come from a slot (x{slot}, no payload)

    def __init__(self, node_id: int, subtree: frozenset, advstar: bool):
        self.id, self.subtree, self.advstar = node_id, subtree, advstar
        self.board: shm.WeightBoard | None = None  # made at the first shm HELLO
        self.slots: dict[int, shm.GradientSlots] = {}  # learner -> its mapped slots
        self.by_board: set[bytes] = set()  # children whose last push was by slot
        self._pushed: set[int] = set()  # learners that pushed (board unlink)
        self._no_shm: str | None = None  # why the board could not be made

    def hello(self, msg: wire.Message, numel: int, weights, ts: int) -> None:
        """A registered child's HELLO: map its slots if it offers them (x{shm}); ``weights``
        of ``ts`` are the parent's newest (None before its WELCOME)."""
        if "shm" in msg.fields:
            self.map_slots(msg.sender, msg.fields["shm"], numel, weights, ts)

    def map_slots(self, learner: int, token: str, numel: int, weights=None, ts: int = -1):
        """Map ``learner``'s slots (making the board first, once, with ``weights`` of ``ts``
        if the parent has answered). Any failure leaves that learner on payloads."""
        old = self.slots.pop(learner, None)  # a learner saying HELLO again
        if old is not None:
            old.close()
        try:
            if self._no_shm is not None:
                raise shm.ShmUnavailable(self._no_shm)
            if self.board is None and not self.advstar:
                try:
                    self.board = shm.WeightBoard.create(shm.new_token(), self.id, numel)
                except (shm.ShmUnavailable, OSError) as exc:
                    self._no_shm = f"no weight board: {exc}"
                    raise
                if weights is not None:
                    self.board.publish(ts, weights)
            self.slots[learner] = shm.GradientSlots.attach(token, self.id, learner, numel)
            log.info("tree node %d: learner %d trades through shared memory", self.id, learner)
        except (shm.ShmUnavailable, OSError, ValueError) as exc:
            log.warning(
                "tree node %d: learner %d stays on ZeroMQ payloads: %s", self.id, learner, exc
            )

    def welcome_fields(self, learner: int) -> dict:
        """WELCOME x{shm} for a learner whose slots are mapped (else nothing: declined)."""
        if learner not in self.slots:
            return {}
        return {"shm": self.board.token if self.board is not None else ""}

    def pieces(self, msg: wire.Message) -> list:
        """The gradient of a push: its slot (x{slot}) or its frames. Raises ProtocolViolation
        for a slot this node never mapped."""
        if not msg.in_shm:
            return msg.payloads
        if msg.sender not in self.slots:
            raise ProtocolViolation(
                f"{wire.sender_name(msg.sender)} pushed from a shared-"
                f"memory slot, but tree node {self.id} did not map its "
                "slots (no usable HELLO x{shm}); send the payload"
            )
        return [self.slots[msg.sender].slot(msg.fields["slot"])]

    def pushed(self, ident: bytes, msg: wire.Message) -> None:
        """A push was accepted: note how to answer its sender (board or frames); once every
        learner below has pushed, nobody maps the board anew and its name goes."""
        if msg.in_shm and self.board is not None:
            self.by_board.add(ident)
        else:
            self.by_board.discard(ident)
        if self.board is not None and wire.node_id(msg.sender) is None:
            self._pushed.add(msg.sender)
            if self.board.owner and self._pushed >= self.subtree:
                self.board.unlink()

    def on_board(self, ident: bytes) -> bool:
        """Whether the child on ``ident`` pushed its last gradient by slot: its weights are
        on the board (WEIGHTS x{board})."""
        return ident in self.by_board

    def publish(self, ts: int, weights) -> None:
        """New weights from the parent: onto the board, before any child is told to read it."""
        if self.board is not None:
            self.board.publish(ts, weights)

    def close(self) -> None:
        """Unmap everything (the board's creator unlinks it if still named)."""
        for seg in [*self.slots.values(), *([self.board] if self.board is not None else [])]:
            seg.close()
