"""Your own model and data, named by import path (``package.module:function``): one resolver
for both, the same model in every role, the data as the built-in datasets are, and a config
error naming the value before anything starts. No processes: see test_api.py for whole runs."""

import itertools
import sys
import textwrap

import numpy as np
import pytest
import torch

from rudra_zmq import models, user_code
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.data import datasets
from rudra_zmq.data.data_order import load_data
from rudra_zmq.flat import FlatModel
from rudra_zmq.user_code import UserCodeError

_names = itertools.count()

USER_MODULE = """
import sys
import numpy as np
import torch
from torch import nn

def mlp(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, num_classes))

HIDDEN = 16

def wide(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 17),
                         nn.Linear(17, num_classes))

def caffe(num_classes, input_shape):
    return mlp(num_classes, input_shape)

caffe.input_transform = "caffe_mean"

def not_a_model(num_classes, input_shape):
    return "a string"

def wrong_shape(num_classes, input_shape):
    return nn.Linear(5, num_classes)

def raises(num_classes, input_shape):
    raise RuntimeError("no model today")

def float64(num_classes, input_shape):
    return nn.Linear(int(np.prod(input_shape)), num_classes).double()

def arrays(root=None):
    rng = np.random.default_rng(0 if root is None else len(root))
    x = rng.integers(0, 256, (40, 1, 4, 4), dtype=np.uint8)
    y = np.arange(40) % 4
    return x[:32], y[:32], x[32:], y[32:]

def mapping():
    x, y, xt, yt = arrays()
    return {"x_train": x, "y_train": y.astype(np.int32), "x_test": xt, "y_test": yt,
            "classes": ["a", "b", "c", "d"]}

class Items:
    # a map-style dataset: (image, label) items, as torchvision's are
    def __init__(self, images, labels, classes=None):
        self.images, self.labels = images, labels
        if classes:
            self.classes = classes
    def __len__(self):
        return len(self.labels)
    def __getitem__(self, i):
        return self.images[i], self.labels[i]

def map_style():
    x, y, xt, yt = arrays()
    as_tensors = [torch.from_numpy(im).float() / 255 for im in x]      # ToTensor: C x H x W
    as_hwc = [np.ascontiguousarray(im.transpose(1, 2, 0)) for im in xt]  # PIL-like: H x W x C
    return Items(as_tensors, list(y), ["a", "b", "c", "d"]), Items(as_hwc, list(yt))

def floats():
    x, y, xt, yt = arrays()
    return x / 255.0, y, xt, yt

def three():
    x, y, xt, yt = arrays()
    return x, y, xt

def ragged_map_style():
    return Items([np.zeros((4, 4), np.uint8), np.zeros((5, 5), np.uint8)], [0, 1]), Items([], [])

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path):
    """A fresh module (a new name per test: models and data are remembered per process by
    path) written in tmp_path and importable from there; removed again afterwards."""
    name = f"user_code_case{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def config(module, model="mlp", data="arrays", *overrides):
    return load_config(
        None,
        [
            f"model.name={module}:{model}",
            f"data.dataset={module}:{data}",
            "data.num_classes=4",
            *overrides,
        ],
    )


def test_the_resolver_imports_the_module_and_returns_the_function(user_module):
    fn = user_code.resolve(f"{user_module}:mlp", "model.name")
    assert fn is sys.modules[user_module].mlp
    items_len = user_code.resolve(f"{user_module}:Items.__len__", "x")
    assert items_len is sys.modules[user_module].Items.__len__


@pytest.mark.parametrize(
    "value, says",
    [
        ("no_such_module_anywhere:f", "importing no_such_module_anywhere failed"),
        ("{m}:nope", "has no attribute 'nope'"),
        ("{m}:NOT_CALLABLE", "is a int, not a function"),
        ("{m}:not-an-identifier", "is not an import path"),
    ],
)
def test_a_path_that_does_not_resolve_is_an_error_naming_the_value(user_module, value, says):
    value = value.format(m=user_module)
    with pytest.raises(UserCodeError, match=says) as err:
        user_code.resolve(value, "model.name")
    assert f"model.name {value!r}" in str(err.value)


@pytest.mark.parametrize(
    "model, says",
    [
        ("not_a_model", "returned a str for \\(4, \\(1, 4, 4\\)\\); it must return a torch.nn.Mod"),
        ("wrong_shape", "fails on a batch of \\(2, 1, 4, 4\\) images"),
        ("raises", "raised RuntimeError: no model today"),
        ("float64", "parameter 'weight' is torch.float64 on cpu; build the model on the CPU"),
        ("nope", "has no attribute"),
    ],
)
def test_a_model_that_is_not_a_usable_module_is_a_config_error_before_anything_starts(
    user_module, model, says
):
    with pytest.raises(ConfigError, match=says) as err:
        config(user_module, model)
    assert f"model.name '{user_module}:{model}'" in str(err.value)


def test_a_dotted_name_without_a_colon_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError, match="with a colon before the function"):
        load_config(None, ["model.name=mypkg.models.small_cnn"])


def test_a_user_model_is_built_the_same_in_every_role_from_the_seed(user_module):
    cfg = config(user_module)
    state = torch.random.get_rng_state()
    a = FlatModel(models.build_model(cfg.model.name, 4, (1, 4, 4), seed=3))
    b = FlatModel(models.build_model(cfg.model.name, 4, (1, 4, 4), seed=3))
    c = FlatModel(models.build_model(cfg.model.name, 4, (1, 4, 4), seed=4))
    assert torch.equal(state, torch.random.get_rng_state()), "the global RNG must not move"
    assert np.array_equal(a.weights, b.weights) and a.signature == b.signature
    assert not np.array_equal(a.weights, c.weights)
    assert models.param_multipliers(a.module) == [(n, 1.0, 1.0) for n in (16 * 16, 16, 64, 4)]
    assert models.check_model(cfg.model.name, 4, (1, 4, 4)) == a.numel


def test_a_user_model_declares_its_input_transform_on_its_function(user_module):
    assert models.input_transform(f"{user_module}:mlp") == models.InputTransform("standardize")
    assert models.input_transform(f"{user_module}:caffe") == models.InputTransform("caffe_mean")
    sys.modules[user_module].mlp.input_transform = "sepia"
    with pytest.raises(UserCodeError, match="input_transform='sepia'"):
        models.input_transform(f"{user_module}:mlp")
    own = lambda x, mean, std: torch.zeros(3)  # noqa: E731 - any (x, mean, std) -> tensor
    sys.modules[user_module].mlp.input_transform = own
    assert models.input_transform(f"{user_module}:mlp") is own


def test_a_learner_whose_user_model_differs_from_the_ps_is_refused_naming_both_sizes(user_module):
    from rudra_zmq import wire
    from rudra_zmq.server.start import initial_model
    from rudra_zmq.server.state import ProtocolViolation, ServerState
    from rudra_zmq.wire import Kind

    ps_cfg = config(user_module, "mlp")
    weights, segments, signature, shape = initial_model(ps_cfg)
    state = ServerState(ps_cfg, weights, segments, signature, 32)
    other = FlatModel(models.build_model(f"{user_module}:wide", 4, shape, seed=0))
    hello = wire.decode(
        wire.encode(Kind.HELLO, 0, 1, 0, 0, [], model=other.signature, numel=other.numel)
    )
    with pytest.raises(ProtocolViolation) as err:
        state.register(b"0", hello)
    assert f"{other.numel:,} parameters" in str(err.value)
    assert f"this server holds {weights.size:,}" in str(err.value)


@pytest.mark.parametrize("data", ["arrays", "mapping", "map_style"])
def test_user_data_is_held_as_the_builtin_datasets_are(user_module, data):
    cfg = config(user_module, "mlp", data)
    ds = load_data(cfg)
    x, y, xt, yt = sys.modules[user_module].arrays()
    assert isinstance(ds, datasets.Dataset) and ds.x_train.dtype == np.uint8
    np.testing.assert_array_equal(ds.x_train, x)
    np.testing.assert_array_equal(ds.y_test, yt)
    assert ds.y_train.dtype == np.int64 and ds.num_classes == 4
    if data != "arrays":
        assert ds.classes == ["a", "b", "c", "d"]
    assert datasets.dataset_shape(cfg.data) == (1, 4, 4)
    assert datasets.dataset_size(cfg.data) == 32
    np.testing.assert_allclose(ds.mean, [x.mean() / 255])


def test_user_data_gets_data_root_and_keeps_limit_per_class(user_module):
    cfg = config(user_module, "mlp", "arrays", "data.root=abc", "data.limit_per_class=2")
    ds = load_data(cfg)
    assert len(ds.y_train) == 8 and len(ds.y_test) == 8
    assert datasets.dataset_size(cfg.data) == 8
    x_root = sys.modules[user_module].arrays("abc")[0]
    np.testing.assert_array_equal(
        ds.x_train,
        x_root[
            np.sort(np.concatenate([np.flatnonzero(np.arange(32) % 4 == c)[:2] for c in range(4)]))
        ],
    )


@pytest.mark.parametrize(
    "data, says",
    [
        ("floats", "x_train is float64 \\(32, 1, 4, 4\\); it must be uint8 .* np.rint"),
        ("three", "returned a tuple of 3; it must return \\(x_train, y_train, x_test, y_test\\)"),
        ("ragged_map_style", "train item 1 is \\(1, 5, 5\\) but item 0 is \\(1, 4, 4\\)"),
        ("mlp", "calling it with \\(\\) raised TypeError"),
    ],
)
def test_user_data_that_is_not_the_documented_arrays_is_a_config_error(user_module, data, says):
    with pytest.raises(ConfigError, match=says) as err:
        config(user_module, "mlp", data)
    assert f"data.dataset '{user_module}:{data}'" in str(err.value)


def test_too_few_classes_for_the_user_data_is_a_config_error(user_module):
    with pytest.raises(ConfigError, match="data.num_classes is 3 but .* has 4 classes"):
        config(user_module, "mlp", "arrays", "data.num_classes=3")


def test_a_user_model_trains_on_a_builtin_dataset(user_module):
    cfg = load_config(None, [f"model.name={user_module}:mlp", "data.dataset=digits"])
    assert models.check_model(cfg.model.name, 10, (1, 8, 8)) == 64 * 16 + 16 + 16 * 10 + 10


def test_import_root_is_the_folder_the_module_came_from(user_module, tmp_path):
    assert user_code.import_root(f"{user_module}:mlp") == str(tmp_path.resolve())
    assert user_code.import_root("numpy:zeros") is None  # installed: every process finds it
    assert user_code.import_root("no_such_module_anywhere:f") is None
