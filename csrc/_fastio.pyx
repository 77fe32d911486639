# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled ZeroMQ framing for the hot path (see rudra_zmq.fastio, which loads it).

pyzmq spends tens of microseconds per message in Python objects (a ``zmq.Frame`` per frame,
and for every zero-copy frame a release that travels through its garbage-collector thread).
At 90k parameters that is a fifth of a round trip on this machine (bench/RESULTS.md). This
module sends and receives whole multipart messages on a pyzmq socket by calling libzmq's C
API directly, with the GIL released while libzmq works:

- ``send(sock, frames, flags)``: small frames are copied into the message; larger ones are
  sent zero-copy and pinned: a :class:`Pin` holds their buffers until libzmq has released
  every one of them (its free callback, run on a ZeroMQ I/O thread, only decrements an atomic
  counter; it never touches Python);
- ``recv(sock, flags)``: one whole multipart message as :class:`Frame` objects, each owning
  its ``zmq_msg_t`` and exposing it read-only through the buffer protocol (no copy).

libzmq's functions are not linked at build time: ``bind_libzmq`` receives their addresses,
resolved from the libzmq that pyzmq itself loaded, so both use the same library and context.
Nothing here parses message contents: wire.py validates every header and payload.
"""
from cpython.buffer cimport (PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT)
from cpython.exc cimport PyErr_CheckSignals
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uintptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy

from numpy import ndarray
from zmq.error import Again, ZMQError

cdef extern from *:
    """
    #include <errno.h>
    #include <stdint.h>
    #include <stddef.h>
    /* zmq_msg_t as libzmq >= 4.1 declares it: 64 opaque bytes, pointer-aligned */
    typedef struct { _Alignas(8) unsigned char _[64]; } rz_msg_t;
    typedef void (rz_free_fn)(void *data, void *hint);
    static int (*rz_p_init)(rz_msg_t *);
    static int (*rz_p_init_size)(rz_msg_t *, size_t);
    static int (*rz_p_init_data)(rz_msg_t *, void *, size_t, rz_free_fn *, void *);
    static int (*rz_p_send)(rz_msg_t *, void *, int);
    static int (*rz_p_recv)(rz_msg_t *, void *, int);
    static int (*rz_p_close)(rz_msg_t *);
    static void *(*rz_p_data)(rz_msg_t *);
    static size_t (*rz_p_size)(const rz_msg_t *);
    static int (*rz_p_more)(const rz_msg_t *);
    static int (*rz_p_errno)(void);
    static int rz_bound = 0;

    static void rz_bind(uintptr_t a0, uintptr_t a1, uintptr_t a2, uintptr_t a3,
                        uintptr_t a4, uintptr_t a5, uintptr_t a6, uintptr_t a7,
                        uintptr_t a8, uintptr_t a9) {
        rz_p_init = (int (*)(rz_msg_t *))a0;
        rz_p_init_size = (int (*)(rz_msg_t *, size_t))a1;
        rz_p_init_data = (int (*)(rz_msg_t *, void *, size_t, rz_free_fn *, void *))a2;
        rz_p_send = (int (*)(rz_msg_t *, void *, int))a3;
        rz_p_recv = (int (*)(rz_msg_t *, void *, int))a4;
        rz_p_close = (int (*)(rz_msg_t *))a5;
        rz_p_data = (void *(*)(rz_msg_t *))a6;
        rz_p_size = (size_t (*)(const rz_msg_t *))a7;
        rz_p_more = (int (*)(const rz_msg_t *))a8;
        rz_p_errno = (int (*)(void))a9;
        rz_bound = 1;
    }

    /* A pin's shared word: the number of its frames libzmq still holds, plus RZ_ORPHAN once
       Python let go of the pin. Whoever brings it to exactly RZ_ORPHAN frees it: the last
       release callback (I/O thread) or the pin's deallocation (Python), never both. */
    #define RZ_ORPHAN (1 << 30)
    typedef struct { int word; } rz_pin_t;
    static void rz_release(void *data, void *hint) {
        rz_pin_t *p = (rz_pin_t *)hint;
        (void)data;
        if (__atomic_sub_fetch(&p->word, 1, __ATOMIC_ACQ_REL) == RZ_ORPHAN) free(p);
    }
    static int rz_pin_held(rz_pin_t *p) {
        return __atomic_load_n(&p->word, __ATOMIC_ACQUIRE) & (RZ_ORPHAN - 1);
    }
    static void rz_pin_add(rz_pin_t *p) { __atomic_add_fetch(&p->word, 1, __ATOMIC_ACQ_REL); }
    static void rz_pin_orphan(rz_pin_t *p) {
        if (__atomic_add_fetch(&p->word, RZ_ORPHAN, __ATOMIC_ACQ_REL) == RZ_ORPHAN) free(p);
    }

    static int rz_init(rz_msg_t *m) { return rz_p_init(m); }
    static int rz_init_size(rz_msg_t *m, size_t n) { return rz_p_init_size(m, n); }
    static int rz_init_pinned(rz_msg_t *m, void *d, size_t n, rz_pin_t *p) {
        return rz_p_init_data(m, d, n, rz_release, p);
    }
    static int rz_send(rz_msg_t *m, void *s, int f) { return rz_p_send(m, s, f); }
    static int rz_recv(rz_msg_t *m, void *s, int f) { return rz_p_recv(m, s, f); }
    static int rz_close(rz_msg_t *m) { return rz_p_close(m); }
    static void *rz_data(rz_msg_t *m) { return rz_p_data(m); }
    static size_t rz_size(rz_msg_t *m) { return rz_p_size(m); }
    static int rz_more(rz_msg_t *m) { return rz_p_more(m); }
    static int rz_errno(void) { return rz_p_errno(); }
    /* the header's keys, in the order HotHeader's parser numbers them */
    static const char *rz_keys[8] = {"v", "k", "s", "q", "ts", "inc", "p", "x"};
    static const Py_ssize_t rz_key_len[8] = {1, 1, 1, 1, 2, 3, 1, 1};
    /* the keys of x in the hot shape, by their X_* index */
    static const char *rz_xkeys[4] = {"wait", "sigma", "parts", "offset"};
    static const Py_ssize_t rz_xkey_len[4] = {4, 5, 5, 6};
    """
    ctypedef struct rz_msg_t:
        pass
    ctypedef struct rz_pin_t:
        int word
    int rz_bound
    int RZ_ORPHAN
    int EAGAIN
    int EINTR
    void rz_bind(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                 uintptr_t, uintptr_t, uintptr_t)
    int rz_pin_held(rz_pin_t *) nogil
    void rz_pin_add(rz_pin_t *) nogil
    void rz_pin_orphan(rz_pin_t *) nogil
    int rz_init(rz_msg_t *) nogil
    int rz_init_size(rz_msg_t *, size_t) nogil
    int rz_init_pinned(rz_msg_t *, void *, size_t, rz_pin_t *) nogil
    int rz_send(rz_msg_t *, void *, int) nogil
    int rz_recv(rz_msg_t *, void *, int) nogil
    int rz_close(rz_msg_t *) nogil
    void *rz_data(rz_msg_t *) nogil
    size_t rz_size(rz_msg_t *) nogil
    int rz_more(rz_msg_t *) nogil
    int rz_errno() nogil
    const char *rz_keys[8]
    const Py_ssize_t rz_key_len[8]
    const char *rz_xkeys[4]
    const Py_ssize_t rz_xkey_len[4]

DEF ZMQ_DONTWAIT = 1
DEF ZMQ_SNDMORE = 2
DEF MAX_SEND_FRAMES = 4104      # wire.MAX_PARTS payload frames + header + routing id, rounded

# Frames smaller than this are copied into the message: pinning costs more than a copy of a
# header (pyzmq's zmq.COPY_THRESHOLD is the same 64 KiB).
COPY_THRESHOLD = 65536

LIBZMQ_FUNCTIONS = ("zmq_msg_init", "zmq_msg_init_size", "zmq_msg_init_data", "zmq_msg_send",
                    "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data", "zmq_msg_size",
                    "zmq_msg_more", "zmq_errno")


def bind_libzmq(dict addresses):
    """Use the libzmq functions at ``addresses`` (name -> address, LIBZMQ_FUNCTIONS). Call once
    at import, before any send or recv; not thread-safe."""
    missing = [n for n in LIBZMQ_FUNCTIONS if not addresses.get(n)]
    if missing:
        raise ValueError(f"libzmq functions without an address: {missing}")
    a = [<uintptr_t>addresses[n] for n in LIBZMQ_FUNCTIONS]
    rz_bind(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9])


cdef inline void _check_bound() except *:
    if not rz_bound:
        raise RuntimeError("rudra_zmq._fastio: bind_libzmq() was not called (import "
                           "rudra_zmq.fastio, which does it)")


cdef object _zmq_error(int err):
    return Again(err) if err == EAGAIN else ZMQError(err)


cdef class Frame:
    """One received ZeroMQ frame. Owns its message until garbage-collected; the buffer
    protocol exposes the bytes read-only without copying (``np.frombuffer(frame, ...)``
    keeps the frame alive). Thread-safe to read."""

    cdef rz_msg_t msg
    cdef bint live

    def __dealloc__(self):
        if self.live:
            rz_close(&self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, rz_data(&self.msg), rz_size(&self.msg), 1, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __len__(self):
        return rz_size(&self.msg)

    @property
    def bytes(self) -> bytes:
        """A copy of the frame's bytes."""
        return PyBytes_FromStringAndSize(<char *>rz_data(&self.msg), rz_size(&self.msg))

    @property
    def buffer(self) -> memoryview:
        """A read-only memoryview of the frame (no copy)."""
        return memoryview(self)


def recv(uintptr_t sock, int flags=0):
    """Receive one whole multipart message from the libzmq socket at ``sock`` (pyzmq's
    ``Socket.underlying``); returns its frames as a list of :class:`Frame`.

    Blocks (GIL released) until a message arrives or the socket's RCVTIMEO passes, unless
    ``flags`` has ZMQ_DONTWAIT; raises ``zmq.Again`` when none came, ``zmq.ZMQError``
    otherwise. A signal interrupts the wait: its Python handler runs (and may raise) before the
    wait resumes. Not thread-safe: only the socket's owning thread may call it."""
    cdef void *s = <void *>sock
    cdef Frame f
    cdef int rc, err, more = 1, fl = flags
    _check_bound()
    frames = []
    while more:
        f = Frame.__new__(Frame)
        rz_init(&f.msg)
        f.live = True
        while True:
            with nogil:
                rc = rz_recv(&f.msg, s, fl)
                err = rz_errno() if rc < 0 else 0
            if rc >= 0:
                break
            if err == EINTR:
                PyErr_CheckSignals()
                continue
            if frames:   # libzmq delivers a multipart message whole: this is not expected
                raise ZMQError(err, f"a multipart message broke off after {len(frames)} frames")
            raise _zmq_error(err)
        frames.append(f)
        more = rz_more(&f.msg)
        fl = 0   # the rest of a multipart message is already here
    return frames


cdef class Pin:
    """The buffers of one message's zero-copy frames, held until libzmq released them all.

    ``done`` turns true once every frame was released (sent, or dropped with its socket). Keep
    the pin until then: dropping it earlier would let the buffers be freed while ZeroMQ's I/O
    thread still reads them (rudra_zmq.fastio keeps pins for their senders)."""

    cdef rz_pin_t *shared
    cdef Py_buffer *views
    cdef int count

    def __cinit__(self, int capacity):
        self.shared = <rz_pin_t *>calloc(1, sizeof(rz_pin_t))
        self.views = <Py_buffer *>calloc(max(capacity, 1), sizeof(Py_buffer))
        if self.shared == NULL or self.views == NULL:
            raise MemoryError()

    @property
    def done(self) -> bool:
        """Whether libzmq has released every frame of the message (thread-safe)."""
        return rz_pin_held(self.shared) == 0

    def __dealloc__(self):
        cdef int i
        if self.shared != NULL and rz_pin_held(self.shared) == 0:
            for i in range(self.count):
                PyBuffer_Release(&self.views[i])
            free(self.views)
        # else: libzmq still reads the buffers; leaking them is the only safe choice
        if self.shared != NULL:
            rz_pin_orphan(self.shared)


def send(uintptr_t sock, list frames, int flags=0):
    """Send ``frames`` (objects with the buffer protocol: bytes, contiguous arrays...) as one
    multipart message on the libzmq socket at ``sock``.

    Frames of at least COPY_THRESHOLD bytes go zero-copy: do not modify them until the peer
    has them. Returns a :class:`Pin` that must be kept until ``pin.done`` (None if every frame
    was copied). Blocks (GIL released) while the socket's queue is full, unless ``flags`` has
    ZMQ_DONTWAIT; raises ``zmq.Again`` or ``zmq.ZMQError`` (e.g. EHOSTUNREACH from a ROUTER
    with ROUTER_MANDATORY) if the message could not be queued: then nothing was sent. Not
    thread-safe: only the socket's owning thread may call it."""
    cdef void *s = <void *>sock
    cdef Py_ssize_t n = len(frames), i = 0, built = 0
    cdef Pin pin = None
    cdef Py_buffer view
    cdef rz_msg_t *msgs
    cdef int rc = 0, err = 0, fl
    _check_bound()
    if n < 1 or n > MAX_SEND_FRAMES:
        raise ValueError(f"a message has 1..{MAX_SEND_FRAMES} frames, got {n}")
    msgs = <rz_msg_t *>malloc(n * sizeof(rz_msg_t))
    if msgs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            PyObject_GetBuffer(frames[i], &view, PyBUF_ANY_CONTIGUOUS)
            if view.len < COPY_THRESHOLD:
                rc = rz_init_size(&msgs[i], view.len)
                if rc == 0:
                    memcpy(rz_data(&msgs[i]), view.buf, view.len)
                PyBuffer_Release(&view)
                if rc != 0:
                    raise MemoryError()
            else:
                if pin is None:
                    pin = Pin(n)
                pin.views[pin.count] = view        # released once the pin is done
                pin.count += 1
                rz_pin_add(pin.shared)
                rz_init_pinned(&msgs[i], view.buf, view.len, pin.shared)
            built = i + 1
        i = 0
        while i < n:
            fl = (flags | ZMQ_SNDMORE) if i < n - 1 else flags
            with nogil:
                rc = rz_send(&msgs[i], s, fl)
                err = rz_errno() if rc < 0 else 0
            if rc < 0:
                if err == EINTR:    # a signal while blocked on a full queue: run its handler
                    PyErr_CheckSignals()
                    continue
                # ROUTER/DEALER refuse a message at its first frame, so nothing was queued
                raise _zmq_error(err)
            i += 1
        return pin
    finally:
        # A sent message is left empty by libzmq (closing it is a no-op); closing one not
        # taken releases its pinned buffer.
        for i in range(built):
            rz_close(&msgs[i])
        free(msgs)


# ------------------------------------------------------------------ hot header parsing
# wire.decode validates every message in Python (msgpack.unpackb, then a dozen checks): ~8 µs
# warm and several times that with the caches the I/O threads leave behind. The two messages
# of every training step -- a learner's PUSHPULL and the PS's WEIGHTS reply -- have one fixed
# shape, so ``decode_hot`` recognises exactly that shape in C and says None to anything else,
# which wire.decode then handles (and refuses) as before. What it accepts, wire.decode
# accepts with the same result (tests/test_fastio.py compares the two on mutated headers).

DEF MAX_HOT_FRAMES = 64        # payload frames of a hot message (8 MiB chunks: a 512 MiB model)
DEF KIND_PUSHPULL = 6          # wire.Kind values (wire.py checks them against HOT_KINDS)
DEF KIND_WEIGHTS = 7
DEF KIND_WPART = 19
HOT_KINDS = {"PUSHPULL": KIND_PUSHPULL, "WEIGHTS": KIND_WEIGHTS, "WPART": KIND_WPART}
DEF MAX_PARTS = 4096           # wire.MAX_PARTS (checked by wire.py)
HOT_MAX_PARTS = MAX_PARTS
HOT_MAX_FRAMES = MAX_HOT_FRAMES
DEF X_WAIT = 0
DEF X_SIGMA = 1
DEF X_PARTS = 2
DEF X_OFFSET = 3

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
    o += _put_int(o, 1)
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


# ------------------------------------------------------------------ the PS's hot request
# In steady state with c = 1 (async, or n-softsync with n = λ) every PUSHPULL is a whole
# update: check, step, answer with the new weights. HotPS does that one request in C, with the
# update's learning rate *predicted* by the parameter server before the request arrives
# (``arm``: the base rate of the next gradient's epoch, the policy, the timestamp, the
# buffers), so that the reply leaves before any Python runs. The sync engine then accounts the
# gradient as usual (roles/ps.py) and must arrive at the same update -- the server checks that
# it did. Any other message, or any doubt, is handed back to Python untouched.

ctypedef void (*momentum_fn)(float *, const float *, float *, const float *, const float *,
                             Py_ssize_t, double, double, double, double) noexcept nogil
cdef momentum_fn _momentum = NULL

POLICY_CONSTANT, POLICY_STALENESS, POLICY_PER_GRADIENT = 0, 1, 2


def bind_kernels(dict addresses):
    """Use the update kernel at ``addresses["momentum_f32"]`` (``_kernels.c_api()``). Call once
    at import; not thread-safe."""
    global _momentum
    _momentum = <momentum_fn><uintptr_t>addresses["momentum_f32"]


cdef float *_f32_ptr(object arr, bint writable, Py_ssize_t numel) except NULL:
    """The data of a 1-D C-contiguous float32 ndarray of ``numel`` elements (checked)."""
    cdef Py_buffer view
    cdef float *p
    if type(arr) is not ndarray or arr.dtype.char != "f" or arr.ndim != 1 \
            or not arr.flags.c_contiguous or arr.shape[0] != numel \
            or (writable and not arr.flags.writeable):
        raise ValueError(f"expected a {'writable ' if writable else ''}1-D contiguous float32 "
                         f"array of {numel} elements, got {type(arr).__name__} "
                         f"{getattr(arr, 'dtype', '?')} {getattr(arr, 'shape', '?')}")
    PyObject_GetBuffer(arr, &view, PyBUF_ANY_CONTIGUOUS)
    p = <float *>view.buf
    PyBuffer_Release(&view)   # the caller keeps a reference to arr for as long as it uses p
    return p


cdef class HotPS:
    """The parameter server's ROUTER socket with its hot request compiled (see above).

    ``serve()`` receives one message; if the server armed it and the message is a PUSHPULL
    that the server would answer with one whole update -- a registered learner on its own
    connection, the server's incarnation, 0 <= ts <= timestamp, float32 payloads adding up to
    the model -- it applies the update (w -> out, v in place, the kernel's GIL-free pass) and
    sends the WEIGHTS reply (out zero-copy, kept in ``pins``). Not thread-safe: the server's
    thread owns it.
    """

    cdef uintptr_t sock
    cdef long long numel, learners, inc
    cdef list idents
    cdef double momentum, weight_decay
    cdef Py_ssize_t nseg
    cdef long long[:] seg_start
    cdef long long[:] seg_stop
    cdef double[:] seg_lr
    cdef double[:] seg_decay
    # armed for the next request
    cdef bint armed
    cdef double base_lr
    cdef int policy
    cdef long long timestamp, seq, part_floats
    cdef object w, v, out
    cdef float *wp
    cdef float *vp
    cdef float *outp
    # the last request served hot
    cdef readonly long long sender, grad_ts, sigma, new_ts, reply_seq
    cdef readonly double lr, g_scale
    cdef readonly int send_errno, send_failures
    cdef readonly object pins

    def __init__(self, sock, long long numel, long long learners, long long inc, segments,
                 double momentum, double weight_decay, pins):
        if _momentum == NULL:
            raise RuntimeError("rudra_zmq._fastio: bind_kernels() was not called")
        self.sock = sock.underlying
        self.numel, self.learners, self.inc = numel, learners, inc
        self.idents = [None] * learners
        self.momentum, self.weight_decay = momentum, weight_decay
        seg = [(int(a), int(b), float(lm), float(dm)) for a, b, lm, dm in segments]
        import numpy as np
        self.seg_start = np.array([x[0] for x in seg], np.int64)
        self.seg_stop = np.array([x[1] for x in seg], np.int64)
        self.seg_lr = np.array([x[2] for x in seg], np.float64)
        self.seg_decay = np.array([x[3] for x in seg], np.float64)
        self.nseg = len(seg)
        self.pins = pins
        self.armed = False

    def set_ident(self, long long learner, bytes ident):
        """Learner ``learner`` said HELLO from routing id ``ident``."""
        if 0 <= learner < self.learners:
            self.idents[learner] = ident

    def arm(self, double base_lr, int policy, long long timestamp, long long seq, w, v, out,
            long long part_floats):
        """Serve the next PUSHPULL hot: an update at ``base_lr`` (the rate of the epoch that
        gradient completes, before the staleness policy ``policy``), from version
        ``timestamp`` in ``w`` to ``out`` (momentum ``v`` in place), the reply numbered from
        ``seq``: one WEIGHTS frame, or with ``part_floats`` < the model size streamed as the
        PS streams it (WPART x{offset} per part as soon as the kernel finished it, then WEIGHTS
        x{parts, sigma}). The arrays stay referenced until the request or ``disarm``."""
        if part_floats < 1 or (self.numel + part_floats - 1) // part_floats - 1 > MAX_PARTS:
            raise ValueError(f"part_floats {part_floats} makes more than {MAX_PARTS + 1} parts "
                             f"of {self.numel} floats")
        self.part_floats = part_floats
        self.wp = _f32_ptr(w, False, self.numel)
        self.vp = _f32_ptr(v, True, self.numel)
        self.outp = _f32_ptr(out, True, self.numel)
        self.w, self.v, self.out = w, v, out
        self.base_lr, self.policy, self.timestamp, self.seq = base_lr, policy, timestamp, seq
        self.armed = True

    def disarm(self):
        """Serve nothing hot; returns the ``out`` buffer that ``arm`` was given (or None)."""
        out = self.out
        self.armed = False
        self.w = self.v = self.out = None
        return out

    @property
    def is_armed(self) -> bool:
        return self.armed

    def serve(self):
        """Receive one message (blocks, GIL released, up to the socket's RCVTIMEO; raises
        zmq.Again then). Returns None if it was served hot (results in the attributes; the
        arrays given to ``arm`` are released and ``out`` holds the new weights), else the
        message's frames for the general path."""
        frames = recv(self.sock, 0)
        if not self.armed or len(frames) < 3:
            return frames
        hot = decode_hot(frames[1:], self.numel)
        if hot is None:
            return frames
        version, kind, s, q, ts, inc, fields = hot
        if version != 1 or kind != KIND_PUSHPULL or not 0 <= s < self.learners:
            return frames
        ident = self.idents[s]
        if ident is None or frames[0].bytes != ident:
            return frames
        if (inc != 0 and inc != self.inc) or ts < 0 or ts > self.timestamp:
            return frames
        self._step(frames, s, ts)
        self.sender, self.grad_ts = s, ts
        return None

    cdef _step(self, list frames, long long s, long long ts):
        cdef long long sigma = self.timestamp - ts
        cdef double clipped = <double>(sigma if sigma > 1 else 1)
        cdef double lr = self.base_lr, g_scale = 1.0
        cdef Py_ssize_t i, j, nf = len(frames) - 2, a, b, lo, hi, a0, b0
        cdef Py_ssize_t n = self.numel, step = self.part_floats
        cdef Py_ssize_t nparts = (n + step - 1) // step, k = 0
        cdef Py_buffer views[MAX_HOT_FRAMES]
        cdef Py_ssize_t offs[MAX_HOT_FRAMES + 1]
        if self.policy == POLICY_STALENESS:
            lr = lr / clipped           # the engine: lr /= max(⟨σ⟩, 1), ⟨σ⟩ = σ / 1
        elif self.policy == POLICY_PER_GRADIENT:
            g_scale = 1.0 / clipped     # the engine's per-gradient scale, times g_scale 1/1
        self.sigma, self.lr, self.g_scale = sigma, lr, g_scale
        self.new_ts = self.timestamp + 1
        self.send_errno = self.send_failures = 0
        out = self.out
        offs[0] = 0
        for i in range(nf):      # the gradient's frames (decode_hot checked them), held
            PyObject_GetBuffer(frames[2 + i], &views[i], PyBUF_ANY_CONTIGUOUS)
            offs[i + 1] = offs[i] + views[i].len // 4
        try:
            for k in range(nparts):   # a part of the new weights, then its reply message
                lo = k * step
                hi = min(lo + step, n)
                with nogil:
                    for i in range(nf):              # each gradient frame in the part...
                        a0 = max(lo, offs[i])
                        b0 = min(hi, offs[i + 1])
                        for j in range(self.nseg):   # ...and each parameter segment in that
                            a = max(self.seg_start[j], a0)
                            b = min(self.seg_stop[j], b0)
                            if a < b:
                                _momentum(self.outp + a, self.wp + a, self.vp + a,
                                          self.vp + a, <const float *>views[i].buf +
                                          (a - offs[i]), b - a, lr * self.seg_lr[j],
                                          self.momentum, self.weight_decay * self.seg_decay[j],
                                          g_scale)
                if nparts == 1:
                    self._reply(frames[0], KIND_WEIGHTS, out, {"sigma": sigma})
                elif k < nparts - 1:
                    self._reply(frames[0], KIND_WPART, out[lo:hi], {"offset": lo})
                else:
                    self._reply(frames[0], KIND_WEIGHTS, out[lo:hi],
                                {"parts": nparts - 1, "sigma": sigma})
        finally:
            for i in range(nf):
                PyBuffer_Release(&views[i])
            self.armed = False
            self.w = self.v = self.out = None
        self.reply_seq = self.seq - 1

    cdef _reply(self, ident, int kind, part, dict fields):
        """Send one reply message (zero-copy ``part``), numbered ``seq``; a send libzmq
        refuses (the learner gone: ROUTER_MANDATORY, or its queue full) is counted, as the
        general path counts it."""
        header = encode_hot(kind, -1, self.seq, self.new_ts, self.inc, [part], fields)
        self.seq += 1
        try:
            pin = send(self.sock, [ident, header, part], ZMQ_DONTWAIT)
        except ZMQError as exc:
            self.send_errno = exc.errno
            self.send_failures += 1
        else:
            if pin is not None:
                self.pins.append(pin)


# ------------------------------------------------------------------ a learner's hot request
def pushpull_hot(uintptr_t sock, sender, seq, ts, inc, bint wait, list pieces,
                 long long numel):
    """A learner's PUSHPULL of a whole gradient in float32 frames ``pieces`` (its chunks, at
    most 64) and the wait for its reply, in one call: encode (as wire.encode), send (the
    pieces zero-copy), receive
    (blocks up to the socket's RCVTIMEO, GIL released) and recognise the reply: a WEIGHTS of
    ``numel`` floats, or a streamed one (WPART x{offset}... then WEIGHTS x{parts}) whose
    sequence is whole (one ts, contiguous offsets from 0, the declared count, ``numel`` in
    all; as wire.assemble checks it). Returns None without sending if the request is not of
    the hot shape, else (pin, messages, reply): ``pin`` to keep until done (or None), the
    frames of every message received (none if RCVTIMEO passed first: wait on), and for a
    recognised reply (sender, seq, ts, inc, fields of the WEIGHTS, payload frames in order),
    else None (decode the messages the general way). Raises zmq.ZMQError if the send fails.
    Not thread-safe."""
    header = encode_hot(KIND_PUSHPULL, sender, seq, ts, inc, pieces, {"wait": bool(wait)})
    if header is None:
        return None
    pin = send(sock, [header, *pieces], 0)
    messages = []
    payloads = []
    cdef long long total = 0, parts = 0, first_ts = 0
    while True:
        try:
            frames = recv(sock, 0)
        except Again:
            return pin, messages, None
        messages.append(frames)
        hot = decode_hot(frames, -1)
        if hot is None or hot[0] != 1 or (parts and hot[4] != first_ts):
            return pin, messages, None
        if not parts:
            first_ts = hot[4]
        if hot[1] == KIND_WPART:
            if hot[6]["offset"] != total or parts >= MAX_PARTS:
                return pin, messages, None
            parts += 1
            total += len(frames[1]) // 4
            payloads.append(frames[1])
            continue
        if hot[1] != KIND_WEIGHTS or hot[6].get("parts", 0) != parts:
            return pin, messages, None
        for f in frames[1:]:
            total += len(f) // 4
            payloads.append(f)
        if numel >= 0 and total != numel:
            return pin, messages, None
        return pin, messages, (hot[2], hot[3], hot[4], hot[5], hot[6], payloads)
