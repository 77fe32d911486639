"""The model zoo: Caffe's cifar10_full reproduced exactly, the small models, seeds, multipliers."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rudra_zmq.models import (
    CIFAR10_FULL_MULTS,
    MODEL_NAMES,
    WithinChannelLRN,
    build_model,
    param_multipliers,
)

torch.set_num_threads(1)


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_cifar10_full_has_89578_parameters_at_3x32x32():
    assert _n_params(build_model("cifar10_full", 10, (3, 32, 32))) == 89_578


def test_cifar10_full_pools_in_caffe_ceil_mode_32_16_8_4():
    model = build_model("cifar10_full", 10, (3, 32, 32))
    sizes = []
    for pool in (model.pool1, model.pool2, model.pool3):
        pool.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[1:])))
    out = model(torch.randn(2, 3, 32, 32))
    assert sizes == [(32, 16, 16), (32, 8, 8), (64, 4, 4)]
    assert out.shape == (2, 10)
    assert model.ip1.in_features == 64 * 4 * 4


def test_cifar10_full_layer_order_follows_the_prototxt():
    model = build_model("cifar10_full", 10, (3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    h = model.norm1(F.relu(F.max_pool2d(model.conv1(x), 3, 2, ceil_mode=True)))
    h = model.norm2(F.avg_pool2d(F.relu(model.conv2(h)), 3, 2, ceil_mode=True))
    h = F.avg_pool2d(F.relu(model.conv3(h)), 3, 2, ceil_mode=True)
    torch.testing.assert_close(model(x), model.ip1(h.flatten(1)))


def test_caffe_average_pooling_divides_edge_windows_by_the_pixels_they_cover():
    model = build_model("cifar10_full", 10, (3, 32, 32))
    # With ceil mode the last window hangs over the edge; Caffe divides by what it covers.
    x = torch.arange(16 * 16, dtype=torch.float32).view(1, 1, 16, 16)
    out = model.pool2(x)
    assert out.shape == (1, 1, 8, 8)
    torch.testing.assert_close(out[0, 0, 7, 7], x[0, 0, 14:, 14:].mean())
    torch.testing.assert_close(out[0, 0, 0, 0], x[0, 0, :3, :3].mean())


def test_within_channel_lrn_matches_caffes_formula_elementwise():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64) * 30
    lrn = WithinChannelLRN(3, 5e-5, 0.75)
    padded = F.pad(x * x, (1, 1, 1, 1))
    ref = torch.empty_like(x)
    for i in range(5):
        for j in range(6):
            window_sum = padded[:, :, i : i + 3, j : j + 3].sum(dim=(2, 3))
            ref[:, :, i, j] = x[:, :, i, j] / (1 + 5e-5 * window_sum / 9) ** 0.75
    torch.testing.assert_close(lrn(x), ref)


def test_cifar10_full_uses_caffe_gaussian_fillers_and_zero_biases():
    model = build_model("cifar10_full", 10, (3, 32, 32))
    for layer, std in (
        (model.conv1, 1e-4),
        (model.conv2, 0.01),
        (model.conv3, 0.01),
        (model.ip1, 0.01),
    ):
        assert float(layer.weight.detach().std()) == pytest.approx(std, rel=0.1)
        assert float(layer.weight.detach().mean()) == pytest.approx(0.0, abs=std / 10)
        assert not layer.bias.any()


def test_cifar10_full_multipliers_match_the_prototxt():
    model = build_model("cifar10_full", 10, (3, 32, 32))
    names = [n for n, _ in model.named_parameters()]
    assert names == list(CIFAR10_FULL_MULTS)
    mults = param_multipliers(model)
    assert [m[0] for m in mults] == [2400, 32, 25600, 32, 51200, 64, 10240, 10]
    assert [m[1:] for m in mults] == [
        (1.0, 1.0),
        (2.0, 1.0),
        (1.0, 1.0),
        (2.0, 1.0),
        (1.0, 1.0),
        (1.0, 1.0),
        (1.0, 250.0),
        (2.0, 0.0),
    ]


@pytest.mark.parametrize("name,shape", [("digits_cnn", (1, 8, 8)), ("mlp", (2, 5, 7))])
def test_other_models_have_unit_multipliers(name, shape):
    model = build_model(name, 10, shape)
    mults = param_multipliers(model)
    assert sum(m[0] for m in mults) == _n_params(model)
    assert all(m[1:] == (1.0, 1.0) for m in mults)


def test_a_plain_module_gets_unit_multipliers():
    lin = torch.nn.Linear(3, 2)
    assert param_multipliers(lin) == [(6, 1.0, 1.0), (2, 1.0, 1.0)]


def test_same_seed_builds_the_same_weights_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a = build_model("cifar10_full", 10, (3, 32, 32), seed=3)
    b = build_model("cifar10_full", 10, (3, 32, 32), seed=3)
    c = build_model("cifar10_full", 10, (3, 32, 32), seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.conv2.weight, c.conv2.weight)


@pytest.mark.timeout(120)
def test_builds_in_many_threads_at_once_give_each_seed_its_weights():
    """Learners as threads build their models at once: each seeded build gets the weights a
    build alone gets (no draw of another thread's build interleaved), and none hangs (two
    threads in fork_rng deadlocked in torch 2.14: a generator mutex against the GIL)."""
    import threading

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()

    alone = {seed: flat(build_model("cifar10_full", 10, (3, 32, 32), seed=seed)) for seed in (1, 2)}
    got, errors = [], []

    def work(seed):
        try:
            for _ in range(5):
                got.append((seed, flat(build_model("cifar10_full", 10, (3, 32, 32), seed=seed))))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(1 + i % 2,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a build hung"
    assert not errors and len(got) == 40, errors
    for seed, w in got:
        np.testing.assert_array_equal(w, alone[seed])


def test_unknown_model_name_lists_the_valid_names():
    with pytest.raises(ValueError, match="resnet.*cifar10_full, digits_cnn, alexnet, mlp"):
        build_model("resnet", 10, (3, 32, 32))
    assert set(MODEL_NAMES) == {"cifar10_full", "digits_cnn", "alexnet", "mlp"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_classes=0), "num_classes"),
        (dict(in_shape=(3, 32)), "in_shape"),
        (dict(in_shape=(3, 2, 2)), "at least 3x3"),
    ],
)
def test_bad_arguments_are_named_in_the_error(kwargs, match):
    args = dict(name="cifar10_full", num_classes=10, in_shape=(3, 32, 32)) | kwargs
    with pytest.raises(ValueError, match=match):
        build_model(**args)


def test_alexnet_builds_for_imagenet_shapes_and_rejects_tiny_images():
    model = build_model("alexnet", 1000, (3, 224, 224))
    assert _n_params(model) == 61_100_840
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 224, 224)).shape == (1, 1000)
    with pytest.raises(ValueError, match="alexnet"):
        build_model("alexnet", 10, (3, 32, 32))


def test_mlp_takes_any_input_shape():
    model = build_model("mlp", 7, (2, 5, 3))
    assert model(torch.randn(4, 2, 5, 3)).shape == (4, 7)


def test_digits_cnn_reaches_95_percent_on_digits_with_momentum_sgd():
    from rudra_zmq.data.datasets import load_dataset, to_float

    ds = load_dataset("digits", seed=0)
    model = build_model("digits_cnn", 10, ds.shape, seed=0)
    assert 3_000 <= _n_params(model) <= 30_000
    x, y = to_float(ds.x_train, ds.mean, ds.std), torch.from_numpy(ds.y_train)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    for _ in range(8):
        for idx in np.array_split(rng.permutation(len(y)), len(y) // 32):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        pred = model(to_float(ds.x_test, ds.mean, ds.std)).argmax(1).numpy()
    assert (pred == ds.y_test).mean() >= 0.95


def test_each_model_gets_the_input_scale_it_was_designed_for():
    from rudra_zmq.models import input_transform

    x = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    mean, std = (0.5, 0.25, 0.125), (0.2, 0.4, 0.5)
    m = np.array(mean, dtype=np.float32).reshape(1, 3, 1, 1)
    s = np.array(std, dtype=np.float32).reshape(1, 3, 1, 1)
    # cifar10_full: Caffe's example feeds pixel values 0..255 minus the training mean
    caffe = input_transform("cifar10_full")(x, mean, std).numpy()
    np.testing.assert_allclose(caffe, x.astype(np.float32) - 255 * m, rtol=1e-6, atol=1e-4)
    for name in ("alexnet", "digits_cnn", "mlp"):  # torchvision's standardization
        out = input_transform(name)(x, mean, std).numpy()
        np.testing.assert_allclose(out, (x / 255.0 - m) / s, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'resnet'"):
        input_transform("resnet")
