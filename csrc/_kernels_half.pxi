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
# Each kernel is one pass over its arrays, one call per thread over its part (the drivers
# below). One C function per kernel and format does the whole arithmetic: for
# bfloat16 (a shift, and integer rounding) and in the baseline, a plain loop of the C rule that
# the compiler vectorises at the variant's width; for float16 with F16C, the same arithmetic on
# 8 (AVX2) or 16 (AVX-512) values per instruction, a group holding a NaN by the C rule. The
# float32 arithmetic is written in the same order on both sides (and setup.py keeps FMA
# contraction out), so every variant writes the same bits.
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

    /* A finite v beyond the half range saturates to the largest finite half (not infinity,
       whose residual inf - inf = NaN would poison every later vector); the excess stays in the
       residual. The C rule of narrow-with-feedback for one value: *d = half(v), returns
       v - float(*d). Written as selects, not branches, so that its loops vectorise. */
    static inline float rz_fb_f16_1(uint16_t *d, float v) {
        uint16_t h = rz_f32_to_f16(v);
        h = ((h & 0x7fffu) == 0x7c00u) & (v - v == 0) ? (uint16_t)((h & 0x8000u) | 0x7bffu) : h;
        *d = h;
        return v - rz_f16_to_f32(h);
    }
    static inline float rz_fb_bf16_1(uint16_t *d, float v) {
        uint16_t h = rz_f32_to_bf16(v);
        h = ((h & 0x7fffu) == 0x7f80u) & (v - v == 0) ? (uint16_t)((h & 0x8000u) | 0x7f7fu) : h;
        *d = h;
        return v - rz_bf16_to_f32(h);
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
    #define RZ_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

    /* The F16C loops below leave a group of values holding a NaN to the C rule: the CPU makes
       a signalling NaN quiet, the C rule keeps its payload as NumPy does. */
    #if RZ_AVX512
    static inline __mmask16 rz_nan16_h(__m256i h) {   /* float16 NaNs among 16 */
        return _mm256_cmpgt_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                       _mm256_set1_epi16(0x7c00));
    }
    #endif
    #if RZ_F16C
    static inline int rz_nan8_h(__m128i h) {          /* float16 NaNs among 8 */
        return _mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)),
                                                 _mm_set1_epi16(0x7c00)));
    }
    #endif

    /* d[0:n] = s[0:n] widened */
    static inline void rz_widen_bf16_n(float *d, const uint16_t *s, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) d[i] = rz_bf16_to_f32(s[i]);
    }
    static inline void rz_widen_f16_n(float *d, const uint16_t *s, Py_ssize_t n) {
        Py_ssize_t i = 0;
    #if RZ_AVX512
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
            if (rz_nan16_h(h)) {
                for (Py_ssize_t j = i; j < i + 16; j++) d[j] = rz_f16_to_f32(s[j]);
                continue;
            }
            _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
        }
    #endif
    #if RZ_F16C
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
            if (rz_nan8_h(h)) {
                for (Py_ssize_t j = i; j < i + 8; j++) d[j] = rz_f16_to_f32(s[j]);
                continue;
            }
            _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
        }
    #endif
        for (; i < n; i++) d[i] = rz_f16_to_f32(s[i]);
    }

    /* d[0:n] = s[0:n] narrowed, to nearest even */
    static inline void rz_narrow_bf16_n(uint16_t *d, const float *s, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) d[i] = rz_f32_to_bf16(s[i]);
    }
    static inline void rz_narrow_f16_n(uint16_t *d, const float *s, Py_ssize_t n) {
        Py_ssize_t i = 0;
    #if RZ_AVX512
        for (; i + 16 <= n; i += 16) {
            __m512 x = _mm512_loadu_ps(s + i);
            if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) {
                for (Py_ssize_t j = i; j < i + 16; j++) d[j] = rz_f32_to_f16(s[j]);
                continue;
            }
            _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(x, RZ_RNE));
        }
    #endif
    #if RZ_F16C
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_loadu_ps(s + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
                for (Py_ssize_t j = i; j < i + 8; j++) d[j] = rz_f32_to_f16(s[j]);
                continue;
            }
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(x, RZ_RNE));
        }
    #endif
        for (; i < n; i++) d[i] = rz_f32_to_f16(s[i]);
    }

    /* acc[0:n] += s * g[0:n] widened (s = 1: exactly acc + g) */
    static inline void rz_accumulate_bf16_n(float *acc, const uint16_t *g, float s,
                                            Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) acc[i] = acc[i] + s * rz_bf16_to_f32(g[i]);
    }
    static inline void rz_accumulate_f16_n(float *acc, const uint16_t *g, float s,
                                           Py_ssize_t n) {
        Py_ssize_t i = 0;
    #if RZ_AVX512
        const __m512 s16 = _mm512_set1_ps(s);
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(g + i));
            if (rz_nan16_h(h)) {
                for (Py_ssize_t j = i; j < i + 16; j++) acc[j] = acc[j] + s * rz_f16_to_f32(g[j]);
                continue;
            }
            __m512 x = _mm512_mul_ps(s16, _mm512_cvtph_ps(h));
            _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), x));
        }
    #endif
    #if RZ_F16C
        const __m256 s8 = _mm256_set1_ps(s);
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(g + i));
            if (rz_nan8_h(h)) {
                for (Py_ssize_t j = i; j < i + 8; j++) acc[j] = acc[j] + s * rz_f16_to_f32(g[j]);
                continue;
            }
            __m256 x = _mm256_mul_ps(s8, _mm256_cvtph_ps(h));
            _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), x));
        }
    #endif
        for (; i < n; i++) acc[i] = acc[i] + s * rz_f16_to_f32(g[i]);
    }

    /* v = src + res; dst = half(v) (saturated, above); res = v - float(dst): the rounding
       error is kept, to be added to the next vector (error feedback) */
    static inline void rz_narrow_fb_bf16_n(uint16_t *d, const float *src, float *res,
                                           Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) res[i] = rz_fb_bf16_1(d + i, src[i] + res[i]);
    }
    static inline void rz_narrow_fb_f16_n(uint16_t *d, const float *src, float *res,
                                          Py_ssize_t n) {
        Py_ssize_t i = 0;
        /* saturation as a clamp to +-65504 of the finite values: a value in (65504, 65520)
           rounds to 65504 anyway, one at or past 65520 to infinity, which the rule saturates */
    #if RZ_AVX512
        const __m512 top16 = _mm512_set1_ps(65504.0f), inf16 = _mm512_set1_ps(INFINITY);
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_add_ps(_mm512_loadu_ps(src + i), _mm512_loadu_ps(res + i));
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
                for (Py_ssize_t j = i; j < i + 16; j++) res[j] = rz_fb_f16_1(d + j, src[j] + res[j]);
                continue;
            }
            __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(v), inf16, _CMP_LT_OQ);
            __m512 c = _mm512_mask_mov_ps(
                v, finite, _mm512_max_ps(_mm512_min_ps(v, top16), _mm512_sub_ps(_mm512_setzero_ps(), top16)));
            __m256i h = _mm512_cvtps_ph(c, RZ_RNE);
            _mm256_storeu_si256((__m256i *)(d + i), h);
            _mm512_storeu_ps(res + i, _mm512_sub_ps(v, _mm512_cvtph_ps(h)));
        }
    #endif
    #if RZ_F16C
        const __m256 top8 = _mm256_set1_ps(65504.0f), inf8 = _mm256_set1_ps(INFINITY);
        const __m256 sign8 = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_add_ps(_mm256_loadu_ps(src + i), _mm256_loadu_ps(res + i));
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
                for (Py_ssize_t j = i; j < i + 8; j++) res[j] = rz_fb_f16_1(d + j, src[j] + res[j]);
                continue;
            }
            __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign8, v), inf8, _CMP_LT_OQ);
            __m256 clamped = _mm256_max_ps(_mm256_min_ps(v, top8), _mm256_xor_ps(top8, sign8));
            __m128i h = _mm256_cvtps_ph(_mm256_blendv_ps(v, clamped, finite), RZ_RNE);
            _mm_storeu_si128((__m128i *)(d + i), h);
            _mm256_storeu_ps(res + i, _mm256_sub_ps(v, _mm256_cvtph_ps(h)));
        }
    #endif
    #if !RZ_F16C
        /* Without F16C: the C rule in three loops over 256 values at a time (v on the stack),
           each of which the compiler vectorises as it does narrow_f16's and widen_f16's; the
           one loop of rz_fb_f16_1 did not vectorise and ran 1.35x slower than a9a5a60's
           branches. The same operations on every value, so the same bits. */
        float v[256];
        for (; i < n; i += 256) {
            Py_ssize_t m = n - i < 256 ? n - i : 256;
            for (Py_ssize_t j = 0; j < m; j++) v[j] = src[i + j] + res[i + j];
            for (Py_ssize_t j = 0; j < m; j++) {
                uint16_t h = rz_f32_to_f16(v[j]);
                d[i + j] = ((h & 0x7fffu) == 0x7c00u) & (v[j] - v[j] == 0)
                               ? (uint16_t)((h & 0x8000u) | 0x7bffu) : h;
            }
            for (Py_ssize_t j = 0; j < m; j++) res[i + j] = v[j] - rz_f16_to_f32(d[i + j]);
        }
    #endif
        for (; i < n; i++) res[i] = rz_fb_f16_1(d + i, src[i] + res[i]);
    }
    """
    float rz_f16_to_f32(uint16_t h) noexcept nogil
    float rz_bf16_to_f32(uint16_t b) noexcept nogil
    uint16_t rz_f32_to_f16(float f) noexcept nogil
    uint16_t rz_f32_to_bf16(float f) noexcept nogil
    void rz_widen_f16_n(float *d, const uint16_t *s, Py_ssize_t n) noexcept nogil
    void rz_widen_bf16_n(float *d, const uint16_t *s, Py_ssize_t n) noexcept nogil
    void rz_narrow_f16_n(uint16_t *d, const float *s, Py_ssize_t n) noexcept nogil
    void rz_narrow_bf16_n(uint16_t *d, const float *s, Py_ssize_t n) noexcept nogil
    void rz_accumulate_f16_n(float *acc, const uint16_t *g, float s, Py_ssize_t n) noexcept nogil
    void rz_accumulate_bf16_n(float *acc, const uint16_t *g, float s, Py_ssize_t n) noexcept nogil
    void rz_narrow_fb_f16_n(uint16_t *d, const float *src, float *res,
                            Py_ssize_t n) noexcept nogil
    void rz_narrow_fb_bf16_n(uint16_t *d, const float *src, float *res,
                             Py_ssize_t n) noexcept nogil

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


# Each thread takes one contiguous part and makes one call over it, its vectors starting on a
# 64-byte boundary of the array the kernel writes (_kernels.pxi's _head and _part say why and
# how); thread 0 first runs the head before that boundary apart. (Calls over blocks of 512
# values had cost 10-20 % on two threads: the calls and each loop's set-up.)
cdef int _accumulate_half(float[::1] acc, const uint16_t[::1] g, double s,
                          bint bf16) except -1:
    cdef Py_ssize_t t, lo, hi, head, n = acc.shape[0]
    cdef int nt = _threads_for(n)
    cdef float s_ = <float>s
    if n == 0:
        return 0
    head = _head(&acc[0], 4, n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                if bf16:
                    rz_accumulate_bf16_n(&acc[0], &g[0], s_, head)
                else:
                    rz_accumulate_f16_n(&acc[0], &g[0], s_, head)
                lo = head
            if bf16:
                rz_accumulate_bf16_n(&acc[lo], &g[lo], s_, hi - lo)
            else:
                rz_accumulate_f16_n(&acc[lo], &g[lo], s_, hi - lo)
    return 0


cdef int _widen(float[::1] dst, const uint16_t[::1] src, bint bf16) except -1:
    cdef Py_ssize_t t, lo, hi, head, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    if n == 0:
        return 0
    head = _head(&dst[0], 4, n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                if bf16:
                    rz_widen_bf16_n(&dst[0], &src[0], head)
                else:
                    rz_widen_f16_n(&dst[0], &src[0], head)
                lo = head
            if bf16:
                rz_widen_bf16_n(&dst[lo], &src[lo], hi - lo)
            else:
                rz_widen_f16_n(&dst[lo], &src[lo], hi - lo)
    return 0


cdef int _narrow(uint16_t[::1] dst, const float[::1] src, bint bf16) except -1:
    cdef Py_ssize_t t, lo, hi, head, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    if n == 0:
        return 0
    head = _head(&dst[0], 2, n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                if bf16:
                    rz_narrow_bf16_n(&dst[0], &src[0], head)
                else:
                    rz_narrow_f16_n(&dst[0], &src[0], head)
                lo = head
            if bf16:
                rz_narrow_bf16_n(&dst[lo], &src[lo], hi - lo)
            else:
                rz_narrow_f16_n(&dst[lo], &src[lo], hi - lo)
    return 0


cdef int _narrow_feedback(uint16_t[::1] dst, const float[::1] src, float[::1] res,
                          bint bf16) except -1:
    cdef Py_ssize_t t, lo, hi, head, n = dst.shape[0]
    cdef int nt = _threads_for(n)
    if n == 0:
        return 0
    head = _head(&res[0], 4, n)
    with nogil:
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = _part(n, head, t, nt)
            hi = _part(n, head, t + 1, nt)
            if t == 0:
                if bf16:
                    rz_narrow_fb_bf16_n(&dst[0], &src[0], &res[0], head)
                else:
                    rz_narrow_fb_f16_n(&dst[0], &src[0], &res[0], head)
                lo = head
            if bf16:
                rz_narrow_fb_bf16_n(&dst[lo], &src[lo], &res[lo], hi - lo)
            else:
                rz_narrow_fb_f16_n(&dst[lo], &src[lo], &res[lo], hi - lo)
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
