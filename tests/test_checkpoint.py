"""checkpoint: saves are atomic and verified, and a damaged newest checkpoint falls back to the
previous one with a warning that names the file and the problem."""

import hashlib
import json
import logging
import os
import re

import numpy as np
import pytest

from rudra_zmq.server import checkpoint
from rudra_zmq.server.checkpoint import CheckpointError, list_checkpoints, load_latest, save


def _arrays(step):
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) + step,
        "n": np.array([step, -step], dtype=np.int64),
    }


def _two_checkpoints(d):
    """Save step 1 and step 2; returns step 2's path (the newest)."""
    save(d, _arrays(1), {"step": 1})
    return save(d, _arrays(2), {"step": 2})


def _fix_manifest(ckpt, name, **entry):
    """Rewrite fields of one array's manifest entry, as a forger would."""
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["arrays"][name].update(entry)
    path.write_text(json.dumps(manifest))


def _assert_fell_back(d, caplog, newest, *words):
    """load_latest returns step 1 and warned once, naming the newest path and ``words``."""
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.checkpoint"):
        ckpt = load_latest(d)
    assert ckpt.meta == {"step": 1} and ckpt.path == d / "ckpt-00000001"
    np.testing.assert_array_equal(ckpt.arrays["w"], _arrays(1)["w"])
    [record] = [r for r in caplog.records if r.name == "rudra_zmq.checkpoint"]
    message = record.getMessage()
    assert record.levelno == logging.WARNING and str(newest) in message
    message = message.replace(str(d), "")  # tmp_path holds the test's name: not evidence
    for word in ("falling back to the previous", *words):
        assert word in message


def test_save_then_load_latest_round_trips_every_array_and_the_meta(tmp_path):
    d = tmp_path / "new" / "ckpts"  # created by save
    arrays = {
        "w": np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32),
        "steps": np.array([1, 2**40, -3], dtype=np.int64),
        "lr": np.array(0.25),  # 0-d
        "empty": np.zeros((0, 3), dtype=np.float32),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided": np.arange(10, dtype=np.int32)[::3],
        "mask": np.array([True, False]),
    }
    meta = {"step": 7, "config": {"lr": 0.1, "name": "x"}, "seen": [1, 2]}
    path = save(d, arrays, meta)
    assert path == d / "ckpt-00000001" and list_checkpoints(d) == [path]
    ckpt = load_latest(d)
    assert ckpt.path == path and ckpt.meta == meta and ckpt.arrays.keys() == arrays.keys()
    for name, arr in arrays.items():
        got = ckpt.arrays[name]
        assert type(got) is np.ndarray and got.flags.writeable, name  # no memmap, no view
        assert got.dtype == arr.dtype and got.shape == arr.shape, name
        np.testing.assert_array_equal(got, arr)
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]


def test_keep_two_leaves_only_the_two_newest_checkpoints(tmp_path):
    for step in range(1, 5):
        save(tmp_path, _arrays(step), {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "ckpt-00000004"]
    assert load_latest(tmp_path).meta == {"step": 4}


def test_numbering_continues_after_older_checkpoints_are_deleted(tmp_path):
    for step in range(1, 4):
        save(tmp_path, _arrays(step), {"step": step}, keep=1)
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-00000003"]
    (tmp_path / "ckpt-00000003").rename(tmp_path / "ckpt-00000009")  # e.g. restored by hand
    assert save(tmp_path, _arrays(4), {"step": 4}, keep=3) == tmp_path / "ckpt-00000010"
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-00000010", tmp_path / "ckpt-00000009"]


def test_list_checkpoints_is_newest_first_and_skips_other_names(tmp_path):
    for name in ["ckpt-00000002", "ckpt-00000010", "ckpt-00000001", "ckpt-7", "other", ".tmp-abc"]:
        (tmp_path / name).mkdir()
    (tmp_path / "ckpt-00000011").write_text("a file, not a checkpoint")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-00000010",
        "ckpt-00000002",
        "ckpt-00000001",
    ]


def test_truncated_newest_array_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    newest = _two_checkpoints(tmp_path)
    npy = newest / "w.npy"
    os.truncate(npy, npy.stat().st_size // 2)
    _assert_fell_back(tmp_path, caplog, newest, "w.npy", "truncated")


def test_one_flipped_bit_in_the_newest_array_falls_back_to_the_previous(tmp_path, caplog):
    newest = _two_checkpoints(tmp_path)
    data = bytearray((newest / "w.npy").read_bytes())
    data[-5] ^= 0x10  # inside the float data: np.load alone would accept it
    (newest / "w.npy").write_bytes(bytes(data))
    _assert_fell_back(tmp_path, caplog, newest, "w.npy", "sha256 mismatch")


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda c: (c / "manifest.json").unlink(), ["manifest.json", "missing"]),
        (
            lambda c: (c / "manifest.json").write_text('{"format": 1, "arr'),
            ["manifest.json", "does not parse"],
        ),
        (
            lambda c: (c / "manifest.json").write_text('{"format": 2, "arrays": {}}'),
            ["manifest.json", "format 2"],
        ),
        (lambda c: (c / "n.npy").unlink(), ["n.npy", "missing"]),
        (lambda c: _fix_manifest(c, "n", shape=[3]), ["n.npy", "the manifest says int64 [3]"]),
    ],
    ids=[
        "manifest-missing",
        "manifest-corrupt",
        "manifest-format",
        "npy-missing",
        "shape-mismatch",
    ],
)
def test_a_damaged_manifest_or_missing_file_falls_back_to_the_previous(
    tmp_path, caplog, damage, words
):
    newest = _two_checkpoints(tmp_path)
    damage(newest)
    _assert_fell_back(tmp_path, caplog, newest, *words)


def test_pickled_object_array_is_refused_by_load_even_with_a_matching_manifest(tmp_path, caplog):
    newest = _two_checkpoints(tmp_path)
    npy = newest / "w.npy"
    obj = np.array([1, "two", None], dtype=object)
    with open(npy, "wb") as f:
        np.save(f, obj, allow_pickle=True)
    raw = npy.read_bytes()
    _fix_manifest(
        newest,
        "w",
        dtype="object",
        shape=[3],
        bytes=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
    )
    _assert_fell_back(tmp_path, caplog, newest, "w.npy", "allow_pickle=False")


def test_all_checkpoints_damaged_raises_an_error_naming_each_path(tmp_path, caplog):
    newest = _two_checkpoints(tmp_path)
    oldest = tmp_path / "ckpt-00000001"
    (newest / "manifest.json").unlink()
    os.truncate(oldest / "n.npy", 10)
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.checkpoint"):
        with pytest.raises(CheckpointError) as err:
            load_latest(tmp_path)
    message = str(err.value)
    assert str(newest) in message and str(oldest) in message
    message = message.replace(str(tmp_path), "")
    for word in ("manifest.json missing", "n.npy truncated", "Start a new run", "restore a copy"):
        assert word in message
    assert len(caplog.records) == 2


def test_no_checkpoints_gives_none(tmp_path):
    assert load_latest(tmp_path / "never-made") is None
    assert load_latest(tmp_path) is None
    assert list_checkpoints(tmp_path / "never-made") == []


def test_a_leftover_tmp_dir_is_ignored_by_load_and_removed_by_the_next_save(tmp_path, caplog):
    first = save(tmp_path, _arrays(1), {"step": 1})
    leftover = tmp_path / ".tmp-crashed"
    leftover.mkdir()
    (leftover / "w.npy").write_bytes(b"half a file")
    old = first.stat().st_mtime - 60  # the crash happened a minute ago
    os.utime(leftover, (old, old))
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.checkpoint"):
        assert load_latest(tmp_path).path == first
    assert not caplog.records
    second = save(tmp_path, _arrays(2), {"step": 2})
    assert sorted(tmp_path.iterdir()) == [first, second]


def test_a_save_that_fails_midway_leaves_no_trace_and_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    first = save(tmp_path, _arrays(1), {"step": 1})

    def disk_full(path, arr):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_array", disk_full)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, _arrays(2), {"step": 2})
    assert list(tmp_path.iterdir()) == [first]
    assert load_latest(tmp_path).meta == {"step": 1}


@pytest.mark.parametrize("name", ["a/b", "../up", "", "w.npy", "naïve", "a b"])
def test_a_bad_array_name_is_refused_naming_it_before_anything_is_written(tmp_path, name):
    with pytest.raises(ValueError, match=re.escape(f"array name {name!r}")):
        save(tmp_path / "d", {"ok": np.zeros(2), name: np.zeros(2)}, {})
    assert not (tmp_path / "d").exists()


def test_an_object_array_is_refused_by_save(tmp_path):
    with pytest.raises(TypeError, match="'o' is dtype object"):
        save(tmp_path, {"o": np.array([1, None], dtype=object)}, {})
    with pytest.raises(TypeError, match="'s' is dtype <U1"):
        save(tmp_path, {"s": np.array(["a"])}, {})
    assert list(tmp_path.iterdir()) == []


def test_meta_that_json_cannot_write_is_refused_naming_the_meta(tmp_path):
    with pytest.raises(TypeError, match="meta is not JSON-serialisable.*float32"):
        save(tmp_path, {}, {"lr": np.float32(0.1)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [0, -1, 1.5])
def test_keep_below_one_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep={keep!r}"):
        save(tmp_path, _arrays(1), {}, keep=keep)
