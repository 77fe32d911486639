# Included by _fastio.pyx (one extension module): the C front of wire.decode.
# Uses the declarations and DEF constants of _fastio.pyx.

# ------------------------------------------------------------------ hot header parsing
# wire.decode validates every message in Python (msgpack.unpackb, then a dozen checks): ~8 µs
# warm and several times that with the caches the I/O threads leave behind. The messages of
# every training step -- a learner's PUSHPULL, the PS's WEIGHTS reply and its WPART parts --
# have one fixed shape, so ``decode_hot`` recognises exactly that shape in C and says None to anything else,
# which wire.decode then handles (and refuses) as before. What it accepts, wire.decode
# accepts with the same result (tests/test_fastio.py compares the two on mutated headers).


cdef struct Cursor:
    const unsigned char *p
    const unsigned char *end


cdef inline bint _take(Cursor *c, Py_ssize_t n) noexcept nogil:
    if c.end - c.p < n:
        return False
    c.p += n
    return True


cdef inline unsigned long long _be(const unsigned char *p, int n) noexcept nogil:
    cdef unsigned long long v = 0
    cdef int i
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef bint _read_int(Cursor *c, long long *out) noexcept nogil:
    """A msgpack integer that fits int64 (booleans and floats are not integers)."""
    cdef const unsigned char *p = c.p
    cdef unsigned char b
    cdef unsigned long long u
    cdef int n
    if c.p >= c.end:
        return False
    b = p[0]
    if b <= 0x7f or b >= 0xe0:              # positive / negative fixint
        out[0] = <signed char>b
        c.p += 1
        return True
    if 0xcc <= b <= 0xd3:                    # uint8..uint64, int8..int64
        n = 1 << ((b - 0xcc) & 3)
        if not _take(c, 1 + n):
            return False
        u = _be(p + 1, n)
        if b <= 0xcf:                        # unsigned: must fit int64
            if u > 0x7fffffffffffffffULL:
                return False
            out[0] = <long long>u
        elif n == 1:                         # signed: sign-extend from n bytes
            out[0] = <signed char>u
        elif n == 2:
            out[0] = <short>u
        elif n == 4:
            out[0] = <int>u
        else:
            out[0] = <long long>u
        return True
    return False


cdef inline Py_ssize_t _read_str(Cursor *c, const unsigned char **s) noexcept nogil:
    """A fixstr (all the hot shape uses); returns its length, -1 if not one."""
    cdef unsigned char b
    cdef Py_ssize_t n
    if c.p >= c.end:
        return -1
    b = c.p[0]
    if b < 0xa0 or b > 0xbf:
        return -1
    n = b & 0x1f
    s[0] = c.p + 1
    if not _take(c, 1 + n):
        return -1
    return n


cdef inline Py_ssize_t _read_container(Cursor *c, unsigned char fix, unsigned char b16) noexcept nogil:
    """A fixmap/fixarray (``fix`` = 0x80/0x90) or map16/array16; returns its length, -1 if
    not one."""
    cdef unsigned char b
    if c.p >= c.end:
        return -1
    b = c.p[0]
    if fix <= b <= fix + 0x0f:
        c.p += 1
        return b & 0x0f
    if b == b16 and _take(c, 3):
        return <Py_ssize_t>_be(c.p - 2, 2)
    return -1


cdef inline bint _is(const unsigned char *s, Py_ssize_t n, const char *lit, Py_ssize_t m) noexcept nogil:
    cdef Py_ssize_t i
    if n != m:
        return False
    for i in range(n):
        if s[i] != <unsigned char>lit[i]:
            return False
    return True


cdef struct Hot:
    long long v, k, s, q, ts, inc
    Py_ssize_t npay
    long long counts[MAX_HOT_FRAMES]
    int has[4]                         # x fields present, by X_* index
    long long val[4]                   # their values (wait: 0 or 1)
    int order[2]                       # the x keys in the order they came
    int nx


cdef bint _parse(const unsigned char *buf, Py_ssize_t n, Hot *h) noexcept nogil:
    """The hot shape: a map of exactly v, k, s, q, ts, inc (integers), p (a list of
    ["f4", count >= 0]) and x (a map of at most two of wait: bool, sigma, parts, offset:
    integers), each once, and nothing after it."""
    cdef Cursor c
    cdef Py_ssize_t entries, i, j, klen, m, xn
    cdef const unsigned char *key
    cdef const unsigned char *dt
    cdef int seen = 0, bit
    cdef long long *dst
    cdef long long *ints[6]
    ints[0], ints[1], ints[2], ints[3], ints[4], ints[5] = &h.v, &h.k, &h.s, &h.q, &h.ts, &h.inc
    c.p = buf
    c.end = buf + n
    h.has[0] = h.has[1] = h.has[2] = h.has[3] = 0
    h.nx = 0
    h.npay = -1
    entries = _read_container(&c, 0x80, 0xde)
    if entries != 8:
        return False
    for i in range(8):
        klen = _read_str(&c, &key)
        if klen < 0:
            return False
        bit = -1
        for j in range(8):       # v, k, s, q, ts, inc (integers), p, x
            if _is(key, klen, rz_keys[j], rz_key_len[j]):
                bit = 1 << j
                break
        if bit < 0:
            return False
        dst = ints[j] if j < 6 else NULL
        if seen & bit:
            return False
        seen |= bit
        if dst != NULL:
            if not _read_int(&c, dst):
                return False
        elif bit == 64:
            m = _read_container(&c, 0x90, 0xdc)
            if m < 0 or m > MAX_HOT_FRAMES:
                return False
            h.npay = m
            for j in range(m):
                if _read_container(&c, 0x90, 0xdc) != 2 or _read_str(&c, &dt) != 2:
                    return False
                if dt[0] != b'f' or dt[1] != b'4':
                    return False
                if not _read_int(&c, &h.counts[j]) or h.counts[j] < 0:
                    return False
        else:
            xn = _read_container(&c, 0x80, 0xde)
            if xn < 0 or xn > 2:
                return False
            for j in range(xn):
                klen = _read_str(&c, &key)
                if klen < 0 or c.p >= c.end:
                    return False
                for m in range(4):   # wait (a boolean), sigma, parts, offset (integers)
                    if _is(key, klen, rz_xkeys[m], rz_xkey_len[m]):
                        break
                else:
                    return False
                if h.has[m]:
                    return False
                if m == X_WAIT:
                    if c.p[0] != 0xc2 and c.p[0] != 0xc3:
                        return False
                    h.val[m] = c.p[0] == 0xc3
                    c.p += 1
                elif not _read_int(&c, &h.val[m]):
                    return False
                h.has[m] = 1
                h.order[j] = m
            h.nx = xn
    return c.p == c.end


cdef bint _hot_fields(Hot *h) noexcept:
    """The kind-specific fields of the hot kinds: PUSHPULL x{wait}; WEIGHTS x{} / x{sigma} /
    x{parts} / both (0 <= parts <= MAX_PARTS); WPART x{offset} with one payload frame."""
    if h.k == KIND_PUSHPULL:
        return h.nx == 1 and h.has[X_WAIT]
    if h.k == KIND_WEIGHTS:
        return (not h.has[X_WAIT] and not h.has[X_OFFSET]
                and (not h.has[X_PARTS] or 0 <= h.val[X_PARTS] <= MAX_PARTS))
    if h.k == KIND_WPART:
        return h.nx == 1 and h.has[X_OFFSET] and h.npay == 1
    return False


cdef dict _fields(Hot *h):
    cdef dict out = {}
    cdef int j, m
    for j in range(h.nx):
        m = h.order[j]
        out[X_NAMES[m]] = bool(h.val[m]) if m == X_WAIT else h.val[m]
    return out


X_NAMES = ("wait", "sigma", "parts", "offset")


def decode_hot(list frames, long long numel=-1):
    """Recognise a hot message: ``frames`` = [header, payload...] (no routing id) where the
    header has the shape above and is a PUSHPULL x{wait}, a WEIGHTS x{sigma?, parts?} or a
    WPART x{offset}, with 1 to 64 payload frames (WPART: one) whose byte sizes match their
    float32 counts, adding up to ``numel`` (unless -1, or a part of a streamed reply).
    Returns (version, kind, sender, seq, ts, inc, fields) or None (not hot: decode it the
    general way). Never raises for bad input; thread-safe."""
    cdef Py_buffer view
    cdef Hot h
    cdef bint ok
    cdef Py_ssize_t i, nf = len(frames)
    cdef long long total = 0
    if nf < 2 or nf - 1 > MAX_HOT_FRAMES:
        return None
    try:
        PyObject_GetBuffer(frames[0], &view, PyBUF_ANY_CONTIGUOUS)
    except (TypeError, BufferError):
        return None
    try:
        with nogil:
            ok = view.len <= 65536 and _parse(<const unsigned char *>view.buf, view.len, &h)
    finally:
        PyBuffer_Release(&view)
    if not ok or h.npay != nf - 1:
        return None
    if not _hot_fields(&h):
        return None
    fields = _fields(&h)
    if h.k == KIND_WPART or (h.has[X_PARTS] and h.val[X_PARTS] > 0):
        numel = -1      # a part of a streamed reply: wire.assemble checks the total
    for i in range(1, nf):
        try:
            PyObject_GetBuffer(frames[i], &view, PyBUF_ANY_CONTIGUOUS)
        except (TypeError, BufferError):
            return None
        ok = view.len == h.counts[i - 1] * 4
        PyBuffer_Release(&view)
        if not ok:
            return None
        total += h.counts[i - 1]
    if numel >= 0 and total != numel:
        return None
    return (h.v, h.k, h.s, h.q, h.ts, h.inc, fields)
