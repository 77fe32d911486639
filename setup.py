"""Build rudra_zmq and its compiled Cython extension, the update kernels
(``rudra_zmq._kernels``).

The extension is required: a missing compiler or Cython fails the install with a clear
message instead of falling back to pure Python. OpenMP is used on Linux when the compiler
accepts ``-fopenmp`` (set ``RUDRA_ZMQ_NO_OPENMP=1`` to build without it). The kernels are
built for ``-march=x86-64-v2`` unless ``RUDRA_ZMQ_MARCH`` says otherwise (``native`` for the
build host's full instruction set); see docs/install.md.
"""

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, find_packages, setup

try:
    import Cython
    from Cython.Build import cythonize
except ImportError as exc:  # pragma: no cover - exercised only on broken build envs
    raise SystemExit(
        "rudra_zmq needs Cython>=3 to compile its kernels (csrc/*.pyx). "
        "Install it with `pip install 'Cython>=3'`, or let pip use pyproject.toml's build "
        f"requirements (do not pass --no-build-isolation without it). ({exc})"
    ) from None

try:
    import numpy

    NUMPY_VERSION = numpy.__version__
except ImportError:  # numpy is only recorded in build_info(); the kernels need no numpy headers
    NUMPY_VERSION = "unknown"


OPENMP_PROBE = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
PLAIN_PROBE = "int main(void){return 0;}\n"


def _compiler_works(flags, src=PLAIN_PROBE):
    """Compile and link a tiny program with the C compiler Python was built with."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise SystemExit(
            f"rudra_zmq needs a C compiler to build its kernels, and `{cc}` was not found. "
            "Install one (Debian/Ubuntu: `apt-get install gcc python3-dev`) and retry."
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.c")
        with open(path, "w") as f:
            f.write(src)
        res = subprocess.run([cc, *flags, path, "-o", os.path.join(tmp, "t")], capture_output=True)
        return res.returncode == 0


def _openmp_flags():
    if os.environ.get("RUDRA_ZMQ_NO_OPENMP") or not sys.platform.startswith("linux"):
        return [], []
    if _compiler_works(["-fopenmp"], OPENMP_PROBE):
        return ["-fopenmp"], ["-fopenmp"]
    print(
        "rudra_zmq: the compiler rejected -fopenmp; building single-threaded kernels",
        file=sys.stderr,
    )
    return [], []


def _flags_stamp(flags):
    """build/kernel-flags.txt, rewritten only when the flags change. The extension depends on
    it, so a rebuild with other flags (RUDRA_ZMQ_MARCH=native after a default build) compiles
    again instead of reusing the extension that build/ or an editable install already holds."""
    path = os.path.join("build", "kernel-flags.txt")
    text = " ".join(flags) + "\n"
    try:
        with open(path) as f:
            unchanged = f.read() == text
    except OSError:
        unchanged = False
    if not unchanged:
        os.makedirs("build", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return path


omp_compile, omp_link = _openmp_flags()
# -O3 vectorises the one-pass loops. -march: the default x86-64-v2 (SSE4.2/POPCNT: Intel since
# 2008, AMD since 2011, and what numpy>=2.4 itself requires) keeps a wheel, or a venv on
# NFS shared by mixed nodes, from dying with SIGILL on another host. Measured against an AVX2
# -march=native build (bench/RESULTS.md, "Kernel build flags"): 1-8 % slower on 10M floats
# (memory-bound), up to about 25 % on cache-resident 100K-1M buffers. RUDRA_ZMQ_MARCH=native
# opts into the build host's whole instruction set (for a build used on that host only); any
# other value is passed as -march=VALUE; empty passes none (gcc's default, x86-64 = SSE2). A
# value the compiler rejects is dropped with a message. Other architectures get no -march.
DEFAULT_MARCH = "x86-64-v2" if platform.machine().lower() in ("x86_64", "amd64") else ""
extra_compile = ["-O3", *omp_compile]
march = os.environ.get("RUDRA_ZMQ_MARCH", DEFAULT_MARCH)
if march and _compiler_works([f"-march={march}"]):
    extra_compile.append(f"-march={march}")
elif march:
    print(
        f"rudra_zmq: the compiler rejected -march={march}; building without -march", file=sys.stderr
    )
# Each loop starts on a 64-byte boundary: without it the same 5-instruction `scale` loop ran
# 1.6-1.9x slower in the x86-64-v2 build than in the SSE2 one, only because it straddled a
# cache line there (most of what once looked like native's 2x on cache-resident buffers).
if _compiler_works(["-falign-loops=64"]):
    extra_compile.append("-falign-loops=64")

ext = Extension(
    "rudra_zmq._kernels",
    sources=["csrc/_kernels.pyx"],
    depends=[_flags_stamp(extra_compile + omp_link)],
    extra_compile_args=extra_compile,
    extra_link_args=omp_link,
    define_macros=[
        ("RZ_CYTHON_VERSION", f'"{Cython.__version__}"'),
        ("RZ_NUMPY_BUILD_VERSION", f'"{NUMPY_VERSION}"'),
        ("RZ_COMPILE_ARGS", '"' + " ".join(extra_compile) + '"'),
        ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
    ],
)


def _version():
    """``__version__`` of rudra_zmq/__init__.py, read as text: importing the package here would
    need its compiled kernels, which this script is about to build."""
    with open(os.path.join("rudra_zmq", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if match is None:
        raise SystemExit('setup.py: no `__version__ = "X.Y.Z"` line in rudra_zmq/__init__.py')
    return match.group(1)


# The shipped configs stay in the top-level configs/ (the README's commands name
# configs/quickstart.yaml) and become the data-only package rudra_zmq.configs through
# package_dir: build_py copies configs/*.yaml and configs/grids/*.yaml into the wheel as
# rudra_zmq/configs/..., and the sdist carries them (MANIFEST.in), without a second copy in git.
# An editable install has no rudra_zmq/configs/ folder: rudra_zmq.shipped then finds the
# source tree's configs/ next to the package. examples/ becomes rudra_zmq.examples the same
# way (`rudra-zmq examples` lists them in an installed copy).
setup(
    name="rudra_zmq",
    version=_version(),
    description="Parameter-server distributed deep learning on ZeroMQ (a Rudra re-creation)",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        *find_packages(include=["rudra_zmq", "rudra_zmq.*"]),
        "rudra_zmq.configs",
        "rudra_zmq.configs.grids",
        "rudra_zmq.examples",
    ],
    package_dir={"rudra_zmq.configs": "configs", "rudra_zmq.examples": "examples"},
    package_data={
        "rudra_zmq.configs": ["*.yaml"],
        "rudra_zmq.configs.grids": ["*.yaml"],
        "rudra_zmq.examples": ["*"],
    },
    ext_modules=cythonize(
        [ext],
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "initializedcheck": False,
            "cdivision": True,
        },
    ),
    # every third-party import of rudra_zmq/ (tests/test_packaging.py checks this list)
    install_requires=[
        "numpy>=1.25",
        "pyzmq>=25",
        "msgpack>=1.0",
        "PyYAML>=6.0",
        "torch>=2.1,<3",
        "torchvision>=0.16",
        "scikit-learn>=1.3",  # the embedded default dataset (digits) ships inside it
        "Pillow>=9.1",  # decoding JPEG/PNG image folders and tarballs (images.py)
        "matplotlib>=3.7",  # run-directory and benchmark plots
        "psutil>=5.9",  # process-tree cleanup and memory reporting in the launcher
    ],
    extras_require={
        "progress": ["tqdm>=4"],  # a progress bar while decoding images (else a line per 10%)
        "tensorboard": ["tensorboard>=2.10"],  # logging.tensorboard: the stats server's events
        # tensorboard too, so that the suite checks the events it writes rather than skip
        "test": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "pytest-xdist>=3",
            "hypothesis>=6.100",
            "build>=1",
            "tensorboard>=2.10",
            "ruff>=0.6",  # the linter ([tool.ruff] in pyproject.toml)
            # test_packaging builds with --no-isolation (offline): the build requirements
            "setuptools>=64",
            "Cython>=3.0",
        ],
    },
    entry_points={"console_scripts": ["rudra-zmq=rudra_zmq.cli:main"]},
    zip_safe=False,
)
