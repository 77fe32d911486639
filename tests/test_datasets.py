"""load_dataset for every source (digits, synthetic, CIFAR-10 pickle/tree/tarball/download,
ImageFolder), its npz cache, and to_float."""

import pickle
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rudra_zmq.data import dataset_loaders
from rudra_zmq.data.datasets import (
    DATASET_NAMES,
    dataset_shape,
    dataset_size,
    load_dataset,
    to_float,
)

torch.set_num_threads(1)

SHARED_TARBALL = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz"


@pytest.fixture(autouse=True)
def cache(empty_cache):
    """Every test here starts from an empty cache of its own (conftest's empty_cache)."""
    return empty_cache


def _write_tree(root, splits=("train", "test"), classes=("cat", "dog"), n=3, size=(12, 10)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(img).save(root / split / c / f"{i:04d}.png")
    return root


def _write_cifar_pickles(folder, n=4):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for fname in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
        }
        with open(folder / fname, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)


def test_digits_are_8x8_uint8_split_1437_360_by_seed():
    a, b = load_dataset("digits", seed=0), load_dataset("digits", seed=0)
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8)
    assert a.x_train.dtype == np.uint8 and a.y_train.dtype == np.int64
    assert a.x_train.max() == 255 and a.classes == [str(i) for i in range(10)]
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(load_dataset("digits", seed=1).y_test, a.y_test)
    assert np.bincount(a.y_test).min() >= 35  # stratified: every digit ~36 times


def test_mean_and_std_are_per_channel_train_statistics():
    ds = load_dataset("synthetic", synthetic_shape=(3, 5, 4), synthetic_n=(50, 10))
    x = ds.x_train.astype(np.float64) / 255
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 2, 3)), rtol=1e-9)
    assert all(type(v) is float for v in ds.mean + ds.std)


def test_synthetic_data_is_deterministic_and_learnable():
    ds = load_dataset(
        "synthetic", synthetic_shape=(1, 6, 6), synthetic_n=(400, 100), num_classes=4, seed=7
    )
    again = load_dataset(
        "synthetic", synthetic_shape=(1, 6, 6), synthetic_n=(400, 100), num_classes=4, seed=7
    )
    np.testing.assert_array_equal(ds.x_test, again.x_test)
    assert ds.x_train.shape == (400, 1, 6, 6) and ds.num_classes == 4
    assert np.bincount(ds.y_train).tolist() == [100] * 4
    # Nearest class mean already separates the classes, so a model can learn them.
    xf = ds.x_train.reshape(400, -1).astype(float)
    centroids = np.stack([xf[ds.y_train == c].mean(0) for c in range(4)])
    dist = ((ds.x_test.reshape(100, 1, -1) - centroids[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == ds.y_test).mean() > 0.9


def test_to_float_normalizes_per_channel_for_arrays_and_tensors():
    x = np.random.default_rng(0).integers(0, 256, (2, 3, 4, 5), dtype=np.uint8)
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.25, 0.5)
    ref = (x / 255.0 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    for src in (x, torch.from_numpy(x), x[0]):
        out = to_float(src, mean, std)
        assert out.dtype == torch.float32
        np.testing.assert_allclose(out.numpy(), ref if src.ndim == 4 else ref[0], atol=1e-5)
    with pytest.raises(ValueError, match="len\\(mean\\)=2"):
        to_float(x, (0.1, 0.2), (1.0, 1.0))
    with pytest.raises(TypeError, match="uint8"):
        to_float(x.astype(np.float32), mean, std)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="mnist"), "'mnist'.*digits, cifar10, imagefolder, synthetic"),
        (dict(name="synthetic", synthetic_shape=(3, 0, 4)), "synthetic_shape.*\\(3, 0, 4\\)"),
        (dict(name="synthetic", synthetic_n=(10,)), "synthetic_n"),
        (dict(name="digits", limit_per_class=0), "limit_per_class.*0"),
        (dict(name="cifar10", image_size=64), "image_size=64"),
        (dict(name="imagefolder"), "imagefolder needs root"),
    ],
)
def test_bad_arguments_are_named_in_the_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_dataset(**kwargs)
    assert "digits" in DATASET_NAMES


def test_cifar10_without_data_says_where_it_looked_and_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("cifar10", root=tmp_path / "nothing")
    msg = str(err.value)
    assert str(tmp_path / "nothing") in msg and "does not exist" in msg and "\n" not in msg
    for form in (
        "cifar-10-batches-py",
        "train/<class>",
        "test/<class>",
        ".tar.gz",
        "download: true",
    ):
        assert form in msg
    assert "../shared" not in msg  # a path only this repository's developers have


def test_cifar10_default_root_is_in_the_cache_dir(cache):
    with pytest.raises(FileNotFoundError, match=str(cache / "cifar10")):
        load_dataset("cifar10")


def test_cifar10_reads_the_python_pickle_release(tmp_path):
    _write_cifar_pickles(tmp_path / "cifar-10-batches-py")
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        ds = load_dataset("cifar10", root=root)
        assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
        assert ds.classes == [f"c{i}" for i in range(10)]
    limited = load_dataset("cifar10", root=tmp_path, limit_per_class=1)
    assert np.bincount(limited.y_train).max() == 1


def test_cifar10_download_goes_through_torchvision(tmp_path, monkeypatch):
    import torchvision

    calls = []

    def fake_cifar10(root, train, download):
        calls.append((root, train, download))
        if not (Path(root) / "cifar-10-batches-py").exists():
            _write_cifar_pickles(Path(root) / "cifar-10-batches-py")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", fake_cifar10)
    ds = load_dataset("cifar10", root=tmp_path, download=True)
    assert calls == [(str(tmp_path), True, True), (str(tmp_path), False, True)]
    assert ds.x_train.shape == (20, 3, 32, 32)


def test_an_imagefolder_tree_is_resized_center_cropped_and_cached(tmp_path, monkeypatch, cache):
    root = _write_tree(tmp_path / "imgs", splits=("train", "val"), n=3, size=(20, 12))
    ds = load_dataset("imagefolder", root=root, image_size=8)
    assert ds.x_train.shape == (6, 3, 8, 8) and ds.x_test.shape == (6, 3, 8, 8)
    assert ds.classes == ["cat", "dog"] and ds.y_train.tolist() == [0, 0, 0, 1, 1, 1]
    assert len(list(cache.rglob("*.npz"))) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("the second load should come from the npz cache")

    monkeypatch.setattr(dataset_loaders, "decode_all", no_decoding)
    again = load_dataset("imagefolder", root=root, image_size=8)
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    assert again.classes == ds.classes and again.mean == ds.mean


def test_a_tarball_loads_like_the_tree_it_was_made_from(tmp_path):
    root = _write_tree(tmp_path / "tree", classes=("a", "b", "c"), n=4, size=(32, 32))
    tarball = tmp_path / "imgs.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        for split in ("train", "test"):
            tf.add(root / split, arcname=split)
    from_tree = load_dataset("cifar10", root=root, limit_per_class=3)
    from_tar = load_dataset("cifar10", root=tarball, limit_per_class=3)
    assert from_tar.x_train.shape == (9, 3, 32, 32)
    np.testing.assert_array_equal(from_tar.x_train, from_tree.x_train)
    np.testing.assert_array_equal(from_tar.y_test, from_tree.y_test)


def test_images_of_different_sizes_need_image_size(tmp_path):
    root = _write_tree(tmp_path / "tree", n=2, size=(32, 32))
    from PIL import Image

    Image.new("RGB", (40, 32)).save(root / "train" / "cat" / "0009.png")
    with pytest.raises(ValueError, match="differ in size.*image_size"):
        load_dataset("cifar10", root=root)


def test_a_damaged_cache_file_is_rebuilt(tmp_path, cache):
    root = _write_tree(tmp_path / "tree", n=2, size=(32, 32))
    first = load_dataset("cifar10", root=root)
    (npz,) = cache.rglob("*.npz")
    npz.write_bytes(b"not a zip")
    again = load_dataset("cifar10", root=root)
    np.testing.assert_array_equal(again.x_test, first.x_test)


@pytest.mark.skipif(
    not SHARED_TARBALL.is_file(), reason=f"CIFAR-10 JPEG tarball not found at {SHARED_TARBALL}"
)
def test_the_shared_cifar10_tarball_loads_and_then_comes_from_the_cache(cache):
    ds = load_dataset("cifar10", root=SHARED_TARBALL, limit_per_class=20)
    assert ds.x_train.shape == (200, 3, 32, 32) and ds.x_test.shape == (200, 3, 32, 32)
    assert ds.classes == [
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ]
    assert np.bincount(ds.y_train).tolist() == [20] * 10
    assert 0.3 < min(ds.mean) < max(ds.mean) < 0.7
    start = time.perf_counter()
    again = load_dataset("cifar10", root=SHARED_TARBALL, limit_per_class=20)
    assert time.perf_counter() - start < 1.0
    np.testing.assert_array_equal(again.x_train, ds.x_train)


def _data_cfg(**kw):
    base = dict(
        dataset="digits",
        root=None,
        download=False,
        image_size=None,
        synthetic_shape=[3, 32, 32],
        synthetic_train=4096,
        synthetic_test=512,
        num_classes=10,
        limit_per_class=None,
    )
    return SimpleNamespace(**(base | kw))


def test_dataset_shape_and_size_match_what_load_dataset_returns(tmp_path):
    root = _write_tree(tmp_path / "tree", n=3, size=(32, 32))
    cases = [
        (_data_cfg(), load_dataset("digits")),
        (
            _data_cfg(dataset="synthetic", synthetic_shape=[2, 5, 6], synthetic_train=30),
            load_dataset("synthetic", synthetic_shape=(2, 5, 6), synthetic_n=(30, 10)),
        ),
        (_data_cfg(dataset="cifar10", root=str(root)), load_dataset("cifar10", root=root)),
        (
            _data_cfg(dataset="imagefolder", root=str(root), image_size=8),
            load_dataset("imagefolder", root=root, image_size=8),
        ),
        (_data_cfg(limit_per_class=7), load_dataset("digits", limit_per_class=7)),
    ]
    for cfg, ds in cases:
        assert dataset_shape(cfg) == ds.shape, cfg.dataset
        assert dataset_size(cfg) == len(ds.y_train), cfg.dataset
    assert dataset_shape(_data_cfg(dataset="imagefolder")) == (3, 224, 224)
    with pytest.raises(ValueError, match="'mnist'"):
        dataset_size(_data_cfg(dataset="mnist"))
