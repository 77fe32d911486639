"""What the sync engine answers (``rudra_zmq.sync``): an ``Arrival`` per gradient and the
``Update`` it completes, with the update's metrics record. Frozen values; pure."""

from __future__ import annotations

from dataclasses import dataclass

from .rules import NOW, Reply


@dataclass(frozen=True)
class Update:
    """One weight update as decided by the engine.

    ``timestamp`` is the PS timestamp the update produces (the previous one + 1);
    ``learners``/``timestamps``/``sigmas`` are the vector clock of the gradients it averages,
    in arrival order; the PS applies ``w ← step(w, lr, g_scale · Σ scaleᵢ·gᵢ)``.
    """

    timestamp: int
    learners: tuple[int, ...]
    timestamps: tuple[int, ...]
    sigmas: tuple[int, ...]
    mean_sigma: float
    lr: float
    g_scale: float
    epoch: float
    protocol: str | None = None  # the protocol it was made under, where it changes (stages)

    def record(self, t: float) -> dict:
        """The metrics record of this update made at time ``t`` (Unix, or simulated). Pure."""
        rec = {
            "type": "update",
            "ts": self.timestamp,
            "t": t,
            "epoch": self.epoch,
            "mean_sigma": self.mean_sigma,
            "sigmas": list(self.sigmas),
            "lr": self.lr,
            "n_grads": len(self.sigmas),
        }
        if self.protocol is not None:
            rec["protocol"] = self.protocol
        return rec


@dataclass(frozen=True)
class Arrival:
    """The engine's answer to one gradient: its σ, its scale, the update it completes, and
    when its sender may have its reply (``reply``; see :meth:`SyncEngine.reply`)."""

    learner: int
    timestamp: int
    sigma: int
    scale: float
    update: Update | None
    reply: Reply = NOW
