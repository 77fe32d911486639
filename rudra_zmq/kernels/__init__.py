"""The compiled update kernels, in the instruction-set variant this CPU runs best.

The kernels are written once (``csrc/_kernels.pxi``) and compiled once per variant
(``rudra_zmq/kernels/variants.py``: ``avx512``, ``avx2``, ``baseline``) into
``rudra_zmq.kernels._<variant>``. Importing this package asks the CPU what it supports
(``rudra_zmq.kernels._cpu``, built for any CPU), imports the best variant that was built and that the
CPU runs, and logs the choice once (logger ``rudra_zmq.kernels``, INFO: at import when logging
is configured, else when a role process configures it, :func:`log_choice`). Every variant computes
the same bits (setup.py: ``-ffp-contract=off``); only the speed differs.

``RUDRA_ZMQ_KERNELS=baseline|avx2|avx512`` forces a variant (``auto`` or empty: the best). A
value that is no variant, or names one this CPU cannot run or this build lacks, stops the
process at import with one line on stderr (``rudra_zmq: error: RUDRA_ZMQ_KERNELS=VALUE: why;
the choices``) and exit status 2: never a silent fallback, so a forced benchmark measures what
it names. :func:`load_variant` (tests, ``bench kernels``) raises ``ImportError`` instead.

There is no pure-Python fallback: the parameter server's speed rests on these one-pass,
GIL-releasing loops, so a missing extension is an import error that says how to build it.
NumPy twins of every kernel live in ``rudra_zmq/benchmarks/numpy_twins.py`` (test oracle,
benchmark baseline). The half-precision kernels (``*_f16``, ``*_bf16``: float16, or bfloat16
as uint16 bits, against float32; ``*_feedback``: narrowing with error feedback) serve
``rudra_zmq.codec``; every kernel releases the GIL and never allocates.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

from . import variants as kv

_BUILD_HINT = (
    "Build them with `pip install -e .` from the repository root (needs a C compiler and "
    "Cython>=3), or `python setup.py build_ext --inplace`."
)
_API = (
    "accumulate",
    "accumulate_scaled",
    "scale",
    "copy_into",
    "sgd_momentum_step",
    "sgd_step",
    "accumulate_f16",
    "accumulate_bf16",
    "widen_f16",
    "widen_bf16",
    "narrow_f16",
    "narrow_bf16",
    "narrow_f16_feedback",
    "narrow_bf16_feedback",
    "set_num_threads",
    "get_num_threads",
    "set_parallel_threshold",
    "get_parallel_threshold",
    "openmp_enabled",
)

log = logging.getLogger(__name__)

try:
    from . import _cpu
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        f"rudra_zmq's CPU probe (rudra_zmq.kernels._cpu) is not built or does not load: {exc}. "
        + _BUILD_HINT
    ) from exc

CPU_FEATURES = _cpu.x86_features()
"""What this CPU (and OS) offers, as ``_cpu.x86_features()`` reports it."""


def built_variants() -> list[str]:
    """The variants this install holds an extension for, best first. Does not block."""
    return [v for v in kv.VARIANTS if importlib.util.find_spec(kv.module_name(v)) is not None]


def available_variants() -> list[str]:
    """The variants this install holds and this CPU runs, best first (what tests and
    ``bench kernels`` cover). Does not block."""
    return [v for v in built_variants() if not kv.missing(v, CPU_FEATURES)]


def load_variant(name: str):
    """The extension module of variant ``name``; ImportError (saying why, and what runs here)
    if the name is unknown, the CPU lacks what it needs, or this install did not build it.
    Loading is safe only once the CPU has been checked, which this does first."""
    if name not in kv.VARIANTS:
        raise ImportError(
            f"{name!r} is not a kernel variant; pick one of {', '.join(kv.VARIANTS)} (or auto)"
        )
    lacking = kv.missing(name, CPU_FEATURES)
    if lacking:
        raise ImportError(
            f"the {name} kernels need {', '.join(lacking)}, which this CPU "
            f"({_cpu_model()}) lacks or its OS does not enable; it runs "
            f"{', '.join(available_variants())}"
        )
    if name not in built_variants():
        raise ImportError(
            f"this install has no {name} kernels (its compiler rejected "
            f"-march={kv.VARIANTS[name][0]}, or this is not x86-64); it has "
            f"{', '.join(built_variants()) or 'none'}"
        )
    try:
        module = importlib.import_module(kv.module_name(name))
    except ImportError as exc:
        raise ImportError(
            f"rudra_zmq's compiled kernels ({kv.module_name(name)}) do not load: {exc}. "
            + _BUILD_HINT
        ) from exc
    stale = [n for n in _API if not hasattr(module, n)]
    if stale:  # an extension built before csrc/ gained kernels: say so, not an AttributeError
        raise ImportError(
            f"rudra_zmq's compiled kernels ({module.__file__}) are older than csrc/ (no "
            f"{', '.join(stale)}): rebuild them. " + _BUILD_HINT
        )
    return module


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "this machine"


def _choose() -> tuple[str, str]:
    """(variant, why): the forced one (RUDRA_ZMQ_KERNELS), else the best available."""
    forced = os.environ.get(kv.ENV, "").strip().lower()
    if forced not in ("", "auto"):
        return forced, f"forced by {kv.ENV}"
    available = available_variants()
    if not available:
        raise ImportError(
            "rudra_zmq's compiled kernels are not built (no rudra_zmq.kernels._<variant>). "
            + _BUILD_HINT
        )
    better = list(kv.VARIANTS)[: list(kv.VARIANTS).index(available[0])]
    why = "the best this CPU runs" + "".join(f"; {v}: {_why_not(v)}" for v in better)
    return available[0], why


def _why_not(name: str) -> str:
    lacking = kv.missing(name, CPU_FEATURES)
    return f"CPU lacks {', '.join(lacking)}" if lacking else "not built"


def _refuse_forced(value: str, why: ImportError) -> None:
    """A forced variant that cannot load: one line on stderr naming the value, why and the
    choices, then exit status 2 (as CPython's own refusal of a bad ``PYTHONHASHSEED``): the
    variable configures the process, not one call, so no caller could recover, and a
    traceback through the package's imports would bury the line that matters."""
    sys.stderr.write(f"rudra_zmq: error: {kv.ENV}={value}: {why}\n")
    raise SystemExit(2)


VARIANT, _reason = _choose()
"""The variant in use (its name)."""
try:
    _module = load_variant(VARIANT)
except ImportError as exc:
    if _reason.startswith("forced"):
        _refuse_forced(os.environ.get(kv.ENV, ""), exc)
    raise
_logged = False


def log_choice() -> None:
    """Log the variant in use and why (logger ``rudra_zmq.kernels``, INFO), once per process:
    at import when logging is already configured for INFO, else at the first call (a role
    process calls this after configuring its logging). Does not block; not thread-safe (call
    it from the main thread)."""
    global _logged
    if not _logged:
        _logged = True
        log.info("kernels: %s variant (%s)", VARIANT, _reason)


if log.isEnabledFor(logging.INFO) and log.hasHandlers():
    log_choice()

accumulate = _module.accumulate
accumulate_scaled = _module.accumulate_scaled
scale = _module.scale
copy_into = _module.copy_into
sgd_momentum_step = _module.sgd_momentum_step
sgd_step = _module.sgd_step
accumulate_f16 = _module.accumulate_f16
accumulate_bf16 = _module.accumulate_bf16
widen_f16 = _module.widen_f16
widen_bf16 = _module.widen_bf16
narrow_f16 = _module.narrow_f16
narrow_bf16 = _module.narrow_bf16
narrow_f16_feedback = _module.narrow_f16_feedback
narrow_bf16_feedback = _module.narrow_bf16_feedback
set_num_threads = _module.set_num_threads
get_num_threads = _module.get_num_threads
set_parallel_threshold = _module.set_parallel_threshold
get_parallel_threshold = _module.get_parallel_threshold
openmp_enabled = _module.openmp_enabled


def build_info() -> dict:
    """Facts about the kernels in use, as a dict. Does not block.

    Keys: variant (the one in use), variants_built, variants_available (built and run by this
    CPU), module_file, openmp, num_threads, parallel_threshold, cython_version,
    numpy_build_version, numpy_version, compile_args (the variant's), version.
    """
    import numpy

    from .. import __version__

    info = dict(_module.compile_info())
    info.update(
        version=__version__,
        variant=VARIANT,
        variants_built=built_variants(),
        variants_available=available_variants(),
        module_file=_module.__file__,
        num_threads=_module.get_num_threads(),
        parallel_threshold=_module.get_parallel_threshold(),
        numpy_version=numpy.__version__,
    )
    return info


__all__ = list(_API)
