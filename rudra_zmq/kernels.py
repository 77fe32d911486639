"""The compiled update kernels (``rudra_zmq._kernels``, built from ``csrc/_kernels.pyx``).

There is no pure-Python fallback: the parameter server's speed rests on these one-pass,
GIL-releasing loops, so a missing extension is an import error that says how to build it.
NumPy twins of every kernel live in ``rudra_zmq/benchmarks/numpy_twins.py`` (test oracle, benchmark baseline).
The half-precision kernels (``*_f16``, ``*_bf16``: float16, or bfloat16 as uint16 bits, against
float32; ``*_feedback``: narrowing with error feedback) serve ``rudra_zmq.codec``; every kernel releases the GIL and never allocates.
"""

try:
    from . import _kernels
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "rudra_zmq's compiled kernels (rudra_zmq._kernels) are not built or do not load: "
        f"{exc}. Build them with `pip install -e .` from the repository root (needs a C "
        "compiler and Cython>=3), or `python setup.py build_ext --inplace`."
    ) from exc

_stale = [
    n for n in ("accumulate_f16", "narrow_bf16", "narrow_f16_feedback") if not hasattr(_kernels, n)
]
if _stale:  # an extension built before csrc/ gained kernels: say so, not an AttributeError
    raise ImportError(
        f"rudra_zmq's compiled kernels ({_kernels.__file__}) are older than csrc/ (no "
        f"{', '.join(_stale)}): rebuild them with `python setup.py build_ext --inplace` or "
        "`pip install -e .` from the repository root."
    )

accumulate = _kernels.accumulate
accumulate_scaled = _kernels.accumulate_scaled
scale = _kernels.scale
copy_into = _kernels.copy_into
sgd_momentum_step = _kernels.sgd_momentum_step
sgd_step = _kernels.sgd_step
accumulate_f16 = _kernels.accumulate_f16
accumulate_bf16 = _kernels.accumulate_bf16
widen_f16 = _kernels.widen_f16
widen_bf16 = _kernels.widen_bf16
narrow_f16 = _kernels.narrow_f16
narrow_bf16 = _kernels.narrow_bf16
narrow_f16_feedback = _kernels.narrow_f16_feedback
narrow_bf16_feedback = _kernels.narrow_bf16_feedback
set_num_threads = _kernels.set_num_threads
get_num_threads = _kernels.get_num_threads
set_parallel_threshold = _kernels.set_parallel_threshold
get_parallel_threshold = _kernels.get_parallel_threshold
openmp_enabled = _kernels.openmp_enabled

__all__ = [
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
]
