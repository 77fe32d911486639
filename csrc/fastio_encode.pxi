# Included by _fastio.pyx (one extension module): the C front of wire.encode.
# Uses the declarations and DEF constants of _fastio.pyx.

# ------------------------------------------------------------------ hot header encoding
# The same two messages, encoded in C byte for byte as wire.encode's msgpack.packb would
# (tests/test_fastio.py compares them): msgpack-python writes each integer in its smallest
# form, a map or list of up to 15 entries with a one-byte head, strings as fixstr.

DEF HOT_HEADER_BYTES = 128 + 16 * MAX_HOT_FRAMES

cdef Py_ssize_t _put_int(unsigned char *o, long long v) noexcept nogil:
    cdef unsigned long long u
    cdef int n, i
    if v >= 0:
        u = <unsigned long long>v
        if u < 128:
            o[0] = <unsigned char>u
            return 1
        if u <= 0xff:
            o[0] = 0xcc
            n = 1
        elif u <= 0xffff:
            o[0] = 0xcd
            n = 2
        elif u <= 0xffffffffULL:
            o[0] = 0xce
            n = 4
        else:
            o[0] = 0xcf
            n = 8
    else:
        if v >= -32:
            o[0] = <unsigned char>(<signed char>v)
            return 1
        u = <unsigned long long>v
        if v >= -128:
            o[0] = 0xd0
            n = 1
        elif v >= -32768:
            o[0] = 0xd1
            n = 2
        elif v >= -2147483648LL:
            o[0] = 0xd2
            n = 4
        else:
            o[0] = 0xd3
            n = 8
    for i in range(n):
        o[n - i] = <unsigned char>((u >> (8 * i)) & 0xff)
    return 1 + n


cdef inline Py_ssize_t _put_str(unsigned char *o, const char *s) noexcept nogil:
    cdef Py_ssize_t n = 0
    while s[n]:
        o[1 + n] = <unsigned char>s[n]
        n += 1
    o[0] = <unsigned char>(0xa0 | n)
    return 1 + n


cdef inline Py_ssize_t _put_len(unsigned char *o, Py_ssize_t n, unsigned char fix, unsigned char b16) noexcept nogil:
    if n <= 15:
        o[0] = <unsigned char>(fix | n)
        return 1
    o[0] = b16
    o[1] = <unsigned char>(n >> 8)
    o[2] = <unsigned char>(n & 0xff)
    return 3


cdef bint _float32_vector(object arr, Py_ssize_t *count):
    """Whether ``arr`` exports a 1-D C-contiguous float32 buffer (its length in ``count``)."""
    cdef Py_buffer view
    cdef bint ok
    cdef const char *fmt
    if type(arr) is not ndarray:   # wire.encode's general path reads arr.dtype
        return False
    try:
        PyObject_GetBuffer(arr, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    except (TypeError, BufferError, ValueError):
        return False
    fmt = view.format
    ok = view.ndim == 1 and view.itemsize == 4 and fmt != NULL and (
        (fmt[0] == b'f' and fmt[1] == 0)
        or ((fmt[0] == b'<' or fmt[0] == b'=') and fmt[1] == b'f' and fmt[2] == 0))
    count[0] = view.shape[0] if ok else 0
    PyBuffer_Release(&view)
    return ok


def encode_hot(int kind, object sender, object seq, object ts, object inc, payloads,
               dict fields):
    """The header wire.encode would build for a PUSHPULL x{wait: bool}, a WEIGHTS with
    x{sigma: int, parts: int} or any part of it, or a WPART x{offset: int} with one payload;
    1 to 64 float32 payloads (1-D, C-contiguous ndarrays). Returns bytes, or None for anything
    else (then wire.encode takes its general path). Thread-safe."""
    cdef unsigned char buf[HOT_HEADER_BYTES]
    cdef unsigned char *o = buf
    cdef Py_ssize_t n, i, count, nx = len(fields)
    cdef long long vals[4]
    cdef long long xv[2]
    cdef int xk[2]
    if type(payloads) is not list and type(payloads) is not tuple:
        return None
    n = len(payloads)
    if n < 1 or n > MAX_HOT_FRAMES or nx > 2:
        return None
    i = 0
    for name, val in fields.items():
        if name == "wait" and kind == KIND_PUSHPULL and type(val) is bool:
            xk[i], xv[i] = X_WAIT, val
        elif type(val) is not int:
            return None
        elif name == "sigma" and kind == KIND_WEIGHTS:
            xk[i] = X_SIGMA
        elif name == "parts" and kind == KIND_WEIGHTS:
            xk[i] = X_PARTS
        elif name == "offset" and kind == KIND_WPART:
            xk[i] = X_OFFSET
        else:
            return None
        if xk[i] != X_WAIT:
            try:
                xv[i] = val
            except OverflowError:
                return None
        i += 1
    if ((kind == KIND_PUSHPULL and (nx != 1 or xk[0] != X_WAIT))
            or (kind == KIND_WPART and (nx != 1 or n != 1))
            or (nx == 2 and xk[0] == xk[1])
            or kind not in (KIND_PUSHPULL, KIND_WEIGHTS, KIND_WPART)):
        return None
    for i, v in enumerate((sender, seq, ts, inc)):
        if type(v) is not int:
            return None
        try:
            vals[i] = v
        except OverflowError:
            return None
    o += _put_len(o, 8, 0x80, 0xde)
    o += _put_str(o, b"v")
    o += _put_int(o, PROTOCOL_VERSION)
    o += _put_str(o, b"k")
    o += _put_int(o, kind)
    o += _put_str(o, b"s")
    o += _put_int(o, vals[0])
    o += _put_str(o, b"q")
    o += _put_int(o, vals[1])
    o += _put_str(o, b"ts")
    o += _put_int(o, vals[2])
    o += _put_str(o, b"inc")
    o += _put_int(o, vals[3])
    o += _put_str(o, b"p")
    o += _put_len(o, n, 0x90, 0xdc)
    for i in range(n):
        if not _float32_vector(payloads[i], &count):
            return None
        o += _put_len(o, 2, 0x90, 0xdc)
        o += _put_str(o, b"f4")
        o += _put_int(o, count)
    o += _put_str(o, b"x")
    o += _put_len(o, nx, 0x80, 0xde)
    for i in range(nx):
        if xk[i] == X_WAIT:
            o += _put_str(o, b"wait")
            o[0] = 0xc3 if xv[i] else 0xc2
            o += 1
        else:
            o += _put_str(o, b"sigma" if xk[i] == X_SIGMA else
                          (b"parts" if xk[i] == X_PARTS else b"offset"))
            o += _put_int(o, xv[i])
    return PyBytes_FromStringAndSize(<char *>buf, o - buf)
