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


# The hot messages (shared by the files below)
DEF PROTOCOL_VERSION = 1       # wire.PROTOCOL_VERSION (wire.py checks it against HOT_VERSION)
HOT_VERSION = PROTOCOL_VERSION
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

# The rest of the module, one concern per file (Cython includes share this module's scope):
include "fastio_decode.pxi"     # the C front of wire.decode: the hot shape, recognised
include "fastio_encode.pxi"     # the C front of wire.encode: the same bytes as msgpack
include "fastio_hot.pxi"        # HotPS (the PS's c = 1 PUSHPULL) and pushpull_hot (a learner's)
