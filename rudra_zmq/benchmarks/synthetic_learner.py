"""The torch-free learner of the cluster benchmarks (``synthetic_roles learners``): HELLO,
then "compute" by sleeping, PUSHPULL through the learner's own exchange (or, advstar, PUSH
plus a broadcast member) of a fixed gradient and a copy of the new weights, until STOP,
counting what it sent and received.

With ``layers`` (``--layers``; not advstar) it is no stand-in: it trains the synthetic model
of sleeping layers (``synthetic_model.py``, the module real DDP runs in ``lan_ddp.py``)
through the learner's own exchange, whose backward hooks push each part as backward
finishes it (``learner/buckets.py``); that imports torch."""

from __future__ import annotations

import random
import time

import numpy as np
import zmq

from .. import codec, kernels, timeline, wire
from ..channel import Channel
from ..learner.exchange import broadcast_member, make_exchange
from ..learner.links import ServerLinks, server_channels
from ..shape import ClusterShape
from ..wire import Kind

SIGNATURE = "bench-synthetic"  # the synthetic model's name, on the PS's side too


class SyntheticLearner:
    """One learner without a model: sleeps ``compute_s`` (±10 %), pushes a fixed gradient of
    ``numel`` float32 and copies any new weights into its own buffer, until STOP. Rudra-base
    and Rudra-adv go through the learner's own exchange (``learner/exchange.py``: every
    server of the cluster's shape its range, in its parts); Rudra-adv* is written out here
    (PUSH without waiting, weights by its broadcast member).

    ``run()`` blocks; owns its sockets (not thread-safe), shares the thread-safe ``ctx``.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        cfg,
        learner_id: int,
        endpoint: str,
        numel: int,
        compute_s: float,
        bcast: tuple[str, str | None] | None = None,
        layers: int = 0,
        push_after: bool = False,
    ):
        """``endpoint``: each server's (or its leaf in each range's tree), in range order,
        joined by ``+``. ``layers``: train the synthetic model of that many sleeping layers
        (``push_after``: every part after backward, as ``wire.push_during_backward`` false)."""
        self.id, self.numel, self.compute_s = learner_id, numel, compute_s
        self.rng = random.Random(learner_id)
        self.exchange = self.member = self.model = None
        if cfg.architecture.kind == "advstar":
            if layers:
                raise ValueError(
                    "--layers: the synthetic model runs through the exchange, not advstar"
                )
            self._advstar(ctx, cfg, endpoint, bcast)
        else:
            self._exchange(ctx, cfg, endpoint.split("+"), layers)
            if push_after and self.exchange.stream is not None:  # the learner before issue 42
                self.exchange.stream.close()
                self.exchange.stream = None

    def _exchange(self, ctx, cfg, endpoints, layers: int) -> None:
        """Push each server its slice through ``learner/exchange.py``, as learner/learner.py
        does."""
        from types import SimpleNamespace

        shape = ClusterShape.of(cfg, self.numel)
        self.links = ServerLinks(
            server_channels(ctx, cfg, shape, endpoints, self.id), shape.servers
        )
        if layers:
            flat = self._model(layers)
            self.w = flat.weights
        else:
            self.w = np.zeros(self.numel, np.float32)
            flat = SimpleNamespace(  # the exchange's view of a model: buffers and a name
                weights=self.w,
                grads=np.full(self.numel, 1e-3, np.float32),
                signature=SIGNATURE,
                numel=self.numel,
                weights_to_device=lambda: None,
            )
        self.exchange = make_exchange(cfg, shape, self.id, flat, self.links, ctx)
        itemsize = wire.PAYLOAD_DTYPES[codec.dtypes(cfg).gradients].itemsize
        self._step_bytes = self.numel * itemsize
        self.stats = {"learner": self.id, "steps": 0, "up_bytes": 0, "comm_s": 0.0}
        self.stats["compute_s"] = 0.0

    def _advstar(self, ctx, cfg, endpoint, bcast) -> None:
        """Rudra-adv*: one leaf, a broadcast member, as learner/learner.py."""
        self.ch = Channel(
            ctx,
            endpoint,
            self.id,
            name="parameter server",
            timeout_ms=int(cfg.runtime.timeout_s * 1000),
            hwm=4 + 2 * cfg.wire.parts,  # as the learner's
            retry_ms=int(cfg.runtime.retry_s * 1000),
            dtypes=codec.dtypes(cfg),
        )
        self.grad = np.full(self.numel, 1e-3, np.float32)  # sent zero-copy, never written
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        self.codec = codec.for_gradients(cfg)  # as the learner's: narrowed each step if half
        # one weight version's bytes on the wire (advstar counts versions, not frames)
        self._version_bytes = self.numel * wire.PAYLOAD_DTYPES[codec.dtypes(cfg).weights].itemsize
        self.w = np.zeros(self.numel, np.float32)
        self.ts = 0
        self.stats = {
            "learner": self.id,
            "steps": 0,
            "weights": 0,
            "up_bytes": 0,
            "down_bytes": 0,
            "comm_s": 0.0,
            "compute_s": 0.0,
        }
        self.member = broadcast_member(cfg, ctx, bcast, self.numel, self.id)
        self._sendbuf = np.empty_like(self.grad)

    def _model(self, layers: int):
        """The synthetic model of sleeping layers (its compute: ``compute_s``, a third of it
        forward) in a FlatModel named as the synthetic PS expects; one torch thread."""
        import torch

        from ..flat import FlatModel
        from .lan_ddp import FORWARD_SHARE
        from .synthetic_model import SleepModel

        class SleepFlat(FlatModel):
            signature = SIGNATURE

        torch.set_num_threads(1)
        ms = self.compute_s * 1000
        self.model = SleepModel(
            10, self.numel, layers, ms * FORWARD_SHARE, ms * (1 - FORWARD_SHARE)
        )
        self._x = torch.ones(2, 3, 4, 4)
        return SleepFlat(self.model)

    def _model_step(self) -> None:
        """Forward and backward of the synthetic model (its hooks push the parts). Blocks."""
        c0 = timeline.now_us()
        t0 = time.perf_counter()
        self.exchange.flat.zero_grad()
        self.model(self._x).sum().backward()
        self.stats["compute_s"] += time.perf_counter() - t0
        timeline.current().complete("compute", c0, timeline.now_us())

    def _run_exchange(self) -> dict:
        if self.model is not None:
            return self._run_model()
        s = self.stats
        s["t_start"] = time.time()
        alive, tl = True, timeline.current()
        while alive:
            t0 = time.perf_counter()
            c0 = timeline.now_us()
            if self.compute_s > 0:
                time.sleep(self.compute_s * self.rng.uniform(0.9, 1.1))
            t1 = time.perf_counter()
            c1 = timeline.now_us()
            alive = self.exchange.step(lambda: None)
            s["compute_s"] += t1 - t0
            s["comm_s"] += time.perf_counter() - t1
            tl.complete("compute", c0, c1)
            tl.complete("exchange", c1, timeline.now_us(), "wire")
            s["steps"] += 1
            s["up_bytes"] += self._step_bytes
        return self._finish(s)

    def _finish(self, s: dict) -> dict:
        """End a run of the exchange: its end time and channel counts into ``s``, then the
        exchange and links closed. Returns ``s``."""
        s["t_end"] = time.time()
        s.update(channel_counts(self.links.channels), rejoins=self.exchange.rejoins)
        self.exchange.close(True)
        self.links.close()
        return s

    def _run_model(self) -> dict:
        """As ``_run_exchange``, the compute being the model's forward and backward inside
        the exchange's step (``comm_s``: the rest of each step)."""
        s = self.stats
        s["t_start"] = time.time()
        alive, tl = True, timeline.current()
        while alive:
            t0, c0, before = time.perf_counter(), timeline.now_us(), s["compute_s"]
            alive = self.exchange.step(self._model_step)
            s["comm_s"] += time.perf_counter() - t0 - (s["compute_s"] - before)
            tl.complete("step", c0, timeline.now_us(), "wire")
            s["steps"] += 1
            s["up_bytes"] += self._step_bytes
        return self._finish(s)

    def _gradient(self) -> list:
        """The push's frames, encoded as the learner's are (float32: views; an advstar learner
        copies first, as its send buffer; half: narrowed, with error feedback)."""
        grad = self.grad
        if not self.codec.copies:
            kernels.copy_into(self._sendbuf, grad)
            grad = self._sendbuf
        parts = self.codec.encode(grad, self.chunk_bytes)
        self.stats["up_bytes"] += sum(p.nbytes for p in parts)
        return parts

    def _load(self, msg: wire.Message) -> None:
        codec.load(self.w, msg.payloads)
        self.ts = msg.ts
        self.stats["weights"] += 1
        self.stats["down_bytes"] += sum(p.nbytes for p in msg.payloads)

    def hello(self) -> None:
        """Say HELLO and wait for WELCOME (the first weights). Blocks."""
        if self.exchange is not None:
            if not self.exchange.start():
                raise RuntimeError(f"learner {self.id}: the servers said STOP at HELLO")
            return
        self.ch.send(Kind.HELLO, model=SIGNATURE, numel=self.numel)
        self._welcome = self.ch.recv({Kind.WELCOME}, numel=self.numel)

    def run(self) -> dict:
        """Train until STOP (after ``hello``); returns the learner's counters. Blocks."""
        if self.exchange is not None:
            return self._run_exchange()
        msg, self._welcome = self._welcome, None
        self.stats["t_start"] = time.time()
        return self._run_advstar(msg)

    def _run_advstar(self, welcome) -> dict:
        """Rudra-adv*, as ``learner/learner.py``: adopt the newest broadcast version, compute,
        collect the previous PUSH's ACK, PUSH the gradient without waiting for the reply."""
        s, in_flight, finished = self.stats, False, False
        self._load(welcome)
        try:
            while True:
                self.member.check()
                ts = self.member.copy_latest_into(self.w, self.ts)
                if ts != self.ts:
                    self.ts = ts
                    s["weights"] += 1
                    s["down_bytes"] += self._version_bytes
                grad_ts = self.ts
                t0 = time.perf_counter()
                if self.compute_s > 0:
                    time.sleep(self.compute_s * self.rng.uniform(0.9, 1.1))
                t1 = time.perf_counter()
                if in_flight:
                    reply = self.ch.recv({Kind.ACK})
                    in_flight = False
                    if reply.kind == Kind.STOP:
                        finished = True
                        break
                self.ch.send(Kind.PUSH, grad_ts, self._gradient())
                in_flight = True
                s["compute_s"] += t1 - t0
                s["comm_s"] += time.perf_counter() - t1
                s["steps"] += 1
        finally:
            self.member.close(stop_reason="training finished" if finished else None)
        s["t_end"] = time.time()
        s["bcast_versions"] = self.member.versions
        s.update(channel_counts([self.ch]))
        self.ch.close()
        return s


def channel_counts(channels) -> dict:
    """What a learner's channels count of slow and lost requests (summed): CHECKs sent,
    requests sent again, late answers dropped. Pure."""
    return {k: sum(getattr(ch, k) for ch in channels) for k in ("checks", "resent", "late")}
