"""Gradients that leave during backward (``learner/buckets.py``): each part is reported the
moment backward has finished every parameter it overlaps, the last layers' first, holding
then exactly the bytes of the finished gradient; a server's part 0 (no x{more}) goes last;
``wire.bucket_mb`` cuts a range into more parts, and a bucket of 0 stops at the config.
Hardsync pushing during backward ends with the very weights of pushing after it (K = 1 in
parts, K = 2 whole and in parts); striped servers end with the very weights of ranges and of
one server (K = 1, 2, 4)."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from cluster import small_config
from rudra_zmq.config import load_config
from rudra_zmq.flat import FlatModel
from rudra_zmq.learner.buckets import BackwardParts, StreamedPush
from rudra_zmq.shape import ClusterShape, part_bounds
from rudra_zmq.typed_yaml import ConfigError
from test_shards import initial_weights, run_sharded, weights_of


def model():
    torch.manual_seed(0)
    return FlatModel(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Linear(4, 3)))


def backward(flat):
    flat.zero_grad()
    out = flat.module(torch.randn(7, 6, generator=torch.Generator().manual_seed(1)))
    out.square().sum().backward()


def test_each_part_is_reported_once_backward_finished_it_last_layers_first_with_its_final_bytes():
    flat = model()
    b = part_bounds(flat.numel, 5)
    cuts = list(zip(b, b[1:]))
    seen = {}
    parts = BackwardParts(
        flat, cuts, lambda j: seen.setdefault(j, flat.grads[slice(*cuts[j])].copy())
    )
    parts.arm()
    backward(flat)
    assert parts.disarm() == []
    assert list(seen) == [4, 3, 2, 1, 0]  # the last layer's gradient comes first
    for j, got in seen.items():
        np.testing.assert_array_equal(got, flat.grads[slice(*cuts[j])])
    parts.close()
    seen.clear()
    backward(flat)  # the hooks are gone
    assert seen == {}


def test_a_pass_that_leaves_a_parameter_without_gradient_reports_its_parts_unfinished():
    flat = model()
    b = part_bounds(flat.numel, 3)
    parts = BackwardParts(flat, list(zip(b, b[1:])), lambda j: None)
    parts.arm()
    flat.zero_grad()
    flat.module[0](torch.ones(2, 6)).sum().backward()  # only the first layer
    assert parts.disarm() == [2, 1]


def test_weights_shared_in_one_pass_count_once_and_a_second_pass_in_a_step_raises():
    lin = nn.Linear(3, 3)
    flat = FlatModel(nn.Sequential(lin))
    ready = []
    parts = BackwardParts(flat, [(0, flat.numel)], ready.append)
    parts.arm()
    x = torch.ones(1, 3)
    (lin(x) + lin(lin(x))).sum().backward()  # one layer used three times: one accumulation
    assert ready == [0]
    with pytest.raises(RuntimeError, match="'0.(weight|bias)' accumulated its gradient twice"):
        lin(x).sum().backward()


@pytest.mark.parametrize(
    "stripes, order",
    [  # stripes: the two servers' parts alternate, both links busy from the first one on
        ("true", [(1, 2), (0, 2), (1, 1), (0, 1), (1, 0), (0, 0)]),
        ("false", [(1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]),  # server 0 waits
    ],
)
def test_two_servers_parts_go_during_backward_each_servers_part_0_last(stripes, order):
    flat = model()
    cfg = load_config(
        None,
        ["sync.protocol=hardsync", "wire.parts=3", "architecture.servers=2"]
        + [f"wire.stripes={stripes}"],
    )
    stream = StreamedPush(flat, ClusterShape.of(cfg, flat.numel).servers)
    sent, in_backward = [], [False]

    def run():
        in_backward[0] = True
        backward(flat)
        in_backward[0] = False

    calls = {
        k: [lambda k=k, i=i: sent.append((k, i, in_backward[0])) for i in range(3)] for k in (0, 1)
    }
    stream.push(run, calls)
    assert [(k, i) for k, i, _ in sent] == order
    assert all(during for _, _, during in sent)  # every part left inside backward
    stream.close()


def test_bucket_mb_cuts_a_range_in_more_parts_and_zero_is_refused_in_one_line(tmp_path):
    cfg = load_config(None, ["sync.protocol=hardsync", "wire.parts=2", "wire.bucket_mb=1"])
    assert len(ClusterShape.of(cfg, 1_000_000).parts) == 4  # 4 MB of float32 in 1 MiB parts
    assert len(ClusterShape.of(cfg, 1000).parts) == 2
    assert len(ClusterShape.of(load_config(None, []), 10_000_000).parts) == 1  # parts=1: whole
    for bad in ("0", "-1", "2000000"):
        with pytest.raises(
            ConfigError, match=rf"wire.bucket_mb must be a size in MiB > 0 .* got {bad}"
        ):
            load_config(None, [f"wire.bucket_mb={bad}"])
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", "configs/quickstart.yaml", "--run-dir",
         str(tmp_path / "r"), "--set", "wire.bucket_mb=0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode != 0 and not (tmp_path / "r").exists()
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "wire.bucket_mb must be a size in MiB > 0" in res.stderr
    res = subprocess.run(  # launch: the same line, before any host is reached
        [sys.executable, "-m", "rudra_zmq", "launch", "configs/quickstart.yaml", "-H",
         "127.0.0.1:1", "--run-dir", str(tmp_path / "l"), "--set", "wire.bucket_mb=-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and not (tmp_path / "l").exists()
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("rudra-zmq: error: ") and "wire.bucket_mb=-1: wire.bucket_mb " in line
    assert "must be a size in MiB > 0" in line, line
    assert line.endswith(("got -1", "got -1.0")), line


def spy_instances(monkeypatch, cls) -> list:
    """The list every ``cls`` made from now on is appended to (each learner's StreamedPush
    or EarlyWeights, say)."""
    made = []
    init = cls.__init__

    def spy(self, *args):
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", spy)
    return made


@pytest.mark.parametrize("k, parts", [(1, 4), (2, 1), (2, 3)])
def test_hardsync_pushing_during_backward_ends_bit_identical_to_pushing_after(
    ctx, monkeypatch, k, parts
):
    """σ = 0 and the same sums: the server sums each part's finished bytes, whenever they
    left. Two learners: a sum of two is the same in either order of arrival."""
    common = ["sync.protocol=hardsync", "train.epochs=0.25", f"wire.parts={parts}"]
    assert_pushing_during_backward_ends_as_after(ctx, monkeypatch, k, parts, common)


def assert_pushing_during_backward_ends_as_after(ctx, monkeypatch, k, parts, common) -> None:
    """Hardsync ``common`` with ``k`` servers, ``parts`` parts a range, run pushing after
    backward and then during it: every message of every step of the second left from inside
    backward, and both end with the very same weights."""
    streams = spy_instances(monkeypatch, StreamedPush)
    after = run_sharded(small_config(*common, "wire.push_during_backward=false"), k, ctx)
    assert streams == []
    during = run_sharded(small_config(*common), k, ctx)
    assert len(streams) == 2  # each learner's
    steps = during[0].state.engine.timestamp
    assert steps > 10 and {s.state.engine.timestamp for s in after + during} == {steps}
    for s in streams:  # every message of every step left from inside backward
        assert (s.during, s.after) == (k * max(parts, 1) * steps, 0)
    w = weights_of(during)
    assert not np.array_equal(w, initial_weights(small_config(*common)))  # it trained
    np.testing.assert_array_equal(w, weights_of(after))


@pytest.mark.timeout(300)
def test_hardsync_over_stripes_ends_bit_identical_to_ranges_and_to_one_server(ctx):
    """Striped servers (``wire.stripes``, part j to server j mod K), pushing during backward,
    end with the very weights of contiguous ranges and of one server, K = 1, 2 and 4: each
    element gets the same sums and the same update wherever it is served."""
    common = ["sync.protocol=hardsync", "train.epochs=0.25", "wire.parts=3"]
    cfg, ranges = small_config(*common), small_config(*common, "wire.stripes=false")
    runs = {
        "K=1": run_sharded(cfg, 1, ctx),
        "K=2 stripes": run_sharded(cfg, 2, ctx),
        "K=2 ranges": run_sharded(ranges, 2, ctx),
        "K=4 stripes": run_sharded(cfg, 4, ctx),
    }
    for name in ("K=2 stripes", "K=4 stripes"):
        assert not all(s.state.share.contiguous for s in runs[name])  # striped indeed
    steps = {s.state.engine.timestamp for r in runs.values() for s in r}
    assert len(steps) == 1 and steps.pop() > 10
    w1 = weights_of(runs["K=1"])
    assert not np.array_equal(w1, initial_weights(cfg))  # it trained
    for name, servers in runs.items():
        np.testing.assert_array_equal(weights_of(servers), w1, err_msg=name)


def test_a_straggler_of_runtime_compute_times_pushes_after_its_sleep(ctx, monkeypatch):
    """``runtime.compute_times`` makes a learner sleep after its backward: its parts must
    wait for that sleep, or the straggler would be one only in its next forward."""
    streams = spy_instances(monkeypatch, StreamedPush)
    cfg = ["sync.protocol=hardsync", "train.epochs=0.1", "wire.parts=2"]
    run_sharded(small_config(*cfg, "runtime.compute_times=[1,1.5]"), 1, ctx)
    assert len(streams) == 2
    assert sorted(s.during > 0 for s in streams) == [False, True]  # the straggler's unused
    assert all(s.after == 0 for s in streams)
