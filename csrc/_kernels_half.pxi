# Included by _kernels.pyx (same module: shares its thread settings and checks).
#
# Half-precision kernels: float16 and bfloat16 payloads against float32 buffers, the seam for a
# compressed wire (rudra_zmq/codec.py). The float32 side is always the accumulator or the
# destination; the half side is read (``const``) or written. bfloat16 travels as its uint16 bit
# patterns because NumPy has no bfloat16 dtype; float16 arrays are viewed as uint16 too (a new
# array object over the same memory, no copy), so one typed loop serves both formats.
#
# Conversions are exact bit manipulations, written out in C so that the kernels need neither
# F16C (not in the default -march=x86-64-v2) nor a compiler's _Float16:
# - widening (half -> float32) is exact for every value, subnormals, infinities and NaNs;
# - narrowing (float32 -> half) rounds to nearest, ties to even, as NumPy's astype(float16)
#   and torch's .to(torch.bfloat16) do; values beyond the half range become infinities.
from libc.stdint cimport uint16_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    static inline float rz_f16_to_f32(uint16_t h) {
        /* F. Giesen's half_to_float: move exponent and mantissa into place, rebias, then fix
           infinities/NaNs (top exponent) and subnormals (renormalised by one exact float
           subtraction). */
        const uint32_t shifted_exp = 0x7c00u << 13;
        uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
        uint32_t e = shifted_exp & o;
        float f;
        o += (uint32_t)(127 - 15) << 23;
        if (e == shifted_exp) {
            o += (uint32_t)(128 - 16) << 23;
            memcpy(&f, &o, 4);
        } else if (e == 0) {
            const uint32_t magic_bits = 113u << 23;
            float magic;
            memcpy(&magic, &magic_bits, 4);
            o += 1u << 23;
            memcpy(&f, &o, 4);
            f -= magic;
        } else {
            memcpy(&f, &o, 4);
        }
        memcpy(&o, &f, 4);
        o |= (uint32_t)(h & 0x8000u) << 16;
        memcpy(&f, &o, 4);
        return f;
    }
    static inline float rz_bf16_to_f32(uint16_t b) {
        uint32_t o = (uint32_t)b << 16;
        float f;
        memcpy(&f, &o, 4);
        return f;
    }
    static inline uint16_t rz_f32_to_f16(float f) {
        uint32_t x, t;
        float s;
        memcpy(&x, &f, 4);
        uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
        x &= 0x7fffffffu;
        if (x > 0x7f800000u) {            /* NaN: keep the top payload bits, as NumPy does */
            uint16_t m = (uint16_t)(x >> 13) & 0x3ffu;
            return sign | 0x7c00u | (m ? m : 1u);
        }
        if (x >= 0x477ff000u)              /* >= 65520 (and inf) rounds to infinity */
            return sign | 0x7c00u;
        if (x < 0x38800000u) {             /* below 2^-14: a subnormal half or zero; adding */
            memcpy(&s, &x, 4);             /* 0.5 lets the FPU round at 2^-24 (even ties) */
            s += 0.5f;
            memcpy(&t, &s, 4);
            return sign | (uint16_t)(t - 0x3f000000u);
        }
        x += 0xfffu + ((x >> 13) & 1u);    /* round to nearest even; a carry bumps the exponent */
        return sign | (uint16_t)((x - (112u << 23)) >> 13);
    }
    static inline uint16_t rz_f32_to_bf16(float f) {
        uint32_t x;
        memcpy(&x, &f, 4);
        if ((x & 0x7fffffffu) > 0x7f800000u)  /* NaN stays NaN (made quiet) */
            return (uint16_t)((x >> 16) | 0x40u);
        x += 0x7fffu + ((x >> 16) & 1u);      /* round to nearest even */
        return (uint16_t)(x >> 16);
    }
    """
    float rz_f16_to_f32(uint16_t h) noexcept nogil
    float rz_bf16_to_f32(uint16_t b) noexcept nogil
    uint16_t rz_f32_to_f16(float f) noexcept nogil
    uint16_t rz_f32_to_bf16(float f) noexcept nogil

_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)


cdef object _check_half(str op, str fname, f, str hname, h, object hdtype, bint write_f):
    """Validate a float32 array ``f`` and a half array ``h`` of dtype ``hdtype`` (float16 or
    uint16 for bfloat16 bits) of one length; ``write_f``: f is written, else h is. Returns
    ``h`` as uint16 (a view of the same memory)."""
    want = {_F16: "float16", _U16: "uint16 (bfloat16 bits)"}[hdtype]
    for name, x, dt, what in ((fname, f, _F32, "float32"), (hname, h, hdtype, want)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{op}: {name} must be a numpy.ndarray, got {type(x).__name__}")
        if x.dtype != dt:
            raise ValueError(f"{op}: {name} has dtype {x.dtype}; it must be {what}")
        if x.ndim != 1 or not x.flags.c_contiguous:
            raise ValueError(
                f"{op}: {name} must be 1-D and C-contiguous, got shape {x.shape} "
                f"(contiguous={x.flags.c_contiguous}); pass x.reshape(-1) of a contiguous buffer")
    out_name, out = (fname, f) if write_f else (hname, h)
    if not out.flags.writeable:
        raise ValueError(f"{op}: {out_name} is read-only but is written in place")
    if h.shape[0] != f.shape[0]:
        raise ValueError(f"{op}: {hname} has {h.shape[0]:,} elements but {fname} has "
                         f"{f.shape[0]:,}; both arrays must have the same length")
    return h if hdtype == _U16 else h.view(np.uint16)


cdef int _accumulate_half(float[::1] acc, const uint16_t[::1] g, double s,
                          bint bf16) except -1:
    # acc + s_*x with s_ = 1 is exactly acc + x, so one loop serves both calls
    cdef Py_ssize_t i, n = acc.shape[0]
    cdef int nt = _threads_for(n)
    cdef float s_ = <float>s
    with nogil:
        if bf16:
            for i in prange(n, schedule="static", num_threads=nt):
                acc[i] = acc[i] + s_ * rz_bf16_to_f32(g[i])
        else:
            for i in prange(n, schedule="static", num_threads=nt):
                acc[i] = acc[i] + s_ * rz_f16_to_f32(g[i])
    return 0


cdef int _widen(float[::1] dst, const uint16_t[::1] src, bint bf16) except -1:
    cdef Py_ssize_t i, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    with nogil:
        if bf16:
            for i in prange(n, schedule="static", num_threads=nt):
                dst[i] = rz_bf16_to_f32(src[i])
        else:
            for i in prange(n, schedule="static", num_threads=nt):
                dst[i] = rz_f16_to_f32(src[i])
    return 0


cdef int _narrow(uint16_t[::1] dst, const float[::1] src, bint bf16) except -1:
    cdef Py_ssize_t i, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    with nogil:
        if bf16:
            for i in prange(n, schedule="static", num_threads=nt):
                dst[i] = rz_f32_to_bf16(src[i])
        else:
            for i in prange(n, schedule="static", num_threads=nt):
                dst[i] = rz_f32_to_f16(src[i])
    return 0


cdef int _narrow_feedback(uint16_t[::1] dst, const float[::1] src, float[::1] res,
                          bint bf16) except -1:
    # v = src + res; dst = half(v); res = v - float(half(v)): the rounding error is kept,
    # to be added to the next vector (error feedback). A finite v beyond the half range
    # saturates to the largest finite half (not infinity, whose residual inf - inf = NaN
    # would poison every later vector); the excess stays in the residual.
    cdef Py_ssize_t i, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    cdef float v
    cdef uint16_t h
    with nogil:
        if bf16:
            for i in prange(n, schedule="static", num_threads=nt):
                v = src[i] + res[i]
                h = rz_f32_to_bf16(v)
                if (h & 0x7fffu) == 0x7f80u and v - v == 0:
                    h = (h & 0x8000u) | 0x7f7fu  # finite v rounded to infinity
                dst[i] = h
                res[i] = v - rz_bf16_to_f32(h)
        else:
            for i in prange(n, schedule="static", num_threads=nt):
                v = src[i] + res[i]
                h = rz_f32_to_f16(v)
                if (h & 0x7fffu) == 0x7c00u and v - v == 0:
                    h = (h & 0x8000u) | 0x7bffu  # finite v beyond 65504: saturate
                dst[i] = h
                res[i] = v - rz_f16_to_f32(h)
    return 0


def accumulate_f16(acc, g, double s=1.0):
    """acc += s*g, in place: ``acc`` float32, ``g`` float16 (widened exactly, then added in
    float32). Releases the GIL; does not allocate."""
    _finite("accumulate_f16", "s", s)
    bits = _check_half("accumulate_f16", "acc", acc, "g", g, _F16, True)   # before any cast
    _accumulate_half(acc, bits, s, False)


def accumulate_bf16(acc, g, double s=1.0):
    """acc += s*g, in place: ``acc`` float32, ``g`` bfloat16 as uint16 bit patterns (NumPy has
    no bfloat16). Releases the GIL; does not allocate."""
    _finite("accumulate_bf16", "s", s)
    bits = _check_half("accumulate_bf16", "acc", acc, "g", g, _U16, True)
    _accumulate_half(acc, bits, s, True)


def widen_f16(dst, src):
    """dst[:] = src: float16 ``src`` into float32 ``dst`` (exact). Releases the GIL; does not
    allocate."""
    bits = _check_half("widen_f16", "dst", dst, "src", src, _F16, True)
    _widen(dst, bits, False)


def widen_bf16(dst, src):
    """dst[:] = src: bfloat16 ``src`` (uint16 bits) into float32 ``dst`` (exact).
    Releases the GIL; does not allocate."""
    bits = _check_half("widen_bf16", "dst", dst, "src", src, _U16, True)
    _widen(dst, bits, True)


def narrow_f16(dst, src):
    """dst[:] = src: float32 ``src`` into float16 ``dst``, rounded to nearest even (as
    ``src.astype(np.float16)``). Releases the GIL; does not allocate."""
    bits = _check_half("narrow_f16", "src", src, "dst", dst, _F16, False)
    _narrow(bits, src, False)


def narrow_bf16(dst, src):
    """dst[:] = src: float32 ``src`` into bfloat16 ``dst`` (uint16 bits), rounded to nearest
    even (as torch's ``.to(torch.bfloat16)``). Releases the GIL; does not allocate."""
    bits = _check_half("narrow_bf16", "src", src, "dst", dst, _U16, False)
    _narrow(bits, src, True)


cdef object _check_feedback(str op, dst, src, res, object hdtype):
    bits = _check_half(op, "src", src, "dst", dst, hdtype, False)
    _check_half(op, "residual", res, "dst", dst, hdtype, True)
    if np.shares_memory(res, src):
        raise ValueError(f"{op}: residual and src overlap; the residual is a buffer of its own")
    return bits


def narrow_f16_feedback(dst, src, residual):
    """Error feedback: v = src + residual; dst[:] = v as float16 (nearest even; a finite v
    beyond ±65504 saturates there instead of becoming infinite); residual[:] = v - dst (the
    rounding error, exactly, for the next call). ``residual`` float32, written in place;
    ``src`` is only read. Releases the GIL; does not allocate."""
    bits = _check_feedback("narrow_f16_feedback", dst, src, residual, _F16)
    _narrow_feedback(bits, src, residual, False)


def narrow_bf16_feedback(dst, src, residual):
    """As :func:`narrow_f16_feedback`, to bfloat16 (uint16 bits; a finite v that rounds past
    the largest bfloat16 saturates there). Releases the GIL; does not allocate."""
    bits = _check_feedback("narrow_bf16_feedback", dst, src, residual, _U16)
    _narrow_feedback(bits, src, residual, True)
