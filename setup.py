"""Build rudra_zmq and its compiled Cython extension, the update kernels
(``rudra_zmq._kernels``).

The extension is required: a missing compiler or Cython fails the install with a clear
message instead of falling back to pure Python. OpenMP is used on Linux when the compiler
accepts ``-fopenmp`` (set ``RUDRA_ZMQ_NO_OPENMP=1`` to build without it).
"""
import os
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
    )

try:
    import numpy
    NUMPY_VERSION = numpy.__version__
except ImportError:  # numpy is only recorded in build_info(); the kernels need no numpy headers
    NUMPY_VERSION = "unknown"


def _compiler_works(flags):
    """Compile and link a tiny OpenMP program with the C compiler Python was built with."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise SystemExit(
            f"rudra_zmq needs a C compiler to build its kernels, and `{cc}` was not found. "
            "Install one (Debian/Ubuntu: `apt-get install gcc python3-dev`) and retry."
        )
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.c")
        with open(path, "w") as f:
            f.write(src)
        res = subprocess.run([cc, *flags, path, "-o", os.path.join(tmp, "t")],
                             capture_output=True)
        return res.returncode == 0


def _openmp_flags():
    if os.environ.get("RUDRA_ZMQ_NO_OPENMP") or not sys.platform.startswith("linux"):
        return [], []
    if _compiler_works(["-fopenmp"]):
        return ["-fopenmp"], ["-fopenmp"]
    print("rudra_zmq: the compiler rejected -fopenmp; building single-threaded kernels",
          file=sys.stderr)
    return [], []


omp_compile, omp_link = _openmp_flags()
# -O3 vectorises the one-pass loops. -march=native (the default for a source build) lets them
# use AVX2/AVX-512: large buffers are memory-bound either way, but cache-resident ones (a 1M
# parameter accumulate) ran 2x faster than with the baseline SSE2 build (bench/RESULTS.md).
# Set RUDRA_ZMQ_MARCH=x86-64 (or any -march value) for a build that moves between machines,
# or RUDRA_ZMQ_MARCH= (empty) to pass no -march at all.
extra_compile = ["-O3", *omp_compile]
march = os.environ.get("RUDRA_ZMQ_MARCH", "native")
if march and _compiler_works([f"-march={march}", *omp_compile]):
    extra_compile.append(f"-march={march}")

ext = Extension(
    "rudra_zmq._kernels",
    sources=["csrc/_kernels.pyx"],
    extra_compile_args=extra_compile,
    extra_link_args=omp_link,
    define_macros=[
        ("RZ_CYTHON_VERSION", f'"{Cython.__version__}"'),
        ("RZ_NUMPY_BUILD_VERSION", f'"{NUMPY_VERSION}"'),
        ("RZ_COMPILE_ARGS", '"' + " ".join(extra_compile) + '"'),
        ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
    ],
)

setup(
    name="rudra_zmq",
    version="0.1.0",
    description="Parameter-server distributed deep learning on ZeroMQ (a Rudra re-creation)",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["rudra_zmq", "rudra_zmq.*"]),
    package_data={"rudra_zmq": ["*.pyx", "configs/*.yaml"]},
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
    install_requires=[
        "numpy>=1.25",
        "pyzmq>=25",
        "msgpack>=1.0",
        "PyYAML>=6.0",
        "torch>=2.1,<3",
        "torchvision>=0.16",
        "scikit-learn>=1.3",  # the embedded default dataset (digits) ships inside it
        "matplotlib>=3.7",  # run-directory and benchmark plots
        "psutil>=5.9",  # process-tree cleanup and memory reporting in the launcher
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6.100"],
    },
    entry_points={"console_scripts": ["rudra-zmq=rudra_zmq.cli:main"]},
    zip_safe=False,
)
