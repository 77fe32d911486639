"""A parameter server's state over a range [lo, hi) of the flat vector: the same arithmetic as
the whole-vector state on that slice, and checkpoints that know their range. No sockets."""

import numpy as np
import pytest

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.run_files import checkpoints_root
from rudra_zmq.server import checkpoint
from rudra_zmq.server.checkpointing import restore_latest
from rudra_zmq.server.state import ServerState
from rudra_zmq.shape import ClusterShape, Share, Span, split
from rudra_zmq.sync import ProtocolViolation
from rudra_zmq.wire import Kind


def checkpoint_dir(run_dir, span=None):
    """Where the server of ``span`` (None: the only one) of a split in two keeps its
    checkpoints, as the cluster's shape says."""
    k = 1 if span is None or span.is_whole else 2
    shape = ClusterShape(k).sized(N)
    (server,) = [s for s in shape.servers if span is None or s.share == as_share(span)]
    return server.checkpoint_dir(run_dir)


N, SIG = 12, "sig"
# per-layer multipliers whose segments cross the ranges below
SEGMENTS = [(0, 4, 1.0, 1.0), (4, 9, 2.0, 0.0), (9, 12, 0.5, 3.0)]
PROTOCOLS = {
    "hardsync": ("sync.protocol=hardsync",),
    "3-softsync": ("sync.protocol=softsync", "sync.n=3"),
    "1-softsync per-gradient lr": (
        "sync.protocol=softsync",
        "sync.n=1",
        "optimizer.lr_policy=per_gradient",
    ),
    "async": ("sync.protocol=async",),
}


def message(kind, sender, seq, ts=0, payloads=(), **fields):
    return wire.decode(wire.encode(kind, sender, seq, ts, 0, list(payloads), **fields))


def as_share(span):
    """A Span as the contiguous Share it is (a Share as it is; None: the whole vector)."""
    return Share((span,)) if isinstance(span, Span) else span


def state(span=None, *overrides, cfg=None):
    cfg = cfg or small_config("sync.learners=3", *overrides)
    w0 = np.linspace(-1, 1, N, dtype=np.float32)
    return ServerState(cfg, w0, SEGMENTS, SIG, epoch_size=64, share=as_share(span))


def hello(st, learner, seq=1, numel=N, **fields):
    """A learner's HELLO: the model's size, and (a range server's learner) the range it
    expects, as ``learner/exchange.py`` says it."""
    if not st.share.is_whole and "range" not in fields:
        fields["range"] = st.share.key
    st.register(
        str(learner).encode(),
        message(Kind.HELLO, learner, seq, model=SIG, numel=numel, **fields),
    )


def train(states, rounds=5, seed=0):
    """Each state gets the same pushes from learners 0..2, each at the timestamp the learner
    last saw and of the state's own range's slice of the gradient, in two frames. Returns each
    state's (σ, update timestamp) per push."""
    rng = np.random.default_rng(seed)
    seen, answers = [0, 0, 0], {id(st): [] for st in states}
    held = []  # (learner, sync.Reply) not answered yet, by the first state's engine
    for st in states:
        for i in range(3):
            hello(st, i)
    for seq in range(2, 2 + rounds):
        for learner in range(3):
            g = rng.standard_normal(N).astype(np.float32)
            for st in states:
                part = st.share.gather(g)
                cut = len(part) // 2 + 1
                arrival = st.push(
                    message(Kind.PUSHPULL, learner, seq, seen[learner], [part[:cut], part[cut:]])
                )
                answers[id(st)].append((arrival.sigma, arrival.update and arrival.update.timestamp))
                if st is states[0]:
                    held.append((learner, arrival.reply))
            # a learner has the weights it got back once the engine answered it (hardsync:
            # every learner at the update)
            eng = states[0].engine
            seen = [
                eng.timestamp if any(j == i and eng.due(r) for j, r in held) else t
                for i, t in enumerate(seen)
            ]
            held = [(j, r) for j, r in held if not eng.due(r)]
    return [answers[id(st)] for st in states]


def test_a_range_clips_the_segments_that_cross_it_to_offsets_within_it():
    assert Span(3, 10, N).clip(SEGMENTS) == [(0, 1, 1.0, 1.0), (1, 6, 2.0, 0.0), (6, 7, 0.5, 3.0)]
    assert Span(4, 9, N).clip(SEGMENTS) == [(0, 5, 2.0, 0.0)]
    assert Span.whole(N).clip(SEGMENTS) == SEGMENTS


def test_split_covers_the_vector_with_ranges_differing_by_at_most_one():
    spans = split(10, 3)
    assert [(s.lo, s.hi) for s in spans] == [(0, 4), (4, 7), (7, 10)]
    assert split(5, 1) == [Span.whole(5)] and Span.whole(5).is_whole
    with pytest.raises(ValueError, match="cannot split 5 floats into 6"):
        split(5, 6)
    with pytest.raises(ValueError, match=r"range \[7, 7\) of a vector of 12"):
        Span(7, 7, 12)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_state_over_a_range_updates_its_slice_exactly_as_the_whole_vector_state(protocol):
    whole, part = state(None, *PROTOCOLS[protocol]), state(Span(3, 10, N), *PROTOCOLS[protocol])
    assert part.numel == 7 and part.model_numel == whole.numel == N
    answers = train([whole, part])
    assert answers[0] == answers[1] and whole.engine.timestamp > 3
    assert not np.array_equal(whole.w, np.linspace(-1, 1, N, dtype=np.float32))
    for name in ("w", "v", "acc"):  # bit for bit, momentum and pending sum too
        np.testing.assert_array_equal(
            getattr(part.updater, name), getattr(whole.updater, name)[3:10], err_msg=name
        )


def test_servers_over_the_ranges_of_a_split_together_hold_the_whole_vector_state():
    whole = state(None, "sync.protocol=softsync", "sync.n=1")
    shards = [state(s, "sync.protocol=softsync", "sync.n=1") for s in split(N, 3)]
    train([whole, *shards])
    np.testing.assert_array_equal(np.concatenate([s.w for s in shards]), whole.w)
    assert np.concatenate(shards[1].weight_frames()).shape == (4,)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_servers_over_stripes_together_hold_the_whole_vector_state_bit_for_bit(protocol):
    """Stripes cut the segments (per-layer multipliers) in more places than ranges do: each
    element is still updated as the whole vector's is."""
    shape = ClusterShape(3, parts_per_range=2).sized(N)  # 6 stripes of 2, dealt in turn
    assert [s.share.key for s in shape.servers][0] == [[0, 2], [6, 8]]
    whole = state(None, *PROTOCOLS[protocol])
    shards = [state(s.share, *PROTOCOLS[protocol]) for s in shape.servers]
    answers = train([whole, *shards])
    assert all(a == answers[0] for a in answers) and whole.engine.timestamp > 3
    for name in ("w", "v", "acc"):
        got = shape.join([getattr(s.updater, name) for s in shards])
        np.testing.assert_array_equal(got, getattr(whole.updater, name), err_msg=name)


def test_a_checkpoint_of_stripes_round_trips_and_refuses_the_ranges_layout(tmp_path):
    shape = ClusterShape(2, parts_per_range=3).sized(N)
    first = shape.server(0)
    a = state(first.share, "sync.protocol=async")
    train([a], rounds=2)
    directory = first.checkpoint_dir(tmp_path)
    assert directory.name == "stripes-0-2-x3"
    checkpoint.save(directory, *a.snapshot())
    b = state(first.share, "sync.protocol=async")
    assert restore_latest(b, directory, checkpoints_root(tmp_path)) is not None
    np.testing.assert_array_equal(b.w, a.w)
    ranges = ClusterShape(2, parts_per_range=3, stripes=False).sized(N).server(0)
    c = state(ranges.share, "sync.protocol=async")
    with pytest.raises(ValueError, match=r"none of range \[0, 6\).*wire.stripes=false"):
        restore_latest(c, ranges.checkpoint_dir(tmp_path), checkpoints_root(tmp_path))
    with pytest.raises(ValueError, match=r"holds range 3 stripes .* serves range \[0, 6\)"):
        c.restore(*a.snapshot())


def test_a_range_server_accepts_the_models_learners_and_refuses_another_size():
    st = state(Span(3, 10, N))
    hello(st, 0)  # a learner says the model's size, not the range's
    with pytest.raises(ProtocolViolation, match="7 parameters .* holds 12"):
        hello(st, 1, numel=7)
    with pytest.raises(ProtocolViolation, match=r"expects range \[0, 12\].*serves \[3, 10\)"):
        hello(st, 2, range=[0, 12])  # one of an unsharded run: the whole vector


def test_a_checkpoint_of_a_range_round_trips_and_continues_identically(tmp_path):
    span = Span(3, 10, N)
    a = state(span, "sync.protocol=async")
    train([a], rounds=2)
    directory = tmp_path / "checkpoints" / "range-3-10"  # a range's (test_shape.py)
    checkpoint.save(directory, *a.snapshot())
    b = state(span, "sync.protocol=async")
    assert restore_latest(b, directory) is not None
    assert checkpoint.load_latest(directory).meta["range"] == [3, 10]
    assert b.engine.state_dict() == a.engine.state_dict()
    for name in ("w", "v", "acc"):
        np.testing.assert_array_equal(getattr(b.updater, name), getattr(a.updater, name))
    g = np.arange(7, dtype=np.float32)
    for st in (a, b):
        hello(st, 0, seq=50)
        st.push(message(Kind.PUSH, 0, 51, st.engine.timestamp, [g]))
    np.testing.assert_array_equal(a.w, b.w)


@pytest.mark.parametrize("saved, into", [((3, 10), (4, 10)), ((3, 10), None), (None, (3, 10))])
def test_a_checkpoint_of_another_range_is_refused_naming_both(saved, into):
    a = state(saved and Span(*saved, N))
    arrays, meta = a.snapshot()
    b = state(into and Span(*into, N))
    w = b.w
    name = {
        None: r"\[0, 12\) of 12 \(the whole vector\)",
        (3, 10): r"\[3, 10\) of 12",
        (4, 10): r"\[4, 10\) of 12",
    }
    with pytest.raises(ValueError, match=f"holds range {name[saved]} .* serves range {name[into]}"):
        b.restore(arrays, meta)
    assert b.w is w and b.restored_ts is None  # nothing restored


def test_a_checkpoint_written_before_ranges_loads_as_the_whole_vector(tmp_path):
    a = state(None, "sync.protocol=async")
    train([a], rounds=2)
    arrays, meta = a.snapshot()
    del meta["range"]  # what servers wrote before ranges
    checkpoint.save(tmp_path, arrays, meta)
    b = state(None, "sync.protocol=async")
    restore_latest(b, tmp_path)
    np.testing.assert_array_equal(b.w, a.w)
    assert b.share == Share.whole(N) and b.engine.timestamp == a.engine.timestamp
    ck = checkpoint.load_latest(tmp_path)
    with pytest.raises(ValueError, match=r"holds range \[0, 12\) of 12 \(the whole"):
        state(Span(0, 6, N)).restore(ck.arrays, ck.meta)


def test_a_server_with_no_checkpoints_of_its_range_refuses_other_ranges_checkpoints(tmp_path):
    assert restore_latest(state(), checkpoint_dir(tmp_path)) is None  # a new run
    first, second = split(N, 2)
    checkpoint.save(checkpoint_dir(tmp_path, first), *state(first).snapshot())
    with pytest.raises(ValueError, match=r"range \[0, 6\) but none of range \[0, 12\)"):
        restore_latest(state(), checkpoint_dir(tmp_path))
    checkpoint.save(checkpoint_dir(tmp_path), *state().snapshot())
    with pytest.raises(ValueError, match=r"whole vector, \[0, 6\) but none of range \[6, 12\)"):
        restore_latest(state(second), checkpoint_dir(tmp_path, second), checkpoints_root(tmp_path))
