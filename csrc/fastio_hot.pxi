# Included by _fastio.pyx (one extension module): the PS's hot request (HotPS) and a
# learner's (pushpull_hot).
# Uses the declarations and DEF constants of _fastio.pyx.

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
        if version != PROTOCOL_VERSION or kind != KIND_PUSHPULL or not 0 <= s < self.learners:
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
    pieces zero-copy), receive (blocks up to the socket's RCVTIMEO, GIL released) and
    recognise the reply: a WEIGHTS of
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
        if hot is None or hot[0] != PROTOCOL_VERSION or (parts and hot[4] != first_ts):
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
