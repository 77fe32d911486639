"""The parameter server: a serve loop, one handler per message kind, and its state.

One thread owns the ROUTER socket and the ``ServerState`` (weights, momentum, sum, sync
engine, registrations), so the update needs no lock; the heavy work runs in the compiled
kernels with the GIL released. ZeroMQ's I/O thread moves the bytes.

Every request takes the servers' one request path (``serving.py``: decode, authorise, the
state's sender check, STOP once training is over) before anything changes; a refused request
gets an ERROR reply and leaves the weights bit-identical. Handlers:

- HELLO: register the learner or tree node (model signature and size checked), reply WELCOME
  with the weights;
- PUSH / PUSHPULL: one learner's gradient, read in place from its frames; RELAY: a tree
  node's sum with its vector clock (Rudra-adv). The sync engine decides whether it completes
  an update; the reply comes from the way this run hands out weights (``weights.py``):
  weights in replies, or ACK and the learners' broadcast (Rudra-adv*);
- PULL: weights if newer, else UPTODATE, when the sync engine says (hardsync: parked until
  the update the puller's gradient is in);
- BYE (answered by ``serving.py``): the sender leaves (a tree node's BYE covers the learners
  below it).

Failures (``docs/fault-tolerance.md``): a gradient sent again (same sequence number) is
answered as before and applied once; a learner silent for ``runtime.learner_timeout_s`` is
evicted (``liveness.py``) and the protocol goes on with the others (λ and c are reported),
and it rejoins with a HELLO; the state is checkpointed (``checkpointing.py``) and a restarted
server continues from the newest valid checkpoint as a new incarnation (``start.py``).

Weights are never copied: replies send the current version zero-copy, and the update writes
the next version into another buffer (``versions.WeightVersions``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import zmq

from .. import codec, kernels, transport, wire
from ..config_architecture import most_parts
from ..notices import notice
from ..outbox import Outbox
from ..shape import ClusterShape
from ..wire import Kind
from .arrival_log import ArrivalLog
from .checkpointing import CheckpointSchedule, launch_session
from .end_files import assemble, write_end_files
from .journal import Journal
from .liveness import Liveness
from .recovery import Recovery
from .report import EvalSchedule, PSReport
from .restart_record import RestartHistory
from .serving import Serving
from .start import start_state
from .weights import make_weights_out

log = logging.getLogger("rudra_zmq.ps")

WAIT_MS = 100  # the longest the serving loop waits in libzmq before looking at its clocks
OVER_STATS_WAIT_MS = 3000  # restarted after training ended: the stats server may be gone


class ParameterServer:
    """A parameter server bound at ``bind``; ``serve_forever()`` runs it in the calling thread.

    Args:
        cfg: the run's Config.
        bind: endpoint to bind (``tcp://HOST:0`` picks a port; see ``.endpoint``).
        stats: the statistics server's endpoint, or None.
        run_dir: where to write ``weights.npy`` at the end, or None.
        model: optional (weights, segments, signature) to skip building the torch model
            (benchmarks with synthetic gradients).
        broadcast: architecture.kind advstar only: the endpoint the broadcast root binds.
        resume: continue from the newest valid checkpoint in ``run_dir/checkpoints`` (if any)
            as a new incarnation.
        server: which of the run's parameter servers this is (``shape.ClusterShape``: 0 ..
            ``architecture.servers`` - 1): it serves that server's range of the flat vector
            (the whole vector when there is one), writes its files where the shape says
            (``Server.files_dir``) and names itself in its records and EVALs as the shape says.
    Not thread-safe: construct and serve from one thread.
    """

    def __init__(
        self,
        cfg,
        bind: str,
        stats: str | None = None,
        run_dir: str | None = None,
        ctx: zmq.Context | None = None,
        model=None,
        broadcast: str | None = None,
        resume: bool = False,
        server: int = 0,
    ):
        self.shape = ClusterShape.of(cfg)
        self.place = self.shape.server(server)  # its range once the model is built (start)
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        self.files_dir = self.place.files_dir(self.run_dir) if self.run_dir else None
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        # A new server binds before it builds its model (the socket needs only the config):
        # learners waiting for this endpoint start while it imports torch, and what they send
        # waits in the socket until serve_forever reads it, with the state built; none of
        # them leaves meanwhile. A restarted (resumed) one builds first: learners may leave
        # while an unread socket holds them, which can abort libzmq 4.3.5 (as for the
        # statistics server, docs/fault-tolerance.md). No ROUTER_HANDOVER: a restarted learner
        # comes back on a new connection (a new routing id) and says HELLO; no one else can
        # take over a live learner's name.
        self.sock = transport.make_socket(
            self.ctx,
            zmq.ROUTER,
            hwm=max(64, 4 * cfg.sync.learners, 2 * most_parts(cfg) + 8),  # parts ahead
            max_bytes=transport.frame_limit(cfg.runtime.chunk_mib << 20),
            sndbuf=cfg.runtime.sndbuf_kib << 10,
        )
        self.out = Outbox(self.sock, head=2)  # replies; weights in chunks tracked (outbox)
        try:
            if not resume:
                self.endpoint = transport.bind(self.sock, bind)
            self._build(cfg, model, resume, stats, broadcast)
            if resume:
                self.endpoint = transport.bind(self.sock, bind)
        except BaseException:  # e.g. no data, a bad checkpoint: free the port at once
            self.sock.close(linger=0)
            if self._own_ctx and getattr(self, "stats", None) is None:  # nothing else open
                transport.term(self.ctx)
            raise

    def _build(self, cfg, model, resume: bool, stats: str | None, broadcast: str | None) -> None:
        """The state (the model built, or the newest checkpoint restored: ``start``) and
        the outputs; called with the socket bound. Blocks while torch is imported and the
        model built."""
        self.state, self.told, self.resumed_from, self.place = start_state(
            cfg, model, self.run_dir, resume, self.place.index
        )
        if self.files_dir is not None:
            self.files_dir.mkdir(parents=True, exist_ok=True)
        # restarted (Rudra-base, or a Rudra-adv tree's root; training not over): the range
        # comes back from the freshest copy the learners hold (a root: the one each of its
        # nodes passes up) when it is newer than the checkpoint, or there is none
        # (``recovery.py``); their HELLOs are held until then
        self.recovery = None
        if resume and cfg.architecture.kind in ("base", "adv") and not self.state.done:
            window = 2 * cfg.runtime.retry_s + 1  # one round of rejoins, a CHECK's too
            tree = self.state.tree
            peers = self.state.learners if tree is None else len(tree.children_of(None))
            self.recovery = Recovery(peers, self.state.numel, window)
        self.history = RestartHistory(
            self.files_dir, launch_session(), resume, len(self.state.incarnations)
        )
        if self.recovery is None:
            origin = "initial" if self.resumed_from is None else "checkpoint"
            eng = self.state.engine
            self.history.record(
                self.place.index, origin, eng.timestamp, 0, eng.epoch, self.resumed_from
            )
        if self.run_dir is not None and self.state.tree is None:  # for `rudra-zmq replay`
            self.state.log = ArrivalLog(self.files_dir, self.state.incarnation)
        # restarted after training ended: the statistics server may have finished already
        self.over_at_start = self.state.done
        t = cfg.train
        self.checkpoints = None
        if self.run_dir is not None and (t.checkpoint_every_s or t.checkpoint_every_updates):
            self.checkpoints = CheckpointSchedule(
                t, self.place.checkpoint_dir(self.run_dir), self.state.engine.timestamp
            )
        self.stats = None
        if stats:
            from ..stats.client import StatsClient

            self.stats = StatsClient(
                self.ctx,
                stats,
                wire.SENDER_PS,
                **({"done_wait_ms": OVER_STATS_WAIT_MS} if self.over_at_start else {}),
            )
        self.weights_out = make_weights_out(cfg, self.state, self.send, self.ctx, broadcast)
        kept = Journal(self.files_dir, "members", self.history.starts, resume)
        self.metrics = PSReport(self.stats, self.place, kept)
        self.evals = EvalSchedule(cfg.train, self.state.engine.epoch)
        self.liveness = Liveness(cfg.runtime)  # whom to evict, when to give up
        self.serving = Serving(
            self.sock,
            wire.SENDER_PS,
            self.state,
            {
                Kind.HELLO: self.on_hello,
                Kind.PUSH: self.on_gradient,
                Kind.PUSHPULL: self.on_gradient,
                Kind.RELAY: self.on_gradient,
                Kind.PULL: self.weights_out.pull,
            },  # weights if newer, else UPTODATE or held
            send=self.send,
            stop=self._stop,
            learners=self.state.learners,
            log=log,
            heard=self.state.heard,
            dtypes=codec.dtypes(cfg),
            parts=self.state.parts is not None,
        )

    # ------------------------------------------------------------------ sending
    def send(self, ident: bytes, kind: Kind, payloads=(), ts: int | None = None, **fields) -> None:
        """Send one message to ``ident``, stamped with the current timestamp (or ``ts``: parts
        of the next version sent ahead). Never blocks: each peer has at most one request in
        flight, so a full queue means it misbehaves, and the reply is dropped (and counted)
        rather than stalling the server."""
        st = self.state
        st.counters.sent += 1
        frames = wire.encode(
            kind,
            wire.SENDER_PS,
            st.counters.sent,
            st.engine.timestamp if ts is None else ts,
            st.incarnation,
            payloads,
            **fields,
        )
        if not self.serving.deliver(self.out, ident, frames, kind, self.cfg.runtime.retry_s):
            st.counters.undelivered += 1

    def _stop(self, ident: bytes, sender: int, seq: int) -> None:
        self.state.mark_stopped(sender)
        if self.told is not None:
            self.told.save(self.state)  # before the STOP (see ToldRecord)
        self.send(
            ident,
            Kind.STOP,
            re=seq,
            reason=f"training finished at epoch {self.state.engine.epoch:.2f}",
        )

    # ------------------------------------------------------------------ handlers
    def handle(self, frames) -> None:
        """Process one ROUTER message (routing id first) down the request path
        (``Serving.handle``). Never raises for bad input."""
        self.serving.handle(frames)

    def on_hello(self, ident: bytes, msg: wire.Message) -> None:
        """Register the sender (a learner rejoins at the current timestamp) and send it the
        weights when the engine says: under hardsync a learner whose gradient is in the
        pending update gets its WELCOME with the next version (it would otherwise push twice
        for this one)."""
        st = self.state
        lost = st.counters.lost_updates
        st.register(ident, msg)
        # a learner's (a root: a tree node's) HELLO is held until the range is back
        if self.recovery is not None and (msg.sender >= 0) == (st.tree is None):
            self.recovery.offer(ident, msg, time.time())
            self._recover_if_due()
            return
        if st.counters.lost_updates > lost:
            had = msg.fields["had"]
            notice(
                log,
                "%s had seen timestamp %d, the state this server restarted from (a "
                "checkpoint or a learner's copy) holds %d: %d updates lost in the restart",
                wire.sender_name(msg.sender),
                had,
                st.restored_ts,
                had - st.restored_ts,
            )
        if st.done and not st.share.is_whole and "had" not in msg.fields:
            # a new learner (restarted, or the run resumed) holds none of this part of the
            # vector: it needs these final weights to train the other servers' ranges on, not
            # a STOP (it would train them on its initial ones); its next request is told STOP
            self._welcome(ident, msg.sender, msg.seq)
            return
        self._admit(ident, msg.sender, msg.seq)

    def _admit(self, ident: bytes, sender: int, seq: int) -> None:
        """A registered sender's HELLO: STOP after training, else it joins and is welcomed
        when the engine says."""
        st = self.state
        if st.done:  # after training: a planned sender with this model is told STOP
            self._stop(ident, sender, seq)
            return
        if st.join(sender, time.time()):
            self._members_changed(sender, "joined")
        if st.admit(ident, sender, seq):  # else held until the engine says
            self._welcome(ident, sender, seq)

    def _recover_if_due(self) -> None:
        """Once every learner said HELLO, or the window since the first passed, resume from
        the freshest copy they gave back (``recovery.py``), say what was lost, and welcome
        every HELLO held."""
        rec = self.recovery
        if rec is None or not rec.due(time.time()):
            return
        self.recovery, got, st = None, rec.result(), self.state
        for learner, why in got.refused:
            notice(log, "refused learner %d's copy of range %s: %s", learner, st.share, why)
        eng, ckpt = st.engine, st.restored_ts
        if got.weights is not None and (ckpt is None or got.ts > ckpt):
            st.adopt(got)
            origin = got.origin
            notice(
                log,
                "took range %s back from %s's copy at timestamp %d (epoch %.2f; %s); %s",
                st.share,
                got.origin,
                got.ts,
                eng.epoch,
                "no checkpoint" if ckpt is None else f"newer than the checkpoint's {ckpt}",
                f"the newest timestamp a learner had seen is {got.newest}: {got.lost} updates "
                "lost in the restart"
                if got.lost
                else "no learner had seen a newer one",
            )
        elif ckpt is None:  # no copy, no checkpoint: the range starts over
            st.adopt(got)
            origin = "initial"
            notice(
                log,
                "no learner holds a copy of range %s and there is no checkpoint: it starts "
                "over from the initial weights (%d updates lost)",
                st.share,
                got.lost,
            )
        else:  # the checkpoint is as fresh as any copy: it stands (it has the momentum)
            origin = "checkpoint"
            if st.lost_now:
                notice(
                    log,
                    "the newest timestamp a learner had seen is %d, the checkpoint this "
                    "server restarted from holds %d: %d updates lost in the restart",
                    got.newest,
                    ckpt,
                    st.lost_now,
                )
        lost = st.lost_now
        self.history.record(
            self.place.index, origin, st.restored_ts, lost, eng.epoch, self.resumed_from
        )
        self.metrics.restart(self, self.history.current)
        self.evals = EvalSchedule(self.cfg.train, eng.epoch)
        if self.checkpoints is not None and origin != "checkpoint":
            self.checkpoints.save(st)  # what it took back, and this incarnation, durable
        # the weights it goes on from: the evaluation of an epoch boundary it crossed as it
        # died may never have left it (with several servers, this slice joins the others')
        self.metrics.evaluate(st)
        for h in rec.held:
            self._admit(h.ident, h.sender, h.seq)

    def _welcome(self, ident: bytes, sender: int, seq: int) -> None:
        """WELCOME with the weights and where the data stream of the sender (a learner) or
        of each learner below it (a tree node) goes on."""
        self.send(
            ident,
            Kind.WELCOME,
            self.state.weight_frames(),
            re=seq,
            learners=self.cfg.sync.learners,
            protocol=self.cfg.sync.protocol,
            **self.state.where(sender),
        )

    def on_gradient(self, ident: bytes, msg: wire.Message) -> None:
        """PUSH, PUSHPULL or RELAY: account, maybe update, answer. A gradient sent again
        (the same sequence number) is answered as before and not applied again."""
        if msg.kind == Kind.PUSHPULL:
            self.weights_out.check_pull(msg)  # advstar refuses it before any state changes
        parted = msg.is_part  # wire.parts: one part of the gradient
        if parted and msg.fields.get("more") and self.state.is_sent_before(msg):
            return  # a part of a gradient applied already: its last part is answered
        if self.state.is_duplicate(msg):
            if msg.sender in self.weights_out.waiting:
                self.weights_out.readdress(msg.sender, ident)  # its reply is still owed
            else:
                self.weights_out.answer(ident, msg, self.state.applied[msg.sender][1])
            return
        if parted:
            arrival = self.state.push_part(msg)
            if arrival is None:  # more to come (or a part to be sent again)
                self.weights_out.ahead(self.state.parts_ahead())
                return
            self.serving.saw(msg.sender, msg.seq)  # every part in: a CHECK hears "got"
        else:
            step = self.state.relay if msg.kind == Kind.RELAY else self.state.push
            arrival = step(msg)
        if arrival.update is not None:
            self._after_update(arrival.update)
        else:
            self.weights_out.ahead(self.state.parts_ahead())
            self._release()  # the engine may free a held reply between updates
        if self.state.done:  # this gradient completed training
            self._stop(ident, msg.sender, msg.seq)
        else:
            self.weights_out.answer(ident, msg, arrival.sigma, arrival.reply)

    def _release(self) -> None:
        """Send the replies and WELCOMEs the engine held that are now due (STOP once training
        is done). Called after every change of the engine's state."""
        held = self.weights_out.waiting
        self.weights_out.release(self._stop)
        now = time.time()
        for sender in held - self.weights_out.waiting:  # answered: its silence starts here
            self.state.heard(sender, now)
        for ident, sender, seq in self.state.welcomes_due():
            (self._stop if self.state.done else self._welcome)(ident, sender, seq)

    def _after_update(self, update) -> None:
        self.metrics.update(update)
        if self.state.done and self.checkpoints is not None:
            self.checkpoints.save(self.state)  # training is over: durable before any STOP
        self.weights_out.updated(update)
        self._release()
        if self.checkpoints is not None and not self.state.done:
            self.checkpoints.after_update(self.state)
        if self.evals.due(update, self.state.done):
            self.metrics.evaluate(self.state)

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event=None) -> int:
        """Serve until training is done and every learner was told (a server restarted after
        training ended: at least ``runtime.retry_s`` + 1 s), or ``stop_event`` is set.

        Blocks. Raises TimeoutError if no learner sends anything for ``runtime.timeout_s``.
        """
        st = self.state
        last_msg = started = time.time()
        self.liveness.start(started)
        # restarted after training ended: a learner whose STOP the crash lost asks again
        # within runtime.retry_s; stay that long to tell it (``send`` stays so too)
        if self.over_at_start:
            self.serving.stay_until = started + self.cfg.runtime.retry_s + 1
        if self.recovery is None:  # (one recovering has no weights to evaluate yet)
            self.metrics.evaluate(st)  # test error of the initial weights (epoch 0)
        # One blocking receive per message (libzmq waits with the GIL released, at most
        # WAIT_MS): no Poller and no zmq.Again per message.
        self.sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
        try:
            while not (stop_event is not None and stop_event.is_set()) and not (
                st.all_stopped and time.time() >= self.serving.stay_until
            ):
                try:
                    self.handle(self.sock.recv_multipart(copy=False))
                    last_msg = time.time()
                except zmq.Again:
                    if self.liveness.idle(st, time.time() - last_msg):
                        break
                if self.recovery is not None:
                    self._recover_if_due()
                if self.liveness.due(now := time.time()):
                    self._evict_silent(now)
                    self.liveness.note_waiting(st, now)
                self.metrics.tick(self)
        finally:
            self._finish()
        return 0

    def _evict_silent(self, now: float) -> None:
        """Evict the learners ``liveness`` finds silent (not those the server owes a reply):
        the protocol goes on with the others."""
        for learner in self.liveness.silent(self.state, now, self.weights_out.waiting):
            update = self.state.evict(learner)
            self._members_changed(learner, "evicted")
            if update is not None:
                self._after_update(update)
            else:
                self.weights_out.ahead(self.state.parts_ahead())  # it had sent no more parts
                self._release()  # a rule waiting for that learner no longer does

    def _members_changed(self, learner: int, why: str) -> None:
        eng = self.state.engine
        log.info(
            "learner %d %s: λ=%d alive, c=%d",
            learner,
            why,
            len(eng.members),
            eng.gradients_per_update,
        )
        self.metrics.members(learner, why, eng)

    def _finish(self) -> None:
        ck, st = self.checkpoints, self.state
        if st.parts is not None and st.parts.open:  # its senders send those parts again
            log.info("not checkpointing a round half in (wire.parts): the last one stands")
        elif ck is not None and not (st.done and ck.last_ts == st.engine.timestamp):
            self.checkpoints.save(self.state)  # (the end of training was saved already)
        self.metrics.tick(self, force=True)
        if self.state.done:
            self.metrics.done(self)
        if self.stats:
            self.stats.close()
        if self.state.log is not None:
            self.state.log.close()
        self.history.lost(st.lost_now)
        self.history.save()
        if self.run_dir is not None:
            write_end_files(
                self.files_dir,
                self.state,
                restarts=self.history.restarts,
                incarnation=self.history.starts,
            )
            if self.state.done:  # the last of several servers joins theirs into the run's
                try:
                    joined = self.shape.joined_dirs(self.run_dir)
                    assemble(self.run_dir, joined, self.cfg.train.epochs, self.shape.join)
                except (OSError, ValueError) as exc:  # its own files are saved: say, go on
                    log.warning("could not join the servers' weights in %s: %s", self.run_dir, exc)
        self.weights_out.close()
        # the STOPs just queued get time to leave
        self.out.close(transport.closing_linger_ms(self.cfg.runtime.retry_s, self.state.done))
        if self._own_ctx:
            transport.term(self.ctx)


def serve(
    cfg,
    bind: str,
    stats: str | None = None,
    run_dir: str | None = None,
    broadcast: str | None = None,
    resume: bool = False,
    server: int = 0,
) -> int:
    """Entry point of ``rudra-zmq ps``: run one parameter server until training ends
    (``resume``: from the newest valid checkpoint in ``run_dir``; ``server``: which of the
    run's servers, ``--shard``)."""
    threads = cfg.runtime.ps_threads or kernels.get_num_threads()
    kernels.set_num_threads(threads)
    ps = ParameterServer(
        cfg, bind, stats, run_dir, broadcast=broadcast, resume=resume, server=server
    )
    if ps.resumed_from is not None:
        st = ps.state
        print(
            f"parameter server: resumed from {ps.resumed_from} at timestamp "
            f"{st.engine.timestamp}, epoch {st.engine.epoch:.2f} (incarnation "
            f"{ps.history.starts})",
            flush=True,
        )
        if ps.recovery is None:  # else said once the learners' copies are in
            ps.metrics.restart(ps, ps.history.current)
    if ps.weights_out.endpoint is not None:
        print(f"broadcast root listening on {ps.weights_out.endpoint}", flush=True)
    print(
        f"{ps.place.title()} listening on {ps.endpoint} ({ps.state.numel:,} parameters, "
        f"{cfg.sync.protocol}, λ={cfg.sync.learners}, {threads} kernel threads)",
        flush=True,
    )
    return ps.serve_forever()
