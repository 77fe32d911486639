"""architecture.leaf_shm: a leaf tree node and its learners trade gradients and weights through
/dev/shm (rudra_zmq/shm.py). The wire's shm fields, the config switch, a tree driven by hand
(a real root PS and leaves, learners speaking the wire with shared slots) against the flat
hardsync update, the fall-back to payloads, and whole runs started as a user would."""

import contextlib
import json
import logging
import os

import numpy as np
import pytest

from cluster import FakeLearner, running, small_config
from rudra_zmq import shm, topology, wire
from rudra_zmq.config import ConfigError
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.tree.leaf_shm import LeafShm, NoShm, make_shared
from rudra_zmq.tree.node import TreeNode
from rudra_zmq.wire import Kind, WireError
from test_ps import expected_step
from test_system import DIGITS, ROOT, threaded_run

pytestmark = pytest.mark.timeout(120)


def ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX)}


def leaked(before: set[str]) -> set[str]:
    """Segments that appeared since ``before`` and were created by this process or outlived
    their creator (those of other live processes, e.g. a concurrent test run, are not ours)."""
    mine = set()
    for name in ours() - before:
        try:
            with open(os.path.join(shm.SHM_DIR, name), "rb") as f:
                if shm.HEADER.unpack(f.read(shm.HEADER.size))[3] == os.getpid():
                    mine.add(name)
        except (OSError, ValueError):
            continue
    return mine | (set(shm.stale_segments()) - before)


def tree_config(*overrides, depth=1):
    return small_config(
        "architecture.kind=adv",
        "architecture.fanout=2",
        f"architecture.depth={depth}",
        "sync.learners=4",
        "sync.protocol=hardsync",
        "architecture.leaf_shm=true",
        *overrides,
    )


class ShmLearner:
    """A FakeLearner that offers shared gradient slots in its HELLO, as learner/learner.py does."""

    def __init__(self, ctx, endpoint, learner, leaf, numel):
        self.fake, self.leaf, self.numel = FakeLearner(ctx, endpoint, learner), leaf, numel
        self.slots = shm.GradientSlots.create(shm.new_token(), leaf, learner, numel)
        self.board = None

    def hello(self, signature):
        self.fake.send(Kind.HELLO, model=signature, numel=self.numel, shm=self.slots.token)
        msg = self.fake.recv()
        assert msg.kind == Kind.WELCOME, msg
        if msg.fields.get("shm"):
            self.board = shm.WeightBoard.attach(msg.fields["shm"], self.leaf, self.numel)
        return msg

    def pushpull(self, ts, grad, slot):
        self.slots.slot(slot)[:] = grad
        self.fake.send(Kind.PUSHPULL, ts, slot=slot)

    def weights(self):
        msg = self.fake.recv()
        assert msg.kind == Kind.WEIGHTS and msg.in_shm and not msg.payloads, msg
        w = np.empty(self.numel, np.float32)
        assert self.board.read_into(w, timeout_s=10) == msg.ts
        return w, msg.ts

    def close(self):
        for seg in (self.slots, self.board):
            if seg is not None:
                seg.close()
        self.fake.close()


# ----------------------------------------------------------------------------- wire, config
def test_a_gradient_in_a_slot_and_weights_on_the_board_travel_without_payload():
    frames = wire.encode(Kind.PUSHPULL, 3, 1, ts=5, slot=1)
    msg = wire.decode(frames, numel=100, slots=True)
    assert msg.in_shm and msg.payloads == [] and msg.fields["slot"] == 1
    with pytest.raises(WireError, match="only to a leaf that accepted"):
        wire.decode(frames, numel=100)  # a root PS, or a leaf without leaf_shm
    with pytest.raises(WireError, match="slot must be 0 or 1"):
        wire.decode(wire.encode(Kind.PUSH, 3, 1, slot=2), slots=True)
    with pytest.raises(WireError, match="0..0 payload frames"):
        wire.decode(
            wire.encode(Kind.PUSH, 3, 1, payloads=[np.zeros(100, np.float32)], slot=0), slots=True
        )
    weights = wire.decode(wire.encode(Kind.WEIGHTS, -100, 1, ts=9, board=True), numel=100)
    assert weights.in_shm and weights.payloads == []
    with pytest.raises(WireError, match="carries 1..4096"):  # board false: a payload is due
        wire.decode(wire.encode(Kind.WEIGHTS, -100, 1, ts=9, board=False), numel=100)
    hello = wire.decode(wire.encode(Kind.HELLO, 3, 1, model="m", numel=100, shm="abc"))
    assert hello.fields["shm"] == "abc"


def test_leaf_shm_is_off_by_default_and_needs_a_tree():
    assert small_config().architecture.leaf_shm is False
    with pytest.raises(ConfigError, match="leaf_shm .* architecture.kind=base"):
        small_config("architecture.leaf_shm=true")
    assert tree_config().architecture.leaf_shm is True


# ----------------------------------------------------------------------------- a tree by hand
@pytest.mark.parametrize("depth", [1, 2])
def test_hardsync_through_shared_memory_gives_the_flat_update(ctx, depth):
    cfg = tree_config(depth=depth)
    before = ours()
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    inner = [TreeNode(cfg, 2, "tcp://127.0.0.1:0", ps.endpoint, ctx=ctx)] if depth == 2 else []
    up = inner[0].endpoint if inner else ps.endpoint
    leaves = [TreeNode(cfg, k, "tcp://127.0.0.1:0", up, ctx=ctx) for k in (0, 1)]
    with contextlib.ExitStack() as stack:
        errors = [stack.enter_context(running(s)) for s in (ps, *inner, *leaves)]
        # learners 0-2 share memory with their leaf; learner 3 (same leaf as 2) sends payloads
        ls = [ShmLearner(ctx, leaves[i // 2].endpoint, i, i // 2, ps.state.numel) for i in range(3)]
        plain = FakeLearner(ctx, leaves[1].endpoint, 3)
        welcomes = [learner.hello(ps.state.signature) for learner in ls]
        assert all(m.fields["shm"] for m in welcomes)
        w0, _ = plain.hello(ps.state.signature, ps.state.numel)
        np.testing.assert_array_equal(np.concatenate(welcomes[0].payloads), w0)
        w, v = w0, np.zeros_like(w0)
        for rnd in range(3):  # slots 0, 1, 0: they alternate
            g = [
                x * (rnd + 1)
                for x in np.random.default_rng(rnd)
                .standard_normal((4, ps.state.numel))
                .astype(np.float32)
            ]
            for i in (2, 0, 1):
                ls[i].pushpull(rnd, g[i], slot=rnd % 2)
            plain.send(Kind.PUSHPULL, rnd, [g[3]])
            w, v = expected_step(w, v, g, cfg, ps.state.updater.segments)
            for learner in ls:
                got, ts = learner.weights()
                assert ts == rnd + 1
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
            msg = plain.recv()
            assert msg.kind == Kind.WEIGHTS and not msg.in_shm and msg.ts == rnd + 1
            np.testing.assert_allclose(np.concatenate(msg.payloads), w, rtol=1e-5, atol=1e-6)
        assert ps.state.engine.updates == 3 and ps.state.engine.gradients_received == 12
        # every learner has pushed: the boards' names are gone, the mappings still work
        assert not any(leaf.shared.board.owner for leaf in leaves)
        for learner in ls:
            learner.close()
        plain.close()
    assert not any(errors)
    assert not leaked(before), "segments left behind"


def test_a_leaf_without_shared_memory_keeps_its_learners_on_payloads(ctx, monkeypatch):
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")  # no seqlocked board here
    cfg = tree_config()
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    leaves = [TreeNode(cfg, k, "tcp://127.0.0.1:0", ps.endpoint, ctx=ctx) for k in (0, 1)]
    with running(ps) as e0, running(leaves[0]) as e1, running(leaves[1]) as e2:
        ls = [ShmLearner(ctx, leaves[i // 2].endpoint, i, i // 2, ps.state.numel) for i in range(4)]
        welcomes = [learner.hello(ps.state.signature) for learner in ls]
        assert not any("shm" in m.fields for m in welcomes)  # declined: use payloads
        ls[0].pushpull(0, np.ones(ps.state.numel, np.float32), slot=0)
        err = ls[0].fake.recv()
        assert err.kind == Kind.ERROR and "did not map its slots" in err.fields["error"]
        g = [np.full(ps.state.numel, i, np.float32) for i in range(4)]
        for i, learner in enumerate(ls):
            learner.fake.send(Kind.PUSHPULL, 0, [g[i]])
        for learner in ls:
            msg = learner.fake.recv()
            assert msg.kind == Kind.WEIGHTS and msg.ts == 1 and len(msg.payloads) >= 1
            learner.close()
    assert not (e0 or e1 or e2)


# ----------------------------------------------------------------------------- whole runs
HARD = [
    *DIGITS,
    "sync.protocol=hardsync",
    "sync.learners=4",
    "sync.batch_size=8",
    "train.epochs=0.25",
    "optimizer.lr=0.05",
    "architecture.kind=adv",
    "architecture.fanout=2",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hardsync_runs_give_the_same_weights_with_and_without_leaf_shm(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rudra_zmq")
    before = ours()
    ipc, _ = threaded_run(tmp_path, "ipc", HARD)
    shared, _ = threaded_run(tmp_path, "shm", [*HARD, "architecture.leaf_shm=true"])
    logs = caplog.text
    assert logs.count("trades through shared memory") == 4, logs[-3000:]
    assert "ZeroMQ payloads" not in logs, logs[-3000:]  # no learner fell back
    w_ipc, w_shm = np.load(ipc / "weights.npy"), np.load(shared / "weights.npy")
    rel = np.linalg.norm(w_shm - w_ipc) / np.linalg.norm(w_ipc)
    assert rel <= 1e-5, f"relative difference {rel:.2e}"
    assert not leaked(before), "segments left behind"


def _train_with_leaf_shm(tmp_path, caplog, config: str, epochs: int | None, max_error: float):
    """Run a quickstart config with leaf_shm (roles as threads): every learner must use
    shared memory (none falls back), the run must learn, and no segment may be left."""
    caplog.set_level(logging.INFO, logger="rudra_zmq")
    before = ours()
    epochs_set = [f"train.epochs={epochs}"] if epochs else []  # None: the config's own
    run_dir, _ = threaded_run(
        tmp_path,
        config,
        ["architecture.leaf_shm=true", *epochs_set, "runtime.timeout_s=60"],
        config=ROOT / f"configs/{config}.yaml",
    )
    logs = caplog.text
    assert logs.count("trades through shared memory") == 4, logs[-3000:]
    assert "ZeroMQ payloads" not in logs, logs[-3000:]
    evals = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "eval"
    ]
    print(f"{config} with leaf_shm: test error {[round(e['test_error'], 3) for e in evals]}")
    assert evals[0]["test_error"] > 0.8 and evals[-1]["test_error"] <= max_error, evals
    assert not leaked(before), "segments left behind"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_adv_trains_with_leaf_shm(tmp_path, caplog):
    _train_with_leaf_shm(tmp_path, caplog, "quickstart_adv", epochs=None, max_error=0.10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_advstar_pushes_through_slots_with_leaf_shm(tmp_path, caplog):
    # advstar's stale gradients make its first epochs erratic (README, Rudra-adv*): train the
    # config's 15 epochs and hold it to the bar of tests/test_advstar_system.py (a clean-clone
    # CI run measured 66 % error after 2 epochs once, 23 % another time).
    _train_with_leaf_shm(tmp_path, caplog, "quickstart_advstar", epochs=None, max_error=0.10)


@pytest.mark.parametrize(
    "leaf_shm,node,chosen", [(True, 0, LeafShm), (False, 0, NoShm), (True, 2, NoShm)]
)
def test_the_shared_memory_way_is_chosen_once_per_node(leaf_shm, node, chosen):
    cfg = small_config(
        "sync.learners=4",
        "architecture.kind=adv",
        "architecture.fanout=2",
        "architecture.depth=2",
        f"architecture.leaf_shm={str(leaf_shm).lower()}",
    )
    shared = make_shared(cfg, topology.plan(cfg).node(node), advstar=False)
    assert type(shared) is chosen and shared.takes_slots == (chosen is LeafShm)
    plain = wire.decode(wire.encode(Kind.PUSH, 1, 1, 0, 0, [np.ones(3, np.float32)]))
    if chosen is NoShm:  # payloads only, nothing on a board
        assert shared.pieces(plain) is plain.payloads and not shared.on_board(b"1")
        assert shared.welcome_fields(1) == {}
    shared.close()
