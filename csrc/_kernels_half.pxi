# Included by _kernels.pxi (same module: shares its thread settings and checks).
#
# Half-precision kernels: float16 and bfloat16 payloads against float32 buffers, the seam for a
# compressed wire (rudra_zmq/codec.py). The float32 side is always the accumulator or the
# destination; the half side is read (``const``) or written. bfloat16 travels as its uint16 bit
# patterns because NumPy has no bfloat16 dtype; float16 arrays are viewed as uint16 too (a new
# array object over the same memory, no copy), so one typed loop serves both formats.
#
# Conversions are exact bit manipulations, written out in C so that the baseline needs neither
# F16C (not in x86-64-v2) nor a compiler's _Float16:
# - widening (half -> float32) is exact for every value, subnormals, infinities and NaNs;
# - narrowing (float32 -> half) rounds to nearest, ties to even, as NumPy's astype(float16)
#   and torch's .to(torch.bfloat16) do; values beyond the half range become infinities.
# A variant compiled with F16C (avx2, avx512) converts float16 with the CPU's own instructions
# (vcvtph2ps, vcvtps2ph with round-to-nearest-even): the same IEEE rule, 8 values per
# instruction instead of some 20 instructions per value. They differ from the rule above only
# in a NaN's payload (the CPU makes a signalling NaN quiet), so a group of 8 holding a NaN goes
# through the C rule instead: every variant writes the same bits (tests/test_kernels_half.py).
#
# Each kernel works through its arrays a block of BLOCK values at a time, and writes its float32
# arithmetic once for every variant: a variant that converts float16 a block at a time does so
# into a buffer on the stack (it stays in L1) that the arithmetic reads (rz_half_at), the others
# convert each value where the arithmetic reads it. Every loop is simple enough to vectorise.
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
        const uint32_t magic_bits = 113u << 23;
        float f, magic;
        o += (uint32_t)(127 - 15) << 23;
        if (e == shifted_exp)
            o += (uint32_t)(128 - 16) << 23;
        else if (e == 0)
            o += 1u << 23;
        memcpy(&f, &o, 4);
        if (e == 0) {
            memcpy(&magic, &magic_bits, 4);
            f -= magic;
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

    #if defined(__F16C__) && defined(__AVX__)
    #include <immintrin.h>
    #define RZ_F16C 1
    #else
    #define RZ_F16C 0
    #endif
    #if RZ_F16C && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    #define RZ_AVX512 1   /* 16 values per instruction; the 8-wide F16C loop takes the rest */
    #else
    #define RZ_AVX512 0
    #endif
    /* d[0:n] = s[0:n] widened (bfloat16 bits if bf16, else float16 bits) */
    static inline void rz_widen_n(float *d, const uint16_t *s, Py_ssize_t n, int bf16) {
        Py_ssize_t i = 0;
        if (bf16) {
            for (; i < n; i++) d[i] = rz_bf16_to_f32(s[i]);
            return;
        }
    #if RZ_AVX512
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
            if (_mm256_cmpgt_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                        _mm256_set1_epi16(0x7c00))) {
                for (Py_ssize_t j = i; j < i + 16; j++) d[j] = rz_f16_to_f32(s[j]);
                continue;
            }
            _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
        }
    #endif
    #if RZ_F16C
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)),
                                          _mm_set1_epi16(0x7c00));
            if (_mm_movemask_epi8(nan)) {   /* keep a NaN's payload as the C rule does */
                for (Py_ssize_t j = i; j < i + 8; j++) d[j] = rz_f16_to_f32(s[j]);
                continue;
            }
            _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
        }
    #endif
        for (; i < n; i++) d[i] = rz_f16_to_f32(s[i]);
    }
    /* d[0:n] = s[0:n] narrowed, to nearest even (bfloat16 bits if bf16, else float16 bits) */
    static inline void rz_narrow_n(uint16_t *d, const float *s, Py_ssize_t n, int bf16) {
        Py_ssize_t i = 0;
        if (bf16) {
            for (; i < n; i++) d[i] = rz_f32_to_bf16(s[i]);
            return;
        }
    #if RZ_AVX512
        for (; i + 16 <= n; i += 16) {
            __m512 x = _mm512_loadu_ps(s + i);
            if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) {   /* a NaN: C rule */
                for (Py_ssize_t j = i; j < i + 16; j++) d[j] = rz_f32_to_f16(s[j]);
                continue;
            }
            _mm256_storeu_si256((__m256i *)(d + i),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    #endif
    #if RZ_F16C
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_loadu_ps(s + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {   /* a NaN: C rule */
                for (Py_ssize_t j = i; j < i + 8; j++) d[j] = rz_f32_to_f16(s[j]);
                continue;
            }
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    #endif
        for (; i < n; i++) d[i] = rz_f32_to_f16(s[i]);
    }
    /* The half operand of a kernel's arithmetic. Where the CPU converts a block at a time
       (float16 with F16C), rz_widen_block fills x[0:n] first and rz_half_at reads x[j];
       elsewhere (bfloat16's shift, the C rule) rz_widen_block does nothing and rz_half_at
       converts s[j] where it is read, so that loop stays a single pass. */
    static inline int rz_blockwise(int bf16) { return RZ_F16C && !bf16; }
    static inline void rz_widen_block(float *x, const uint16_t *s, Py_ssize_t n, int bf16) {
        if (rz_blockwise(bf16)) rz_widen_n(x, s, n, bf16);
    }
    static inline float rz_half_at(const float *x, const uint16_t *s, Py_ssize_t j, int bf16) {
        if (rz_blockwise(bf16)) return x[j];
        return bf16 ? rz_bf16_to_f32(s[j]) : rz_f16_to_f32(s[j]);
    }
    """
    float rz_f16_to_f32(uint16_t h) noexcept nogil
    float rz_bf16_to_f32(uint16_t b) noexcept nogil
    uint16_t rz_f32_to_f16(float f) noexcept nogil
    uint16_t rz_f32_to_bf16(float f) noexcept nogil
    int RZ_F16C
    void rz_widen_n(float *d, const uint16_t *s, Py_ssize_t n, int bf16) noexcept nogil
    void rz_narrow_n(uint16_t *d, const float *s, Py_ssize_t n, int bf16) noexcept nogil
    void rz_widen_block(float *x, const uint16_t *s, Py_ssize_t n, int bf16) noexcept nogil
    float rz_half_at(const float *x, const uint16_t *s, Py_ssize_t j, int bf16) noexcept nogil

# Values converted at a time (see the top): 2 KiB of float32 per buffer, in L1 with room to
# spare, and long enough that the loops over it run at full vector width.
cdef enum:
    BLOCK = 512

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


cdef inline Py_ssize_t _blocks(Py_ssize_t n) noexcept nogil:
    return (n + BLOCK - 1) // BLOCK


cdef inline Py_ssize_t _block_len(Py_ssize_t lo, Py_ssize_t n) noexcept nogil:
    return BLOCK if n - lo > BLOCK else n - lo


cdef void _accumulate_block(float *acc, const uint16_t *g, float s, Py_ssize_t n,
                            bint bf16) noexcept nogil:
    # acc + s*x with s = 1 is exactly acc + x, so one loop serves both calls
    cdef float x[BLOCK]
    cdef Py_ssize_t j
    rz_widen_block(x, g, n, bf16)
    for j in range(n):
        acc[j] = acc[j] + s * rz_half_at(x, g, j, bf16)


cdef int _accumulate_half(float[::1] acc, const uint16_t[::1] g, double s,
                          bint bf16) except -1:
    cdef Py_ssize_t b, lo, n = acc.shape[0]
    cdef int nt = _threads_for(n)
    cdef float s_ = <float>s
    with nogil:
        for b in prange(_blocks(n), schedule="static", num_threads=nt):
            lo = b * BLOCK
            _accumulate_block(&acc[lo], &g[lo], s_, _block_len(lo, n), bf16)
    return 0


cdef int _widen(float[::1] dst, const uint16_t[::1] src, bint bf16) except -1:
    cdef Py_ssize_t b, lo, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    with nogil:
        for b in prange(_blocks(n), schedule="static", num_threads=nt):
            lo = b * BLOCK
            rz_widen_n(&dst[lo], &src[lo], _block_len(lo, n), bf16)
    return 0


cdef int _narrow(uint16_t[::1] dst, const float[::1] src, bint bf16) except -1:
    cdef Py_ssize_t b, lo, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    with nogil:
        for b in prange(_blocks(n), schedule="static", num_threads=nt):
            lo = b * BLOCK
            rz_narrow_n(&dst[lo], &src[lo], _block_len(lo, n), bf16)
    return 0


cdef void _narrow_feedback_block(uint16_t *dst, const float *src, float *res, Py_ssize_t n,
                                 bint bf16) noexcept nogil:
    # v = src + res; dst = half(v); res = v - float(half(v)): the rounding error is kept,
    # to be added to the next vector (error feedback). A finite v beyond the half range
    # saturates to the largest finite half (not infinity, whose residual inf - inf = NaN
    # would poison every later vector); the excess stays in the residual.
    cdef float v[BLOCK]
    cdef float back[BLOCK]
    cdef Py_ssize_t j
    cdef uint16_t h
    cdef uint16_t inf = 0x7f80u if bf16 else 0x7c00u  # the largest finite half is inf - 1
    for j in range(n):
        v[j] = src[j] + res[j]
    rz_narrow_n(dst, v, n, bf16)
    for j in range(n):
        # a finite v rounded to infinity; written as a select (`&`, and a store on both
        # sides), not a branch, so that the loop vectorises without AVX-512's masked stores
        h = dst[j]
        dst[j] = ((h & 0x8000u) | (inf - 1)) if ((h & 0x7fffu) == inf) & (v[j] - v[j] == 0) else h
    rz_widen_block(back, dst, n, bf16)
    for j in range(n):
        res[j] = v[j] - rz_half_at(back, dst, j, bf16)


cdef int _narrow_feedback(uint16_t[::1] dst, const float[::1] src, float[::1] res,
                          bint bf16) except -1:
    cdef Py_ssize_t b, lo, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    with nogil:
        for b in prange(_blocks(n), schedule="static", num_threads=nt):
            lo = b * BLOCK
            _narrow_feedback_block(&dst[lo], &src[lo], &res[lo], _block_len(lo, n), bf16)
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
