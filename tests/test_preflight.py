"""Inputs checked before any role starts (rudra_zmq/launch/preflight.py): a bad data.root, a file
that is no tarball, a missing extra end `rudra-zmq run` with one line and exit 2, nothing
created; a key the dataset ignores is a warning; image data are decoded once, by the
launcher, into the cache the roles read."""

import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from rudra_zmq import api, cli
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.data import datasets
from rudra_zmq.launch import launcher, preflight

pytestmark = pytest.mark.timeout(60)

SHARED_TARBALL = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz"


@pytest.fixture(autouse=True)
def cache(empty_cache):
    """Every test here starts from an empty cache of its own (conftest's empty_cache)."""
    return empty_cache


def write_tree(root: Path, classes=("cat", "dog", "emu"), n_train=4, n_test=2, size=8):
    """A small ImageFolder tree of tiny JPEGs: root/{train,test}/<class>/NNNN.jpg."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(img).save(root / split / c / f"{i:04d}.jpg")
    return root


def write_tarball(tree: Path, path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for split in ("train", "test"):
            tf.add(tree / split, arcname=split)
    return path


def run_cli(tmp_path, capsys, *sets, config="quickstart"):
    """`rudra-zmq run` in this process with a run_dir under tmp_path; (rc, stdout, stderr)."""
    args = ["run", config, "--set", f"runtime.run_dir={tmp_path / 'runs'}"]
    for s in sets:
        args += ["--set", s]
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(tmp_path, rc, err, *needles):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rudra-zmq: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    assert "Traceback" not in err and "../shared" not in err
    assert not (tmp_path / "runs").exists(), "a run directory was made for a run that failed"


@pytest.fixture
def no_roles(monkeypatch):
    """Fail the test if the launcher gets as far as starting roles."""

    def refuse(self):
        raise AssertionError("roles were started")

    monkeypatch.setattr(launcher.Launcher, "run", refuse)


# ------------------------------------------------------------------ one-line errors
def test_a_missing_cifar10_root_is_one_line_naming_it_and_what_to_do(tmp_path, capsys, no_roles):
    missing = tmp_path / "nowhere" / "cifar10.tar.gz"
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=cifar10", f"data.root={missing}")
    assert_one_line_error(
        tmp_path,
        rc,
        err,
        str(missing),
        "does not exist",
        "data.download: true",
        "cifar-10-batches-py",
        "ImageFolder",
        "train/<class>",
        ".tar.gz",
    )


def test_cifar10_with_no_root_and_nothing_in_the_cache_says_how_to_get_it(
    tmp_path, capsys, cache, no_roles
):
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=cifar10")
    assert_one_line_error(
        tmp_path, rc, err, str(cache / "cifar10"), "data.root is not set", "data.download: true"
    )


def test_a_random_file_named_tar_gz_is_one_line_naming_the_file(tmp_path, capsys, no_roles):
    bogus = tmp_path / "data.tar.gz"
    bogus.write_bytes(np.random.default_rng(0).bytes(4096))
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=cifar10", f"data.root={bogus}")
    assert_one_line_error(
        tmp_path, rc, err, str(bogus), "not a readable tar archive", "not a gzip file"
    )


def test_a_file_that_is_not_a_tarball_is_refused(tmp_path, capsys, no_roles):
    zipped = tmp_path / "cifar.zip"
    zipped.write_bytes(b"PK\x03\x04")
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=imagefolder", f"data.root={zipped}")
    assert_one_line_error(tmp_path, rc, err, str(zipped), "not a .tar.gz")


def test_a_tarball_without_images_in_the_layout_is_refused(tmp_path, capsys, no_roles):
    tarball = tmp_path / "flat.tar.gz"
    (tmp_path / "a.txt").write_text("no images here")
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(tmp_path / "a.txt", arcname="a.txt")
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=cifar10", f"data.root={tarball}")
    assert_one_line_error(tmp_path, rc, err, str(tarball), "train/<class>")


def test_a_truncated_tarball_is_one_line_naming_the_file(tmp_path, capsys, no_roles):
    tree = write_tree(tmp_path / "tree", n_train=30, n_test=10)
    whole = write_tarball(tree, tmp_path / "whole.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])  # its beginning reads: found when decoding
    rc, _, err = run_cli(
        tmp_path, capsys, "data.dataset=cifar10", f"data.root={cut}", "data.image_size=null"
    )
    assert_one_line_error(tmp_path, rc, err, str(cut))
    assert not list((tmp_path / "cache").rglob("*.npz"))


@pytest.mark.parametrize(
    "layout,needle", [("no_train", "no train/ folder"), ("no_test", "no test/ (or val/)")]
)
def test_an_imagefolder_tree_without_its_splits_is_refused(
    tmp_path, capsys, no_roles, layout, needle
):
    root = write_tree(tmp_path / "tree")
    import shutil

    shutil.rmtree(root / ("train" if layout == "no_train" else "test"))
    rc, _, err = run_cli(tmp_path, capsys, "data.dataset=imagefolder", f"data.root={root}")
    assert_one_line_error(tmp_path, rc, err, str(root), needle)


def test_tensorboard_without_the_extra_is_one_line_before_anything_starts(
    tmp_path, capsys, monkeypatch, no_roles
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    rc, _, err = run_cli(tmp_path, capsys, "logging.tensorboard=true")
    assert_one_line_error(
        tmp_path, rc, err, "logging.tensorboard", "pip install 'rudra_zmq[tensorboard]'"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["launch", "quickstart", "-H", "localhost:4"],
        ["launch", "quickstart", "-H", "localhost:4", "--dry-run"],
        ["worker", "quickstart", "--rank", "0", "--world-size", "5", "--master-addr", "127.0.0.1"],
    ],
)
def test_launch_and_the_servers_worker_check_the_data_before_anything_is_made(
    tmp_path, capsys, no_roles, command
):
    missing = tmp_path / "nowhere"
    rc = cli.main(
        [
            *command,
            "--set",
            f"runtime.run_dir={tmp_path / 'runs'}",
            "--set",
            "data.dataset=cifar10",
            "--set",
            f"data.root={missing}",
        ]
    )
    err = capsys.readouterr().err
    assert_one_line_error(tmp_path, rc, err, str(missing), "data.download: true")


def test_the_python_api_raises_the_same_config_error_and_creates_nothing(tmp_path, no_roles):
    with pytest.raises(ConfigError, match="does not exist"):
        api.train(
            "quickstart",
            {
                "data.dataset": "cifar10",
                "data.root": str(tmp_path / "x"),
                "runtime.run_dir": str(tmp_path / "runs"),
            },
            quiet=True,
        )
    assert not (tmp_path / "runs").exists()


def test_the_loaders_own_cifar10_error_names_the_forms_and_no_developer_path(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        datasets.load_dataset("cifar10", root=tmp_path / "nothing")
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "nothing") in msg and "../shared" not in msg
    for form in ("data.download: true", "cifar-10-batches-py", "train/<class>", ".tar.gz"):
        assert form in msg


def test_a_tarball_that_breaks_while_streaming_names_the_file(tmp_path):
    from rudra_zmq.data import images

    tree = write_tree(tmp_path / "tree", n_train=30, n_test=10)
    whole = write_tarball(tree, tmp_path / "whole.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=str(cut)):
        images.tar_items(cut, None)


# ---------------------------------------------------------------------------- warnings
def test_a_data_key_the_dataset_ignores_is_a_warning(tmp_path):
    cfg = load_config("quickstart", [f"data.root={tmp_path}", "data.download=true"])
    warnings = preflight.check(cfg)
    assert len(warnings) == 2
    assert "data.root" in warnings[1] and "ignored by data.dataset=digits" in warnings[1]
    assert "data.download=True" in warnings[0]
    assert preflight.check(load_config("quickstart")) == []
    tree = write_tree(tmp_path / "tree")
    assert (
        preflight.check(load_config(None, ["data.dataset=imagefolder", f"data.root={tree}"])) == []
    )


def test_the_warning_reaches_the_terminal_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(launcher.Launcher, "run", lambda self: started.append(self) or 0)
    rc, _, err = run_cli(tmp_path, capsys, f"data.root={tmp_path}")
    assert rc == 0 and started
    assert f"rudra-zmq: warning: data.root={str(tmp_path)!r} is ignored" in err


# --------------------------------------------------------------------- decoded once
def test_the_launcher_decodes_the_images_into_the_cache_before_anything_exists(
    tmp_path, capsys, monkeypatch, cache
):
    tree = write_tree(tmp_path / "tree")
    seen = {}

    def fake_run(self):
        found = datasets.image_cache(self.plan.cfg.data)
        seen["cached"] = found is not None and found[1].is_file()
        return 0

    monkeypatch.setattr(launcher.Launcher, "run", fake_run)
    rc, out, _ = run_cli(
        tmp_path, capsys, "data.dataset=imagefolder", f"data.root={tree}", "data.image_size=8"
    )
    assert rc == 0 and seen == {"cached": True}
    assert f"data: decoding {tree} once into" in out and "data: 18 images decoded" in out
    assert out.index("data: decoding") < out.index("run directory")
    rc, out, _ = run_cli(
        tmp_path, capsys, "data.dataset=imagefolder", f"data.root={tree}", "data.image_size=8"
    )
    assert rc == 0 and "data: decoding" not in out  # the second run reads the cache


def test_too_few_classes_for_the_data_is_caught_before_the_roles(tmp_path, capsys, no_roles):
    tree = write_tree(tmp_path / "tree")
    rc, _, err = run_cli(
        tmp_path,
        capsys,
        "data.dataset=imagefolder",
        f"data.root={tree}",
        "data.image_size=8",
        "data.num_classes=2",
    )
    assert_one_line_error(tmp_path, rc, err, "data.num_classes=3")


WAITER = """
import sys
from rudra_zmq.data import dataset_loaders, datasets
def decode(*args, **kwargs):
    print("DECODED", flush=True)
    raise SystemExit(3)
if sys.argv[2] == "no-decode":
    dataset_loaders.decode_dataset = decode
ds = datasets.load_dataset("imagefolder", root=sys.argv[1], image_size=8)
print("LOADED", len(ds.y_train), flush=True)
"""


def _waiter(tree, mode="no-decode"):
    """A process loading ``tree``; (Popen, its first stderr line: the 'waiting' note)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(tree), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stderr.readline()


def test_a_process_that_finds_the_cache_being_made_waits_and_reads_it(tmp_path):
    from rudra_zmq.data import dataset_cache, dataset_loaders, images

    tree = write_tree(tmp_path / "tree")
    root, path = datasets.image_cache(
        load_config(
            None, ["data.dataset=imagefolder", f"data.root={tree}", "data.image_size=8"]
        ).data
    )
    with dataset_cache.locked(path):  # this test is "the other process, decoding"
        proc, note = _waiter(tree)
        try:
            assert "another process is decoding" in note and str(path.parent) in note
            ds = dataset_loaders.decode_dataset(
                "imagefolder", root, images.tree_items(root, None), 8, 1, False
            )
            assert dataset_cache.write(path, ds)
        except BaseException:
            proc.kill()
            raise
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.split() == ["LOADED", "12"], (out, err)


def test_a_decoder_that_dies_leaves_no_lock_and_no_torn_cache(tmp_path):
    from rudra_zmq.data import dataset_cache

    tree = write_tree(tmp_path / "tree")
    _, path = datasets.image_cache(
        load_config(
            None, ["data.dataset=imagefolder", f"data.root={tree}", "data.image_size=8"]
        ).data
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from rudra_zmq.data import dataset_cache\n"
                f"with dataset_cache.locked(Path({str(path)!r})):\n"
                "    print('HELD', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
        proc, note = _waiter(tree, "decode")
        assert "another process is decoding" in note
    finally:
        holder.kill()  # like kill -9 mid-write: the kernel drops its lock
        holder.wait()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.split() == ["LOADED", "12"], (out, err)
    assert path.is_file() and dataset_cache.read(path, "imagefolder") is not None


def test_a_cache_write_that_fails_midway_leaves_no_file(tmp_path, monkeypatch):
    from rudra_zmq.data import dataset_cache

    ds = datasets.load_dataset("synthetic", synthetic_shape=(1, 4, 4), synthetic_n=(20, 10))
    path = tmp_path / "c" / "x.npz"

    def broken(f, **arrays):
        f.write(b"PK half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", broken)
    assert dataset_cache.write(path, ds) is False
    assert list(path.parent.iterdir()) == []


@pytest.mark.skipif(
    not SHARED_TARBALL.is_file(), reason=f"CIFAR-10 JPEG tarball not found at {SHARED_TARBALL}"
)
def test_the_shared_cifar10_tarball_passes_the_cheap_check(tmp_path):
    from rudra_zmq.data import images

    images.check_tarball(SHARED_TARBALL)
    cfg = load_config("cifar10_baseline", [f"data.root={SHARED_TARBALL}"])
    assert preflight.check(cfg) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_run_from_an_empty_cache_decodes_once_before_the_roles(tmp_path, cache):
    tree = write_tree(tmp_path / "tree", n_train=40, n_test=10)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rudra_zmq", "run", "quickstart", "--run-dir", str(run_dir)]
    for s in (
        "data.dataset=imagefolder",
        f"data.root={tree}",
        "data.image_size=8",
        "model.name=mlp",
        "sync.learners=2",
        "train.epochs=2",
        "runtime.timeout_s=100",
    ):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("data: decoding") == 1 and "data: 150 images decoded" in proc.stdout
    # the images' cache (the PS's initial weights have one of their own beside it), written
    # before the run directory, and never again: no role decoded
    _, npz = datasets.image_cache(load_config(run_dir / "config.yaml").data, cache)
    assert [p for p in cache.rglob("*.npz") if p.parent == npz.parent] == [npz]
    assert npz.stat().st_mtime_ns <= (run_dir / "config.yaml").stat().st_mtime_ns
    logs = "".join(p.read_text() for p in (run_dir / "logs").iterdir())
    assert "another process is decoding" not in logs


def test_decoding_says_how_far_it_got_at_least_every_few_seconds(monkeypatch, capsys):
    """A launcher stops a role whose log stops growing; a slow decode must not look stuck."""
    from rudra_zmq.data import images

    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain lines, not a bar
    bar = images._Progress(1000, True)
    bar.update(1)  # < 10 %, and just started
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(images, "PROGRESS_EVERY_S", 0.0)  # as if 20 s had passed
    bar.update(1)
    bar.update(98)  # 10 %
    assert capsys.readouterr().err.splitlines() == [
        "decoding images: 2/1,000",
        "decoding images: 100/1,000",
    ]
