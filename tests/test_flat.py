"""FlatModel: parameters and gradients as views into two contiguous float32 arrays."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rudra_zmq.flat import FlatModel
from rudra_zmq.models import build_model

torch.set_num_threads(1)


def _flat(name="cifar10_full", shape=(3, 32, 32), seed=0):
    return FlatModel(build_model(name, 10, shape, seed=seed))


def _loss(module, seed=1, shape=(3, 32, 32)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, *shape, generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(module(x), y)


def test_parameters_and_grads_are_views_into_the_flat_buffers():
    fm = _flat()
    assert fm.weights.dtype == fm.grads.dtype == np.float32
    assert fm.numel == 89_578 and fm.nbytes == 4 * 89_578
    wbase, gbase = fm.weights.ctypes.data, fm.grads.ctypes.data
    for (_, start, _, _), p in zip(fm.layout, fm.module.parameters()):
        assert p.data_ptr() == wbase + 4 * start
        assert p.grad.data_ptr() == gbase + 4 * start
    fm.check_views()


def test_flattening_keeps_the_initial_weights():
    x = torch.randn(2, 3, 32, 32)
    ref = build_model("cifar10_full", 10, (3, 32, 32), seed=0)
    fm = _flat(seed=0)
    with torch.no_grad():
        torch.testing.assert_close(fm.module(x), ref(x), rtol=0, atol=0)
    np.testing.assert_array_equal(
        fm.weights, torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).numpy()
    )


def test_backward_accumulates_into_the_flat_grads_buffer_in_place():
    fm = _flat()
    ref = build_model("cifar10_full", 10, (3, 32, 32), seed=0)
    _loss(ref).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy()

    _loss(fm.module).backward()
    fm.check_views()
    np.testing.assert_allclose(fm.grads, expected, rtol=1e-5, atol=1e-9)
    _loss(fm.module).backward()  # a second pass adds to the first, as autograd does
    np.testing.assert_allclose(fm.grads, 2 * expected, rtol=1e-5, atol=1e-9)


def test_zero_grad_zeroes_in_place_and_the_next_backward_lands_in_the_buffer_again():
    fm = _flat()
    grads_before = fm.grads
    for _ in range(2):
        fm.zero_grad()
        assert not fm.grads.any()
        _loss(fm.module).backward()
        fm.check_views()
        assert fm.grads is grads_before and np.abs(fm.grads).sum() > 0


def test_writing_weights_changes_the_module_output():
    fm = _flat("mlp", (2, 4, 4))
    x = torch.randn(3, 2, 4, 4)
    with torch.no_grad():
        before = fm.module(x).clone()
        fm.weights[:] = 0
        torch.testing.assert_close(fm.module(x), torch.zeros(3, 10))
        fm.weights[-10:] = 1.5  # the last layer's bias
        torch.testing.assert_close(fm.module(x), torch.full((3, 10), 1.5))
    assert not torch.equal(before, fm.module(x))


def test_a_torch_optimizer_step_updates_the_flat_weights():
    fm = _flat("mlp", (1, 3, 3))
    opt = torch.optim.SGD(fm.module.parameters(), lr=0.1)
    w0 = fm.weights.copy()
    _loss(fm.module, shape=(1, 3, 3)).backward()
    opt.step()
    np.testing.assert_allclose(fm.weights, w0 - 0.1 * fm.grads, rtol=1e-6, atol=1e-7)


def test_check_views_catches_a_set_to_none_zero_grad():
    fm = _flat("mlp", (1, 3, 3))
    torch.optim.SGD(fm.module.parameters(), lr=0.1).zero_grad()  # set_to_none=True by default
    with pytest.raises(RuntimeError, match="grad None.*FlatModel.zero_grad"):
        fm.check_views()
    _loss(fm.module, shape=(1, 3, 3)).backward()  # fresh, unshared grads now
    with pytest.raises(RuntimeError, match="no longer aliases the flat grad"):
        fm.check_views()
    assert not fm.grads.any()


def test_check_views_catches_a_dtype_move():
    fm = _flat("mlp", (1, 3, 3))
    fm.module.double()
    with pytest.raises(RuntimeError, match="no longer aliases.*float64"):
        fm.check_views()


def test_load_weights_accepts_arrays_and_read_only_buffers():
    fm = _flat("mlp", (1, 3, 3))
    src = np.arange(fm.numel, dtype=np.float32)
    fm.load_weights(src)
    np.testing.assert_array_equal(fm.weights, src)
    fm.load_weights(memoryview((src * 2).tobytes()))  # read-only, like a received zmq frame
    np.testing.assert_array_equal(fm.weights, src * 2)
    fm.load_weights(fm.weights)  # into itself: a no-op
    np.testing.assert_array_equal(fm.weights, src * 2)
    fm.check_views()


def test_load_weights_with_the_wrong_size_names_both_sizes():
    fm = _flat()
    with pytest.raises(ValueError, match="89,570 floats; the model has 89,578"):
        fm.load_weights(np.zeros(89_570, np.float32))
    with pytest.raises(ValueError, match="float32"):
        fm.load_weights(np.zeros(89_578, np.float64))
    with pytest.raises(ValueError, match="whole number of float32"):
        fm.load_weights(b"\0" * 7)


def test_signature_is_stable_and_tells_models_apart():
    a, b = _flat(seed=0), _flat(seed=1)
    assert a.signature == b.signature  # values differ, layout does not
    assert len(a.signature) == 16 and int(a.signature, 16) >= 0
    assert _flat("mlp", (3, 32, 32)).signature != a.signature
    assert _flat("mlp", (3, 32, 32)).signature != _flat("mlp", (3, 16, 16)).signature


def test_segments_follow_the_multipliers_and_merge_equal_neighbours():
    segs = _flat().segments()
    assert segs == [
        (0, 2400, 1.0, 1.0),
        (2400, 2432, 2.0, 1.0),
        (2432, 28032, 1.0, 1.0),
        (28032, 28064, 2.0, 1.0),
        (28064, 79328, 1.0, 1.0),  # conv3 w+b merged
        (79328, 89568, 1.0, 250.0),
        (89568, 89578, 2.0, 0.0),
    ]
    fm = _flat("mlp", (1, 3, 3))
    assert fm.segments() == [(0, fm.numel, 1.0, 1.0)]


def test_modules_it_cannot_flatten_are_refused():
    with pytest.raises(ValueError, match="no parameters"):
        FlatModel(torch.nn.ReLU())
    with pytest.raises(TypeError, match="float32"):
        FlatModel(torch.nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="multipliers"):
        FlatModel(torch.nn.Linear(2, 2), multipliers=[(4, 1.0, 1.0)])


# ------------------------------------------------------------------ staged (the GPU path)
def test_a_staged_model_moves_gradients_and_weights_only_through_its_two_copies():
    """staged=True on CPU runs the GPU path's logic (the module's buffers apart from the host
    arrays): backward writes only the module's gradient until grads_to_host; writing weights
    reaches the module only through weights_to_device (or load_weights). Same results as the
    plain model. tests/test_gpu.py runs it on a real GPU."""
    plain, staged = (
        _flat(seed=0),
        FlatModel(build_model("cifar10_full", 10, (3, 32, 32), seed=0), staged=True),
    )
    assert staged.staged and not plain.staged
    assert staged.weights.ctypes.data != staged._w.data_ptr()
    np.testing.assert_array_equal(staged.weights, plain.weights)  # the initial values
    staged.check_views()
    for fm in (plain, staged):
        fm.zero_grad()
        _loss(fm.module).backward()
    assert not staged.grads.any()  # not copied yet
    staged.grads_to_host()
    np.testing.assert_array_equal(staged.grads, plain.grads)
    staged.zero_grad()  # the module's gradient, kept as views
    staged.check_views()
    assert not staged._g.any() and staged.grads.any()
    new = np.linspace(-0.1, 0.1, staged.numel, dtype=np.float32)
    staged.weights[:] = new
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = staged.module(x).clone()
        staged.weights_to_device()
        plain.load_weights(new)
        torch.testing.assert_close(staged.module(x), plain.module(x), rtol=0, atol=0)
        assert not torch.equal(before, staged.module(x))
    staged.load_weights(np.zeros(staged.numel, np.float32))
    assert all(not p.any() for p in staged.module.parameters())


def test_runtime_device_names_are_checked_and_a_missing_gpu_is_a_clear_error():
    from rudra_zmq.config import ConfigError, load_config
    from rudra_zmq.devices import learner_device

    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", ""):
        with pytest.raises(ConfigError, match="runtime.device (is|must be str)"):
            load_config(None, [f"runtime.device={bad}"])
    for good in ("cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"runtime.device={good}"]).runtime.device == good
    assert learner_device("cpu", 3) == torch.device("cpu")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert learner_device("cuda", n + 1) == torch.device("cuda", 1 % n)
        with pytest.raises(RuntimeError, match=f"has {n} visible CUDA GPU"):
            learner_device(f"cuda:{n}", 0)
    else:
        with pytest.raises(RuntimeError, match="sees no CUDA GPU.*runtime.device=cpu"):
            learner_device("cuda", 0)
