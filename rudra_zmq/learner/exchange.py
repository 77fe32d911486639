"""How a learner trades gradients for weights: one class per way, chosen once at start
(:func:`make_exchange`).

- :class:`PushPull` (``base``, ``adv``): one PUSHPULL round trip per step to each server of
  the cluster's shape (``shape.ClusterShape``; one server is a set of one), each carrying
  that server's range of the gradient in that range's parts, stamped with that server's
  timestamp of the weights it was computed on; each reply is WEIGHTS (copied into the
  range) or UPTODATE, sent when the server's sync engine says: under hardsync after its
  update, so every learner starts the next step on the same weights.
- :class:`BroadcastPush` (``advstar``): push without waiting; weights arrive by the learners'
  broadcast on a :class:`~rudra_zmq.broadcast.member.BroadcastMember` I/O thread, and the
  newest complete version is adopted between steps.

How the bytes of each range travel to the first hop is its carrier's (``carriers.py``:
payload frames, or shared-memory slots with the leaf); what goes to which server, on which
socket, is the links' (``links.py``).

Rejoining: a server that answers ``rejoin`` (it restarted from a checkpoint, or evicted this
learner for silence) gets a new HELLO with the newest timestamp this learner saw; the
gradient it refused is dropped (at most once; with error feedback, its rounding residual
too), and the WELCOME's weights and data step (``on_welcome``) are where the learner goes on.

Not thread-safe: one learner thread owns its exchange.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import codec, topology, transport, wire
from ..channel import ServerError
from ..wire import Kind
from . import buckets, priority
from .carriers import make_carrier
from .links import ServersSilent, said_stop

log = logging.getLogger("rudra_zmq.learner")


class PushPull:
    """One PUSHPULL round trip per step to each server of the cluster's shape
    (``shape.ClusterShape``; Rudra-base: the servers, Rudra-adv: its leaf in each range's
    tree), each carrying the gradient's slice of that server's range, in that range's parts.
    One server is a set of one: the same steps with one range, the whole vector.

    Each server keeps its own timestamp: the slice sent to server k is stamped with server
    k's timestamp of the weights it was computed on, so staleness stays exact per server
    (docs/protocols.md). Every server's request is sent before any reply is awaited, so the
    servers work at once; a range in several parts (``wire.parts``) sends its parts in the
    order of :attr:`order` (every server's part 0, then every part 1, ...: the first parts
    of every range complete early) and decodes the reply's parts that come ahead.

    A server that answers ``rejoin`` (it restarted, or evicted this learner) gets a HELLO
    alone with the newest timestamp this learner saw; the slice it refused is dropped (with
    error feedback, its rounding residual too), the others' replies are taken, and the
    WELCOME's weights and data step (``on_welcome``, from the first server still training) are
    where it goes on. A server that says STOP has finished training; the learner goes on
    with the others (their ranges trained on the finished ones' final weights) and ends once
    every server has said STOP, or once the others stay silent for ``runtime.timeout_s``
    after one said it (a server that died after training ended, its STOP lost, with no
    restart to answer: the learner ends with a warning, not a failure; the run's result is the
    servers' and the statistics server's to report). The servers finish at the same count of
    gradients, but under softsync the gradient that ends server 0 may be another learner's than
    the one that ends server 1 (one step more), and a server restarted from a checkpoint counts
    again the gradients it lost (as many steps more).
    """

    def __init__(self, learner_id: int, flat, links, shape, carriers):
        """``links``: a ``links.ServerLinks`` (or anything with its ``channels`` and
        ``gather``); ``shape``: the cluster's shape, sized to the model; ``carriers``: one
        per server (``make_carrier``)."""
        self.id, self.flat, self.links = learner_id, flat, links
        self.servers, self.carriers = shape.servers, list(carriers)
        # each striped server's weights land here first, then go to their places in the model
        self.local = [
            None if s.share.contiguous else np.empty(s.share.numel, np.float32)
            for s in self.servers
        ]
        self.stamps = [-1] * len(self.servers)  # each server's timestamp of our weights
        self.active = list(range(len(self.servers)))  # the servers still training
        # the parts' send order: every server's first part, then every second part, ...
        self.order = sorted(
            ((s.index, j) for s in self.servers for j in range(len(s.parts))),
            key=lambda kj: (kj[1], kj[0]),
        )
        self.rejoins = 0
        self.on_welcome = lambda step: None  # the learner repositions its data here
        self.data_step = lambda: None  # the learner's next data step (said in a rejoin's HELLO)
        # a rejoining HELLO carries this learner's copy of the range (Rudra-base: a server
        # restarted without a checkpoint takes its range back from the freshest one), in
        # frames of at most ``chunk_bytes``
        self.send_copy, self.chunk_bytes = False, wire.DEFAULT_CHUNK_BYTES
        self.stream = None  # a buckets.StreamedPush: the parts leave during backward
        self.prio = self.early = None  # wire.priority (``priority.py``): see ``prioritize``
        self.gathering = None  # the replies outstanding while the next forward runs

    @property
    def ts(self) -> int:
        """The first server's timestamp of the weights held (for progress records)."""
        return self.stamps[0]

    def _into(self, k: int):
        """Where server ``k``'s weights are loaded: its range of the model's weights (a view),
        or for stripes its local buffer (``_placed`` puts them in the model)."""
        local = self.local[k]
        return self.servers[k].share.gather(self.flat.weights) if local is None else local

    def _placed(self, k: int) -> None:
        """Server ``k``'s striped weights, loaded, to their places in the model (one copy)."""
        if self.local[k] is not None:
            self.servers[k].share.scatter(self.local[k], self.flat.weights)

    def _hello(self, k: int) -> None:
        """HELLO to server ``k``; rejoining (weights loaded from it before), with the
        timestamp they had there (x{had}), the next data step (x{step}) and, with
        ``send_copy``, this learner's copy of its range at that timestamp (a copy: the
        weights may change before the request is done with)."""
        had, copy = {}, ()
        if self.stamps[k] >= 0:
            had = {"had": self.stamps[k]}
            step = self.data_step()
            if step is not None:
                had["step"] = int(step)
            if self.send_copy:
                copy = wire.chunk(
                    self.servers[k].share.gather(self.flat.weights).copy(), self.chunk_bytes
                )
        self.links.channels[k].send(
            Kind.HELLO,
            0,
            copy,
            model=self.flat.signature,
            numel=self.flat.numel,
            range=self.servers[k].share.key,
            **had,
            **self.carriers[k].hello_fields,
        )

    def take_finished(self, finished: dict) -> None:
        """Before :meth:`start`: the servers in ``finished`` ({k: (timestamp, weights of its
        range)}, ``end_files.finished_ranges``) ended training before this learner started (it
        was restarted) and may be gone: their ranges are loaded from those final weights and
        they are left out of every request, as if they had said STOP. Does not block."""
        for k, (ts, w) in sorted(finished.items()):
            if k not in self.active:
                continue
            self._into(k)[:] = w
            self._placed(k)
            self.stamps[k] = ts
            self.active.remove(k)
        if finished:
            log.info(
                "learner %d: servers %s finished training before it started: their ranges "
                "are their final weights; going on with %s",
                self.id,
                sorted(finished),
                self.active,
            )

    def start(self, which=None) -> bool:
        """Say HELLO to the servers ``which`` (default all still training) and load their
        WELCOMEs' ranges. Blocks; False once every server has said STOP."""
        which = list(self.active if which is None else which)
        for k in which:
            self._hello(k)
        replies = self.links.gather(which, {Kind.WELCOME})
        if self._stopped(replies):
            return False
        for k in sorted(replies):
            msg = replies[k]
            if isinstance(msg, ServerError):
                raise msg
            self._load(k, msg)
            self.carriers[k] = self.carriers[k].welcomed(msg)
        self.flat.weights_to_device()
        lead = self.active[0]  # the data order goes on where the first server training says
        if lead in replies:
            self.on_welcome(replies[lead].fields.get("step"))
        return True

    def _load(self, k: int, msg: wire.Message) -> None:
        self.stamps[k] = self.carriers[k].load(msg, self._into(k))
        self._placed(k)

    def push(self) -> None:
        """Send every server still training its slice of the gradient (a range in parts:
        in the order of :attr:`order`). Does not block."""
        grads, msgs = self.flat.grads, {}
        for k in self.active:
            server, ch = self.servers[k], self.links.channels[k]
            if len(server.parts) > 1:
                parts = self.carriers[k].share_parts(grads, server)
                msgs[k] = ch.parts(Kind.PUSHPULL, self.stamps[k], parts, self._into(k))
            else:  # a range in one part: one whole message
                payloads, fields = self.carriers[k].gradient(server.share.gather(grads))
                ch.send(Kind.PUSHPULL, self.stamps[k], payloads, **fields)
        for k, j in self.order:
            if k in msgs:
                self.links.channels[k].send_part(msgs[k][j])

    def _requests(self) -> dict:
        """Each active server's request as send calls (``buckets.request_calls``), its
        payloads views of the gradient read when sent. Does not block."""
        return {
            k: buckets.request_calls(
                self.links.channels[k],
                self.stamps[k],
                self.carriers[k],
                self.flat.grads,
                self.servers[k],
                self._into(k),
            )
            for k in self.active
        }

    def prioritize(self, shape) -> None:
        """``wire.priority``: the parts leave lowest offset first and the next forward runs
        each layer once its weights are in (``priority.py``). Needs ``stream``."""
        self.prio = priority.PriorityPush(
            self.links.channels, [len(s.parts) for s in self.servers], self._parts_request
        )
        self.early = priority.EarlyWeights(self.flat, shape, self._poll_early, self._settle)
        for k, ch in enumerate(self.links.channels):
            ch.on_part = lambda at, n, k=k: self.early.arrived(k, at, n, self.local[k])

    def push_after_backward(self) -> None:
        """Every part leaves after backward (a straggler's sleep comes first): no stream,
        no priority."""
        for x in (self.stream, self.early):
            if x is not None:
                x.close()
        self.stream = self.prio = self.early = None
        for ch in self.links.channels:
            ch.on_part = None

    def _parts_request(self, k: int) -> tuple[list, list]:
        """Server ``k``'s request in parts, none of them yet marked last (``PriorityPush``
        picks it when it sends it), and each part's ``fill()``, which encodes it from the
        gradient as it is then (``Frames.share_parts_later``). Does not block."""
        parts = self.carriers[k].share_parts_later(self.flat.grads, self.servers[k])
        msgs = self.links.channels[k].parts(
            Kind.PUSHPULL, self.stamps[k], [(at, f) for at, f, _ in parts], self._into(k), last=-1
        )
        return msgs, [fill for _, _, fill in parts]

    def step(self, backward) -> bool:
        """``backward()`` fills the gradient; push each server its slice and take the newer
        weights of each range. Blocks for every reply; False once every server said STOP.
        With ``stream``, each part leaves as backward finishes it. With ``early``
        (``wire.priority``) the replies are taken by the next step's forward instead
        (``_step_early``): this returns once the parts are queued."""
        if self.early is not None:
            return self._step_early(backward)
        if self.stream is not None:
            self.stream.push(backward, self._requests())
        else:
            backward()
            self.push()
        try:
            replies = self.links.gather(list(self.active), {Kind.WEIGHTS, Kind.UPTODATE})
        except ServersSilent as exc:
            return self._silent_after_stop(exc)
        if self._stopped(replies):
            return False
        rejoin, loaded = self._refusals(replies), False
        for k in sorted(replies):
            msg = replies[k]
            if isinstance(msg, wire.Message) and msg.kind == Kind.WEIGHTS:
                self._load(k, msg)
                loaded = True
        if loaded:
            self.flat.weights_to_device()
        if rejoin:
            return self.rejoin(rejoin)
        return True

    def _step_early(self, backward) -> bool:
        """``step`` with ``wire.priority``: the forward inside ``backward()`` takes the
        previous step's replies as its layers need them and settles them at its end; the
        parts go lowest offset first, and this returns with them queued (the next step's
        forward sends the rest as it waits). A previous reply that ends the step otherwise
        (STOP, a rejoin) abandons this one before its backward: False once every server
        said STOP."""
        if self.gathering is None:
            self.prio.begin(self.active)
        try:
            self.stream.push(backward, self.prio.calls())
        except _Abandoned as end:
            self.prio.drop()
            return end.alive
        if self.gathering is not None:  # a forward that never reached the model's root
            raise RuntimeError(
                "wire.priority: the model's forward did not return from its root module "
                "before backward; run it with wire.priority=false"
            )
        self.gathering = self.links.gathering(list(self.active), {Kind.WEIGHTS, Kind.UPTODATE})
        self._taken = set()
        self.early.expect(self.active)
        return True

    def _poll_early(self, wait_ms: int) -> None:
        """Send what the push queues allow, wait up to ``wait_ms`` for the outstanding
        replies, and load each that came (a part ahead is loaded as it comes)."""
        g = self.gathering
        busy = self.prio.pump()
        if g is None:
            return
        try:
            g.poll(min(wait_ms, 1) if busy else wait_ms)
        except ServersSilent as exc:  # the forward waits no more: the step ends here
            self.gathering = None
            self.early.loaded = [True] * len(self.early.loaded)
            raise _Abandoned(self._silent_after_stop(exc)) from None
        for k in set(g.out) - self._taken:
            self._taken.add(k)
            msg = g.out[k]
            if isinstance(msg, wire.Message) and msg.kind == Kind.WEIGHTS:
                self._load(k, msg)
            self.early.server_in(k)

    def _settle(self) -> None:
        """The forward ran (the model's root returned): take every outstanding reply; raise
        ``_Abandoned`` when one ends the step otherwise (STOP, rejoin, silence)."""
        if self.gathering is None:
            return
        while self.gathering.pending:
            self._poll_early(transport.WAKE_MS)
        replies, self.gathering = self.gathering.out, None
        if self._stopped(replies):
            raise _Abandoned(False)
        rejoin = self._refusals(replies)
        self.flat.weights_to_device()
        if rejoin:
            raise _Abandoned(self.rejoin(rejoin))
        self.prio.begin(self.active)

    @staticmethod
    def _refusals(replies: dict) -> list:
        """The servers in ``replies`` that asked for a new HELLO, as (index, ServerError)
        pairs for ``rejoin``; any other refusal is raised."""
        rejoin = []
        for k in sorted(replies):
            msg = replies[k]
            if isinstance(msg, ServerError):
                if msg.code != "rejoin":
                    raise msg
                rejoin.append((k, msg))
        return rejoin

    def rejoin(self, refused: list) -> bool:
        """The servers in ``refused`` ((index, ServerError) pairs) asked for a new HELLO: say
        it to each (see the class docstring). Blocks."""
        for k, _ in refused:  # each refused slice's error-feedback residual goes with it
            self.carriers[k].refused()
        self.rejoins += len(refused)
        log.warning(
            "learner %d: rejoining servers %s (%s)",
            self.id,
            [k for k, _ in refused],
            "; ".join(str(exc) for _, exc in refused),
        )
        return self.start([k for k, _ in refused])

    def _stopped(self, replies: dict) -> bool:
        """Take the servers in ``replies`` that said STOP (training over there) out of
        ``active`` (their replies are removed); whether none is left."""
        stop = said_stop(replies)
        for k in stop:
            del replies[k]
            self.active.remove(k)
        if stop and self.active:  # once per reply, not per server
            log.info(
                "learner %d: servers %s finished training; going on with %s",
                self.id,
                sorted(stop),
                self.active,
            )
        return not self.active

    def _silent_after_stop(self, exc: ServersSilent) -> bool:
        """Servers silent for the whole timeout: a failure while every server is training;
        once one has said STOP (before or among ``exc.replies``) training is over, and the
        learner ends (False) with a warning naming the silent ones. Raises ``exc`` otherwise."""
        said = said_stop(exc.replies)
        if len(self.active) == len(self.servers) and not said:
            raise exc
        log.warning(
            "learner %d: servers %s finished training and %s has said nothing since: %s; "
            "ending here without its STOP",
            self.id,
            [k for k in range(len(self.servers)) if k not in self.active or k in said],
            exc.silent,
            exc,
        )
        self.active = []
        return False

    def close(self, finished: bool) -> None:
        """Release the carriers and the backward hooks (the learner closes the links)."""
        for x in (self.stream, self.early):  # the hooks off the model (counts kept)
            if x is not None:
                x.close()
        for c in self.carriers:
            c.close()


class _Abandoned(Exception):
    """The previous step's replies end this step before its backward (``_settle``):
    ``alive`` is what ``step`` returns."""

    def __init__(self, alive: bool):
        super().__init__(alive)
        self.alive = alive


class BroadcastPush(PushPull):
    """Rudra-adv*: PUSH to the leaf without waiting; weights by the learners' broadcast.
    One server (``architecture.kind=advstar`` refuses more): the shape's one range."""

    def __init__(self, cfg, learner_id: int, flat, links, shape, carriers, ctx, bcast):
        super().__init__(learner_id, flat, links, shape, carriers)
        (self.ps,) = links.channels  # its leaf
        self.member = broadcast_member(cfg, ctx, bcast, flat.numel, learner_id)
        self._in_flight = False

    def start(self, which=None) -> bool:
        """HELLO, then wait (bounded by runtime.timeout_s) until the first version came down
        the broadcast, so a learner whose upstream is not up yet does not train blind."""
        if not super().start(which):
            return False
        while self.member.latest_version() is None:
            self.member.check()
            time.sleep(0.01)
        return True

    def step(self, backward) -> bool:
        """Adopt the newest broadcast version, compute, collect the previous push's ACK and
        PUSH this gradient without waiting. Blocks only for that ACK; False after STOP."""
        self.member.check()  # the broadcast I/O thread failed: a silent upstream
        ts = self.stamps[0]
        self.stamps[0] = self.member.copy_latest_into(self.flat.weights, ts)
        if self.stamps[0] != ts:
            self.flat.weights_to_device()
        grad_ts = self.stamps[0]
        backward()
        if self._in_flight:
            self._in_flight = False
            try:
                if self.ps.recv({Kind.ACK}).kind == Kind.STOP:
                    return False
            except ServerError as exc:
                if exc.code != "rejoin":
                    raise
                return self.rejoin([(0, exc)])
        payloads, fields = self.carriers[0].gradient(self.flat.grads)
        self.ps.send(Kind.PUSH, grad_ts, payloads, **fields)
        self._in_flight = True
        return True

    def close(self, finished: bool) -> None:
        """Stop the broadcast member (a learner that leaves passes STOP to its children)."""
        super().close(finished)
        self.member.close(stop_reason="training finished" if finished else None)


def make_exchange(cfg, shape, learner_id: int, flat, links, ctx, bcast=None):
    """The learner's exchange, chosen once: BroadcastPush (``architecture.kind`` advstar) or
    PushPull, over ``links`` to the servers of ``shape`` (sized to ``flat``), with one
    carrier per server's range (``make_carrier``)."""
    carriers = []
    try:
        for server in shape.servers:
            carriers.append(make_carrier(cfg, learner_id, server.share.numel))
        if cfg.architecture.kind == "advstar":
            return BroadcastPush(cfg, learner_id, flat, links, shape, carriers, ctx, bcast)
        ex = PushPull(learner_id, flat, links, shape, carriers)
        # a restarted server (Rudra-base) or tree root (Rudra-adv: through the new leaf)
        # takes its range back from the freshest copy a rejoining learner sends
        ex.send_copy = cfg.architecture.kind in ("base", "adv")
        ex.chunk_bytes = cfg.runtime.chunk_mib << 20
        if (  # parts leave during backward where there are parts and they can
            cfg.wire.push_during_backward
            and len(shape.parts) > 1
            and buckets.enabled(flat, carriers)
        ):
            ex.stream = buckets.StreamedPush(flat, shape.servers)
            if cfg.wire.priority and all(len(s.parts) > 1 for s in shape.servers):
                ex.prioritize(shape)
        return ex
    except BaseException:
        for c in carriers:
            c.close()
        raise


def broadcast_member(cfg, ctx, bcast, numel: int, learner_id: int):
    """Learner ``learner_id``'s place in Rudra-adv*'s broadcast, started: ``bcast`` is its
    (upstream, bind) endpoints; its children and upstream come from the run's topology. Raises
    ValueError naming the missing option. Used by the learner and the synthetic learner."""
    from ..broadcast.member import BroadcastMember

    if not bcast or not bcast[0]:
        raise ValueError(
            f"learner {learner_id}: architecture.kind=advstar needs its "
            "broadcast upstream (rudra-zmq learner --bcast-upstream EP)"
        )
    up = topology.broadcast_upstream(cfg, learner_id)
    kids = topology.broadcast_children(cfg, learner_id)
    if kids and not bcast[1]:
        raise ValueError(
            f"learner {learner_id} forwards the broadcast to learners {kids}: "
            "give it an endpoint to bind (--bcast-bind EP)"
        )
    return BroadcastMember(
        ctx,
        bcast[1] if kids else None,
        bcast[0],
        numel,
        member=learner_id,
        children=kids,
        chunk_bytes=cfg.runtime.chunk_mib << 20,
        timeout_s=cfg.runtime.timeout_s,
        upstream_name="the root" if up is None else f"learner {up}",
        dtypes=codec.dtypes(cfg),
    ).start()
