"""The synthetic model of the LAN benchmarks (``benchmarks/synthetic_model.py``): real
parameter tensors whose forward and backward sleep, runnable by rudra_zmq's learner path
(``FlatModel``, the user-model import path) and by real ``DistributedDataParallel``. The
sleeps are recorded, not timed."""

import pytest
import torch

from rudra_zmq import models
from rudra_zmq.benchmarks import lan_ddp, synthetic_model
from rudra_zmq.benchmarks.synthetic_model import SleepModel
from rudra_zmq.flat import FlatModel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sleeps(monkeypatch):
    """The sleeps the model asks for, in order, instead of sleeping them."""
    asked = []
    monkeypatch.setattr(synthetic_model.time, "sleep", asked.append)
    return asked


def test_the_model_spreads_its_parameters_and_compute_evenly_over_its_layers(sleeps):
    model = SleepModel(10, params=1003, layers=4, forward_ms=40, backward_ms=80)
    assert [p.numel() for p in model.parameters()] == [250, 250, 250, 253]
    out = model(torch.zeros(2, 3, 4, 4))
    assert out.shape == (2, 10) and sleeps == [pytest.approx(0.01)] * 4
    sleeps.clear()
    out.sum().backward()
    assert sleeps == [pytest.approx(0.02)] * 4


def test_backward_hands_each_layer_a_dense_gradient_last_layer_first(sleeps):
    model = SleepModel(10, params=400, layers=4, forward_ms=0, backward_ms=0)
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    torch.nn.functional.cross_entropy(
        model(torch.ones(3, 1, 2, 2)), torch.tensor([0, 1, 2])
    ).backward()
    assert order == [3, 2, 1, 0]  # as a real network's: DDP's buckets fill in this order
    for p in model.parameters():
        assert torch.count_nonzero(p.grad) == p.numel()


def test_the_learners_flat_buffers_take_its_gradient_in_place(sleeps):
    model = SleepModel(10, params=4000, layers=8, forward_ms=0, backward_ms=0)
    flat = FlatModel(model)
    flat.zero_grad()
    model(torch.ones(2, 3, 4, 4)).sum().backward()
    flat.check_views()  # the custom backward did not rebind a gradient
    assert flat.numel == 4000 and (flat.grads != 0).all()


def test_it_loads_by_its_import_path_as_any_user_model(sleeps):
    name = "rudra_zmq.benchmarks.synthetic_model:lan_100ms"
    assert models.check_model(name, 10, (3, 8, 8)) == 10_000_000
    model = models.build_model(name, 10, (3, 8, 8))
    assert len(model.layers) == 20
    assert model.layers[0].forward_s == pytest.approx(0.0333 / 20, rel=1e-2)
    assert model.layers[0].backward_s == pytest.approx(0.0667 / 20, rel=1e-2)


def test_a_model_too_small_for_its_layers_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="100 parameters in 20 layers leave fewer than"):
        SleepModel(10, params=100, layers=20)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_real_ddp_trains_it_and_the_timeline_gets_each_buckets_allreduce(tmp_path, sleeps, dtype):
    """One gloo rank on loopback: DDP's reducer, its hooks and the bench's step loop."""
    report, trace = tmp_path / "r.json", tmp_path / "t.json"
    import os

    os.environ[lan_ddp.timeline.ENV] = str(trace)
    try:
        lan_ddp.main(
            ["rank", "--rank", "0", "--world", "1", "--master", "127.0.0.1:0", "--params",
             "8000000", "--layers", "4", "--steps", "2", "--compute-ms", "0", "--dtype", dtype,
             "--report", str(report)]
        )  # fmt: skip
    finally:
        del os.environ[lan_ddp.timeline.ENV]
    import json

    rep = json.loads(report.read_text())
    assert len(rep["step_ends"]) == 2
    [part] = lan_ddp.timeline.parts_of(trace)
    events = json.loads(part.read_text())["traceEvents"]
    buckets = [
        (e["args"]["bucket"], e["args"]["bytes"]) for e in events if e["name"] == "allreduce"
    ]
    # 32 MB in 4 layers of 8 MB: the first step in one bucket; then DDP's default buckets in
    # backward's order: the last layer alone (the first bucket's cap is 1 MiB), then the rest
    # (25 MiB); the bytes are the float32 bucket's (the fp16 hook halves them on the wire)
    assert buckets == [(0, 32_000_000), (0, 8_000_000), (1, 24_000_000)]
    assert [e["name"] for e in events if e["ph"] == "X" and e["cat"] == "compute"] == [
        "forward", "backward", "optimizer"] * 2  # fmt: skip
