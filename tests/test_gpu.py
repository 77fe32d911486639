"""GPU learners (``runtime.device``; devices.py, flat.py): run where torch sees a CUDA GPU,
skipped elsewhere (bench/gpu_check.sh runs them on a GPU machine). The same logic without a
GPU is tested in test_flat.py (``staged=True``)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cluster import weights_difference
from rudra_zmq.flat import FlatModel
from rudra_zmq.models import build_model
from test_system import DIGITS, rudra_run, updates

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU here (torch.cuda.is_available() is False)",
    ),
    pytest.mark.timeout(300),
]


def test_a_flat_model_on_the_gpu_keeps_views_and_matches_the_cpu_gradient():
    cpu = FlatModel(build_model("cifar10_full", 10, (3, 32, 32), seed=0))
    gpu = FlatModel(build_model("cifar10_full", 10, (3, 32, 32), seed=0), device="cuda:0")
    assert gpu.staged and gpu._w.is_cuda and gpu._hw.is_pinned()
    for (_, a, _, _), p in zip(gpu.layout, gpu.module.parameters()):
        assert p.is_cuda and p.data_ptr() == gpu._w.data_ptr() + 4 * a
        assert p.grad.data_ptr() == gpu._g.data_ptr() + 4 * a
    gpu.check_views()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    for fm, dev in ((cpu, "cpu"), (gpu, "cuda:0")):
        fm.zero_grad()
        F.cross_entropy(fm.module(x.to(dev)), y.to(dev)).backward()
    gpu.grads_to_host()
    rel = np.linalg.norm(gpu.grads - cpu.grads) / np.linalg.norm(cpu.grads)
    print(f"GPU vs CPU gradient of one minibatch: relative difference {rel:.2e}")
    assert rel <= 1e-2  # (TF32 convolutions on the GPU)
    gpu.load_weights(cpu.weights * 0.5)
    np.testing.assert_array_equal(gpu._w.cpu().numpy(), cpu.weights * 0.5)


def test_hardsync_gpu_learners_match_one_gpu_learner_with_lambda_times_the_minibatch(tmp_path):
    common = [
        *DIGITS,
        "sync.protocol=hardsync",
        "train.epochs=0.12",
        "optimizer.lr=0.05",
        "runtime.device=cuda",
    ]
    one, _ = rudra_run(tmp_path, "one", [*common, "sync.learners=1", "sync.batch_size=16"])
    two, _ = rudra_run(tmp_path, "two", [*common, "sync.learners=2", "sync.batch_size=8"])
    assert len(updates(one)) == len(updates(two)) >= 10
    moved, rel = weights_difference(one, two)
    print(
        f"GPU learners: training moved the weights by {moved:.2e}; one vs two learners "
        f"differ by {rel:.2e}"
    )
    assert rel <= 1e-3, f"relative difference {rel:.2e}"
    cpu, _ = rudra_run(tmp_path, "cpu", [*common[:-1], "sync.learners=1", "sync.batch_size=16"])
    _, rel_cpu = weights_difference(one, cpu)
    print(f"one GPU learner vs one CPU learner: relative difference {rel_cpu:.2e}")
    assert rel_cpu <= 1e-2


def test_the_quickstart_on_gpu_learners_reaches_95_percent(tmp_path):
    import json

    run_dir, out = rudra_run(tmp_path, "quick", ["runtime.device=cuda"])
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    print(f"quickstart on GPU learners: final test error {evals[-1]['test_error']:.4f}")
    assert evals[-1]["test_error"] <= 0.05, evals[-1]


TREE = [
    *DIGITS,
    "sync.protocol=hardsync",
    "sync.learners=4",
    "sync.batch_size=8",
    "train.epochs=0.25",
    "optimizer.lr=0.05",
    "architecture.kind=adv",
    "architecture.fanout=2",
]


@pytest.mark.parametrize("shm", [False, True])
def test_gpu_learners_through_a_tree_give_the_cpu_learners_weights(tmp_path, shm):
    """Rudra-adv hardsync (2 leaves of 2 learners), payloads over ipc or through the leaf's
    shared memory (the gradient slot written from the host copy of the GPU gradient, the
    weight board read into it and then sent to the GPU): GPU learners end where CPU learners
    do."""
    extra = ["architecture.leaf_shm=true"] if shm else []
    cpu, _ = rudra_run(tmp_path, "cpu", [*TREE, *extra])
    gpu, _ = rudra_run(tmp_path, "gpu", [*TREE, *extra, "runtime.device=cuda"])
    if shm:
        logs = "".join(p.read_text() for p in gpu.glob("logs/*.log"))
        assert logs.count("trades through shared memory") == 4, logs[-3000:]
    _, rel = weights_difference(cpu, gpu)
    print(f"adv hardsync{' with leaf_shm' if shm else ''}: GPU vs CPU learners {rel:.2e}")
    assert rel <= 1e-3


def test_gpu_learners_train_under_advstar(tmp_path):
    """Rudra-adv*: weights reach each GPU learner only by the broadcast through the learners
    (copied into its host buffer, then to the GPU when a newer version is adopted)."""
    import json

    from test_system import ROOT

    run_dir, _ = rudra_run(
        tmp_path,
        "advstar",
        ["runtime.timeout_s=60", "runtime.device=cuda"],
        config=ROOT / "configs/quickstart_advstar.yaml",
    )
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    print(f"advstar quickstart on GPU learners: final test error {evals[-1]['test_error']:.2%}")
    assert evals[-1]["test_error"] <= 0.10, evals[-1]
