# The update kernels: the one source every variant module (csrc/_kernels_<variant>.pyx) includes.
# setup.py compiles it once per instruction-set variant (-march=x86-64-v2, -v3, -v4: "baseline",
# "avx2", "avx512"); rudra_zmq/kernels.py imports the best one this CPU runs. Nothing here may
# depend on the variant except through the compiler: a rule is written once, here.
#
# Every kernel:
# - works in place on 1-D C-contiguous float32 or float64 NumPy arrays (all arguments of one
#   call share the dtype and length), except the half-precision kernels of
#   ``_kernels_half.pxi`` (float16 or bfloat16 against float32, see there); inputs are
#   ``const`` so read-only buffers, such as ``np.frombuffer(zmq_frame, np.float32)``, are
#   accepted;
# - checks its arguments with the GIL held and raises ``ValueError``/``TypeError`` naming the
#   bad size, dtype or flag before anything is written;
# - then releases the GIL and runs one pass over memory, split statically over OpenMP threads
#   (``set_num_threads``) when the buffer is large enough to amortise starting them;
# - never allocates.
# Kernels are thread-safe as long as two threads do not write the same array at once.
from cython.parallel cimport prange
from libc.string cimport memcpy

import numpy as np

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define RZ_OPENMP 1
    #else
    #define RZ_OPENMP 0
    static int omp_get_max_threads(void) { return 1; }
    #endif
    #ifndef RZ_CYTHON_VERSION
    #define RZ_CYTHON_VERSION "unknown"
    #endif
    #ifndef RZ_NUMPY_BUILD_VERSION
    #define RZ_NUMPY_BUILD_VERSION "unknown"
    #endif
    #ifndef RZ_COMPILE_ARGS
    #define RZ_COMPILE_ARGS ""
    #endif
    #ifndef RZ_VARIANT
    #define RZ_VARIANT "unknown"
    #endif
    """
    int RZ_OPENMP
    int omp_get_max_threads() noexcept nogil
    const char* RZ_CYTHON_VERSION
    const char* RZ_NUMPY_BUILD_VERSION
    const char* RZ_COMPILE_ARGS
    const char* RZ_VARIANT

ctypedef fused real:
    float
    double

# Below this many elements (1 MiB of float32) a pass takes tens of microseconds, comparable
# to waking and joining OpenMP threads, and on a machine shared with learners the extra
# threads cost more than they give (the 90k CIFAR-10 CNN's PS step was slower on 2 threads);
# above it the pass is memory-bound and a second core adds bandwidth (10M: 4.5 -> 3.5 ms).
cdef Py_ssize_t _parallel_min = 1 << 18
cdef int _num_threads = omp_get_max_threads() if RZ_OPENMP else 1

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# ----------------------------------------------------------------------------- settings
def openmp_enabled():
    """True when the extension was compiled with OpenMP. Does not block."""
    return bool(RZ_OPENMP)


def set_num_threads(int n):
    """Set how many OpenMP threads the kernels use (>= 1; 1 when built without OpenMP).

    Not thread-safe against kernels running in other threads: set it at start-up.
    """
    global _num_threads
    if n < 1:
        raise ValueError(f"set_num_threads: need at least 1 thread, got {n}")
    _num_threads = n if RZ_OPENMP else 1


def get_num_threads():
    """The number of OpenMP threads a large kernel call uses."""
    return _num_threads


def set_parallel_threshold(Py_ssize_t n):
    """Buffers shorter than ``n`` elements run on one thread (default 262,144)."""
    global _parallel_min
    if n < 0:
        raise ValueError(f"set_parallel_threshold: need n >= 0, got {n}")
    _parallel_min = n


def get_parallel_threshold():
    """Element count from which kernels use all ``get_num_threads()`` threads."""
    return _parallel_min


def compile_info():
    """Compile-time facts for ``rudra_zmq.build_info()``: the variant's name (setup.py's
    ``RZ_VARIANT``), OpenMP, the Cython and NumPy versions and the compiler flags."""
    return {
        "variant": RZ_VARIANT.decode(),
        "openmp": bool(RZ_OPENMP),
        "cython_version": RZ_CYTHON_VERSION.decode(),
        "numpy_build_version": RZ_NUMPY_BUILD_VERSION.decode(),
        "compile_args": RZ_COMPILE_ARGS.decode(),
    }


cdef inline int _threads_for(Py_ssize_t n) noexcept nogil:
    return _num_threads if n >= _parallel_min else 1


# ----------------------------------------------------------------------------- checks
cdef object _check(str op, tuple names, tuple arrays, int n_out):
    """Validate arguments; the first ``n_out`` arrays are written. Returns the shared dtype."""
    cdef Py_ssize_t i
    ref_name = names[0]
    ref = arrays[0]
    for i in range(len(arrays)):
        name = names[i]
        x = arrays[i]
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{op}: {name} must be a numpy.ndarray, got {type(x).__name__} "
                "(wrap raw buffers with np.frombuffer(buf, np.float32))")
        if x.dtype != _F32 and x.dtype != _F64:
            raise ValueError(
                f"{op}: {name} has dtype {x.dtype}; kernels take float32 or float64")
        if x.ndim != 1 or not x.flags.c_contiguous:
            raise ValueError(
                f"{op}: {name} must be 1-D and C-contiguous, got shape {x.shape} "
                f"(contiguous={x.flags.c_contiguous}); pass x.reshape(-1) of a contiguous buffer")
        if i < n_out and not x.flags.writeable:
            raise ValueError(f"{op}: {name} is read-only but is written in place")
        if i > 0:
            if x.dtype != ref.dtype:
                raise ValueError(
                    f"{op}: {name} is {x.dtype} but {ref_name} is {ref.dtype}; "
                    "all arrays of one call must share a dtype")
            if x.shape[0] != ref.shape[0]:
                raise ValueError(
                    f"{op}: {name} has {x.shape[0]:,} elements but {ref_name} has "
                    f"{ref.shape[0]:,}; all arrays of one call must have the same length")
    return ref.dtype


cdef inline void _finite(str op, str name, double v) except *:
    if v != v or v == float("inf") or v == float("-inf"):
        raise ValueError(f"{op}: {name} must be finite, got {v}")


# ----------------------------------------------------------------------------- impls
# Each thread takes one contiguous part of the arrays, as prange's static schedule would, but
# every part after the first starts on a 64-byte boundary of the array the kernel writes, and
# the first runs its head up to that boundary apart. NumPy places a large array 16 bytes past a
# page (malloc's header), so the loops of the AVX-512 variant (64-byte vectors) and the AVX2
# variant (32 bytes) would otherwise store across two cache lines at every (or every other)
# vector: 5-10 % slower on 10M floats than the baseline's 16-byte vectors, which never do.
cdef inline Py_ssize_t _head(const void *out, Py_ssize_t itemsize, Py_ssize_t n) noexcept nogil:
    """Elements of ``out`` before its first 64-byte boundary (at most n)."""
    cdef Py_ssize_t h = <Py_ssize_t>((64 - (<size_t>out & 63)) & 63) // itemsize
    return h if h < n else n


cdef inline Py_ssize_t _part(Py_ssize_t n, Py_ssize_t head, Py_ssize_t t,
                             Py_ssize_t nt) noexcept nogil:
    """Where thread t's part of [0, n) starts: 0, then head + a multiple of 16 elements."""
    cdef Py_ssize_t p
    if t == 0:
        return 0
    if t >= nt:
        return n
    p = head + (n - head) * t // nt // 16 * 16
    return p if p < n else n


cdef inline void _accumulate_n(real *acc, const real *g, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = acc[i] + g[i]


cdef inline void _accumulate_scaled_n(real *acc, const real *g, real s,
                                      Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = acc[i] + s * g[i]


cdef inline void _scale_n(real *x, real s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        x[i] = s * x[i]


cdef int _accumulate(real[::1] acc, const real[::1] g) except -1:
    cdef Py_ssize_t t, lo, hi, n = acc.shape[0]
    cdef int nt = _threads_for(n)
    if n == 0:
        return 0
    cdef Py_ssize_t head = _head(&acc[0], sizeof(real), n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                _accumulate_n(&acc[0], &g[0], head)
                lo = head
            _accumulate_n(&acc[lo], &g[lo], hi - lo)
    return 0


cdef int _accumulate_scaled(real[::1] acc, const real[::1] g, double s) except -1:
    cdef Py_ssize_t t, lo, hi, n = acc.shape[0]
    cdef int nt = _threads_for(n)
    cdef real s_ = <real>s
    if n == 0:
        return 0
    cdef Py_ssize_t head = _head(&acc[0], sizeof(real), n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                _accumulate_scaled_n(&acc[0], &g[0], s_, head)
                lo = head
            _accumulate_scaled_n(&acc[lo], &g[lo], s_, hi - lo)
    return 0


cdef int _scale(real[::1] x, double s) except -1:
    cdef Py_ssize_t t, lo, hi, n = x.shape[0]
    cdef int nt = _threads_for(n)
    cdef real s_ = <real>s
    if n == 0:
        return 0
    cdef Py_ssize_t head = _head(&x[0], sizeof(real), n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                _scale_n(&x[0], s_, head)
                lo = head
            _scale_n(&x[lo], s_, hi - lo)
    return 0


cdef int _copy_into(real[::1] dst, const real[::1] src) except -1:
    cdef Py_ssize_t n = dst.shape[0]
    cdef int nt = _threads_for(n)
    cdef Py_ssize_t t, start, stop, chunk
    if n == 0:
        return 0
    # One memcpy per thread over a contiguous slice: libc's memcpy already uses the widest
    # stores (and non-temporal ones for huge sizes); threads add the second core's bandwidth.
    chunk = (n + nt - 1) // nt
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            start = t * chunk
            stop = start + chunk
            if stop > n:
                stop = n
            if stop > start:
                memcpy(&dst[start], &src[start], (stop - start) * sizeof(real))
    return 0


cdef inline void _momentum_n(real *w_out, const real *w, real *v_out, const real *v,
                            real *acc, Py_ssize_t n, real m, real a, real b,
                            bint zero_acc) noexcept nogil:
    # Caffe's SGD: v = m*v + lr*(g_scale*acc + wd*w); w_out = w - v   (one read of w, v, acc);
    # zero_acc: acc = 0 in the same pass, so the next update starts from a clean sum without a
    # second sweep over memory.
    cdef Py_ssize_t i
    cdef real vi
    if zero_acc:
        for i in range(n):
            vi = m * v[i] + a * acc[i] + b * w[i]
            v_out[i] = vi
            w_out[i] = w[i] - vi
            acc[i] = 0
    else:
        for i in range(n):
            vi = m * v[i] + a * acc[i] + b * w[i]
            v_out[i] = vi
            w_out[i] = w[i] - vi


cdef void _momentum_loop(real *w_out, const real *w, real *v_out, const real *v,
                         real *acc, Py_ssize_t n, real m, real a, real b,
                         bint zero_acc, int nt) noexcept nogil:
    # w_out is w itself (in place) or another buffer, so that the parameter server can write
    # the next weight version while the current one is still being sent zero-copy; likewise
    # v_out is v or another buffer (an update computed aside, then adopted or dropped).
    # acc is written only with zero_acc.
    cdef Py_ssize_t t, lo, hi
    cdef Py_ssize_t head = _head(w_out, sizeof(real), n)
    for t in prange(nt, schedule="static", num_threads=nt):
        lo = _part(n, head, t, nt)
        hi = _part(n, head, t + 1, nt)
        if t == 0:
            _momentum_n(w_out, w, v_out, v, acc, head, m, a, b, zero_acc)
            lo = head
        _momentum_n(w_out + lo, w + lo, v_out + lo, v + lo, acc + lo, hi - lo, m, a, b,
                    zero_acc)


cdef int _sgd_momentum(real[::1] w_out, const real[::1] w, real[::1] v_out,
                       const real[::1] v, const real[::1] acc, double lr, double momentum,
                       double weight_decay, double g_scale) except -1:
    cdef Py_ssize_t n = w.shape[0]
    if n == 0:
        return 0
    with nogil:
        _momentum_loop(&w_out[0], &w[0], &v_out[0], &v[0], <real *>&acc[0], n,
                       <real>momentum, <real>(lr * g_scale), <real>(lr * weight_decay), False,
                       _threads_for(n))
    return 0


cdef int _sgd_momentum_zero(real[::1] w_out, const real[::1] w, real[::1] v_out,
                            const real[::1] v, real[::1] acc, double lr, double momentum,
                            double weight_decay, double g_scale) except -1:
    cdef Py_ssize_t n = w.shape[0]
    if n == 0:
        return 0
    with nogil:
        _momentum_loop(&w_out[0], &w[0], &v_out[0], &v[0], &acc[0], n, <real>momentum,
                       <real>(lr * g_scale), <real>(lr * weight_decay), True, _threads_for(n))
    return 0


cdef inline void _sgd_n(real *w_out, const real *w, real *acc, Py_ssize_t n, real keep,
                        real a, bint zero_acc) noexcept nogil:
    # Plain SGD: w_out = w - lr*(g_scale*acc + wd*w)   (w_out may be w); zero_acc: acc = 0
    cdef Py_ssize_t i
    if zero_acc:
        for i in range(n):
            w_out[i] = keep * w[i] - a * acc[i]
            acc[i] = 0
    else:
        for i in range(n):
            w_out[i] = keep * w[i] - a * acc[i]


cdef int _sgd_loop(real *w_out, const real *w, real *acc, Py_ssize_t n, double lr,
                   double weight_decay, double g_scale, bint zero_acc) except -1:
    cdef int nt = _threads_for(n)
    cdef real a = <real>(lr * g_scale)
    cdef real keep = <real>(1.0 - lr * weight_decay)
    cdef Py_ssize_t t, lo, hi
    cdef Py_ssize_t head = _head(w_out, sizeof(real), n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                _sgd_n(w_out, w, acc, head, keep, a, zero_acc)
                lo = head
            _sgd_n(w_out + lo, w + lo, acc + lo, hi - lo, keep, a, zero_acc)
    return 0


cdef int _sgd(real[::1] w_out, const real[::1] w, const real[::1] acc, double lr,
              double weight_decay, double g_scale) except -1:
    if w.shape[0] == 0:
        return 0
    return _sgd_loop(&w_out[0], &w[0], <real *>&acc[0], w.shape[0], lr, weight_decay,
                     g_scale, False)


cdef int _sgd_zero(real[::1] w_out, const real[::1] w, real[::1] acc, double lr,
                   double weight_decay, double g_scale) except -1:
    if w.shape[0] == 0:
        return 0
    return _sgd_loop(&w_out[0], &w[0], &acc[0], w.shape[0], lr, weight_decay, g_scale, True)


cdef object _check_out(str op, w, out, str wname="w", str oname="out"):
    """The buffer an update writes: ``w`` itself (out=None), or ``out`` — writable, the same
    dtype and length (checked with the rest), and either exactly ``w`` or not overlapping it
    (a partly overlapping ``out`` would read values it has already written)."""
    if out is None:
        return w
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{op}: {oname} must be a numpy.ndarray or None, got "
                        f"{type(out).__name__}")
    if out is not w and np.may_share_memory(out, w) and not (
            out.__array_interface__["data"][0] == w.__array_interface__["data"][0]
            and out.shape == w.shape):
        raise ValueError(f"{op}: {oname} overlaps {wname} without being {wname}; pass "
                         f"{oname}=None to update in place or a separate buffer")
    return out


# ----------------------------------------------------------------------------- public
def accumulate(acc, g):
    """acc += g, in place. Releases the GIL; does not allocate."""
    if _check("accumulate", ("acc", "g"), (acc, g), 1) == _F32:
        _accumulate[float](acc, g)
    else:
        _accumulate[double](acc, g)


def accumulate_scaled(acc, g, double s):
    """acc += s*g, in place (the per-gradient staleness-scaled sum). Releases the GIL."""
    _finite("accumulate_scaled", "s", s)
    if _check("accumulate_scaled", ("acc", "g"), (acc, g), 1) == _F32:
        _accumulate_scaled[float](acc, g, s)
    else:
        _accumulate_scaled[double](acc, g, s)


def scale(x, double s):
    """x *= s, in place. Releases the GIL; does not allocate."""
    _finite("scale", "s", s)
    if _check("scale", ("x",), (x,), 1) == _F32:
        _scale[float](x, s)
    else:
        _scale[double](x, s)


def copy_into(dst, src):
    """dst[:] = src, split over threads for large buffers. Releases the GIL.

    ``dst`` and ``src`` must not overlap (it is memcpy, not memmove).
    """
    if _check("copy_into", ("dst", "src"), (dst, src), 1) == _F32:
        _copy_into[float](dst, src)
    else:
        _copy_into[double](dst, src)


def sgd_momentum_step(w, v, acc, double lr, double momentum, double weight_decay=0.0,
                      double g_scale=1.0, bint zero_acc=False, out=None, v_out=None):
    """Caffe-semantics momentum SGD with weight decay, fused in one pass over memory.

    v = momentum*v + lr*(g_scale*acc + weight_decay*w);  out = w - v;  and acc = 0 if zero_acc.
    ``out`` is ``w`` when None (in place); otherwise the new weights go to ``out`` and ``w`` is
    only read (it may be read-only), at the cost of the same single pass. Likewise ``v_out``:
    None updates ``v`` in place, a separate buffer receives the new momentum and ``v`` is only
    read. ``g_scale`` turns a sum of c gradients into their mean (1/c). Releases the GIL; does
    not allocate.
    """
    for name, val in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                      ("g_scale", g_scale)):
        _finite("sgd_momentum_step", name, val)
    oname = "w" if out is None else "out"
    vname = "v" if v_out is None else "v_out"
    out = _check_out("sgd_momentum_step", w, out)
    v_out = _check_out("sgd_momentum_step", v, v_out, "v", "v_out")
    if zero_acc:
        dt = _check("sgd_momentum_step", (oname, vname, "acc", "w", "v"),
                    (out, v_out, acc, w, v), 3)
    else:
        dt = _check("sgd_momentum_step", (oname, vname, "w", "v", "acc"),
                    (out, v_out, w, v, acc), 2)
    if zero_acc:
        if dt == _F32:
            _sgd_momentum_zero[float](out, w, v_out, v, acc, lr, momentum, weight_decay,
                                      g_scale)
        else:
            _sgd_momentum_zero[double](out, w, v_out, v, acc, lr, momentum, weight_decay,
                                       g_scale)
    elif dt == _F32:
        _sgd_momentum[float](out, w, v_out, v, acc, lr, momentum, weight_decay, g_scale)
    else:
        _sgd_momentum[double](out, w, v_out, v, acc, lr, momentum, weight_decay, g_scale)


def sgd_step(w, acc, double lr, double weight_decay=0.0, double g_scale=1.0,
             bint zero_acc=False, out=None):
    """Plain SGD: out = w - lr*(g_scale*acc + weight_decay*w); acc = 0 if zero_acc.

    ``out`` is ``w`` when None (in place), else a separate buffer (``w`` is only read).
    Releases the GIL; does not allocate.
    """
    for name, val in (("lr", lr), ("weight_decay", weight_decay), ("g_scale", g_scale)):
        _finite("sgd_step", name, val)
    oname = "w" if out is None else "out"
    out = _check_out("sgd_step", w, out)
    if zero_acc:
        dt = _check("sgd_step", (oname, "acc", "w"), (out, acc, w), 2)
    else:
        dt = _check("sgd_step", (oname, "w", "acc"), (out, w, acc), 1)
    if zero_acc:
        if dt == _F32:
            _sgd_zero[float](out, w, acc, lr, weight_decay, g_scale)
        else:
            _sgd_zero[double](out, w, acc, lr, weight_decay, g_scale)
    elif dt == _F32:
        _sgd[float](out, w, acc, lr, weight_decay, g_scale)
    else:
        _sgd[double](out, w, acc, lr, weight_decay, g_scale)


include "_kernels_half.pxi"
