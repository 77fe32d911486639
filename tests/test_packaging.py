"""The package as a user gets it: an sdist that carries the kernel sources and the configs, a
wheel built from it that installs in a fresh venv and runs the quickstart by name, configs
found by name, and every third-party import declared in setup.py.

The sdist and the wheel are built once per module (about 30 s of compiling on 2 cores). The
fresh venv borrows the current venv's dependencies through a ``.pth`` file (no download of
torch again) but not its editable rudra_zmq: the wheel is installed there with ``--no-deps``.
"""

import ast
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import rudra_zmq
from rudra_zmq.kernels.variants import VARIANTS

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "rudra_zmq"
VERSION = rudra_zmq.__version__

# import name -> distribution name, where they differ
DISTRIBUTIONS = {"PIL": "Pillow", "yaml": "PyYAML", "sklearn": "scikit-learn", "zmq": "pyzmq"}

pytestmark = pytest.mark.timeout(900)  # the module's fixtures compile the kernels once


def _needs_compiler():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler (`{cc}`): the sdist and wheel builds compile the kernels")
    pytest.importorskip(
        "build", reason="`python -m build` is in the test extra: pip install -e '.[test]'"
    )


def _env(**extra):
    """The environment of a build or a user's shell: no RUDRA_ZMQ_MARCH (the default build is
    what is tested), no RUDRA_ZMQ_KERNELS (the default choice is), no PYTHONPATH (nothing may
    leak in from the repository)."""
    unset = ("RUDRA_ZMQ_MARCH", "RUDRA_ZMQ_KERNELS", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "COLUMNS": "200", **extra}  # COLUMNS: argparse wraps --version to it


def _check(cmd, cwd, timeout=600, **kw):
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        **kw,
    )
    assert res.returncode == 0, f"{cmd} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    _needs_compiler()
    out = tmp_path_factory.mktemp("sdist")
    _check(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, REPO],
        cwd=REPO,
    )
    (path,) = out.glob("*.tar.gz")
    assert path.name == f"rudra_zmq-{VERSION}.tar.gz"
    return path


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory):
    """The wheel `pip wheel .` builds in the unpacked sdist (so the sdist is complete too)."""
    tmp = tmp_path_factory.mktemp("wheel")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "src", filter="data")
    _check(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            ".",
            "-w",
            tmp / "dist",
        ],
        cwd=tmp / "src" / f"rudra_zmq-{VERSION}",
    )
    (path,) = (tmp / "dist").glob("rudra_zmq-*.whl")
    return path


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory):
    """A new venv with the wheel installed and the current venv's packages visible; returns
    its bin/ folder."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _check([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    python = venv / "bin" / "python"
    site = _check(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=venv.parent
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # a path line in a .pth file adds the folder, but not the .pth files in it: the editable
    # install's finder (__editable__*.pth) stays out
    Path(site, "_current_venv.pth").write_text("\n".join(sorted(ours)) + "\n")
    _check(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            wheel,
        ],
        cwd=venv.parent,
    )
    return venv / "bin"


# ----------------------------------------------------------------------------- sdist, wheel
@pytest.mark.slow
def test_the_sdist_carries_the_kernel_sources_configs_and_build_files(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {"README.md", "setup.py", "pyproject.toml", "MANIFEST.in", "csrc/_kernels.pxi"}
    wanted |= {"csrc/_cpu.pyx", "rudra_zmq/kernels/variants.py"}  # setup.py reads the table
    wanted |= {str(p.relative_to(REPO)) for p in REPO.glob("csrc/*.pyx")}
    wanted |= {str(p.relative_to(REPO)) for p in REPO.glob("csrc/*.pxi")}
    assert "csrc/_kernels_baseline.pyx" in wanted
    wanted |= {str(p.relative_to(REPO)) for p in REPO.glob("configs/**/*.yaml")}
    assert "configs/quickstart.yaml" in wanted and "configs/grids/table2.yaml" in wanted
    assert wanted <= names, f"missing from the sdist: {sorted(wanted - names)}"
    stray = [n for n in names if n.endswith((".so", ".pyc", ".c"))]
    assert not stray, f"build products in the sdist: {stray}"


@pytest.mark.slow
def test_the_wheel_holds_the_compiled_kernels_and_the_configs_as_package_data(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    built = {
        m.group(1) for n in names if (m := re.fullmatch(r"rudra_zmq/kernels/_(\w+)\..*\.so", n))
    }
    # every variant on x86-64 (gcc and clang have known -march=x86-64-v4 for years), the
    # baseline elsewhere; and the CPU probe
    wanted = set(VARIANTS) if platform.machine().lower() in ("x86_64", "amd64") else {"baseline"}
    assert built == wanted | {"cpu"}, sorted(names)
    configs = {
        f"rudra_zmq/configs/{p.relative_to(REPO / 'configs')}"
        for p in REPO.glob("configs/**/*.yaml")
    }
    assert "rudra_zmq/configs/quickstart.yaml" in configs
    assert configs <= names, f"missing from the wheel: {sorted(configs - names)}"
    examples = {
        f"rudra_zmq/examples/{p.name}" for p in (REPO / "examples").iterdir() if p.is_file()
    }
    assert "rudra_zmq/examples/slurm.sbatch" in examples
    assert examples <= names, f"missing from the wheel: {sorted(examples - names)}"


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_runs_the_quickstart_by_name(fresh_venv, tmp_path):
    """From a folder with no configs/ around, as a user who only installed the wheel."""
    where = _check(
        [fresh_venv / "python", "-c", "import rudra_zmq; print(rudra_zmq.__file__)"], cwd=tmp_path
    ).stdout.strip()
    assert Path(where).is_relative_to(fresh_venv.parent), where

    version = _check([fresh_venv / "rudra-zmq", "--version"], cwd=tmp_path).stdout
    best = _check(
        [fresh_venv / "python", "-c", "import rudra_zmq; print(rudra_zmq.kernels.VARIANT)"],
        cwd=tmp_path,
    ).stdout.strip()
    assert version.startswith(f"rudra-zmq {VERSION} (kernels: {best} variant, -O3"), version
    assert "-march=native" not in version, "the default build must run on any x86-64-v2 host"

    run_dir = tmp_path / "run"
    _check(
        [
            fresh_venv / "rudra-zmq",
            "run",
            "quickstart",
            "--set",
            "train.epochs=1",
            "--run-dir",
            run_dir,
        ],
        cwd=tmp_path,
        timeout=300,
    )
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert metrics.strip(), "the run wrote no metrics"
    assert "name: quickstart" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_finds_grids_and_examples_by_name(fresh_venv, tmp_path):
    """The README's `sweep` and the docs' example scripts, from a folder with no repository."""
    for grid in ("table2", "grids/table2", "configs/grids/table2.yaml"):
        listed = _check([fresh_venv / "rudra-zmq", "sweep", grid, "--list"], cwd=tmp_path)
        assert listed.stdout.startswith("baseline: "), (grid, listed.stdout)
    printed = _check([fresh_venv / "rudra-zmq", "examples", "slurm.sbatch"], cwd=tmp_path)
    assert printed.stdout == (REPO / "examples" / "slurm.sbatch").read_text()
    listed = _check([fresh_venv / "rudra-zmq", "examples"], cwd=tmp_path).stdout
    assert str(fresh_venv.parent) in listed and "custom_model.py" in listed, listed


# ----------------------------------------------------------------------------- config names
def test_an_unknown_config_name_exits_2_and_lists_the_builtin_names(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", "no_such_config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(
        "rudra-zmq: error: config 'no_such_config' is not a file and not a built-in config"
    ), res.stderr
    for name in ("quickstart", "quickstart_adv", "cifar10_baseline", "imagenet_base_softsync"):
        assert re.search(rf"\b{name}\b", res.stderr), name
    assert "Traceback" not in res.stderr


def test_a_builtin_name_loads_the_shipped_file_from_any_folder(tmp_path, monkeypatch):
    from rudra_zmq.config import load_config

    monkeypatch.chdir(tmp_path)
    by_name = load_config("quickstart", ["train.epochs=2"])
    assert by_name == load_config(str(REPO / "configs" / "quickstart.yaml"), ["train.epochs=2"])


def test_a_file_of_that_name_in_the_current_folder_wins_over_the_builtin(tmp_path, monkeypatch):
    from rudra_zmq.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text("name: mine\n")
    assert load_config("quickstart").name == "mine"


# ----------------------------------------------------------------------------- dependencies
def _imports():
    """{top-level third-party module: True if some import of it is unguarded} over rudra_zmq/.
    An import inside ``try: ... except ImportError`` is optional (an extra may provide it)."""
    found = {}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers
            ):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "rudra_zmq":
                    continue
                found[top] = found.get(top, False) or id(node) not in guarded
    return found


def _setup_requirements():
    """(install_requires, {extra: requirements}) read from setup.py's setup() call."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"
    ]
    kw = {k.arg: k.value for k in call.keywords}
    return ast.literal_eval(kw["install_requires"]), ast.literal_eval(kw["extras_require"])


def _dist(requirement: str) -> str:
    """'scikit-learn>=1.3' -> 'scikit-learn', normalised as PEP 503 does."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_a_declared_dependency():
    required, extras = _setup_requirements()
    required = {_dist(r) for r in required}
    optional = {_dist(r) for reqs in extras.values() for r in reqs}
    imports = _imports()
    assert {"PIL", "yaml", "zmq", "torch", "numpy"} <= set(imports)  # the scan works
    undeclared = sorted(
        m
        for m, unguarded in imports.items()
        if _dist(DISTRIBUTIONS.get(m, m)) not in (required if unguarded else required | optional)
    )
    assert not undeclared, (
        f"imported by rudra_zmq/ but not in setup.py's install_requires "
        f"(or, for an import guarded by except ImportError, an extra): "
        f"{undeclared}"
    )
    unused = required - {_dist(DISTRIBUTIONS.get(m, m)) for m in imports}
    assert not unused, f"install_requires names packages rudra_zmq/ never imports: {unused}"
