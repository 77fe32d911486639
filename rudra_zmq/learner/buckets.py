"""Gradients that leave during backward: each part of the flat gradient is pushed the moment
the backward pass has finished it, as PyTorch DDP's reducer launches a bucket's allreduce.

The parts are the servers' (the cluster's shape, ``shape.ClusterShape``: the vector cut in
K x ``wire.parts`` parts of at most ``wire.bucket_mb``, ``shape.parts_in``, part j to server j
mod K; with ``wire.parts`` 1 a server's whole range is one). A hook on every parameter (``register_post_accumulate_grad_hook``) counts
down the parameters each part overlaps; a part whose count reaches 0 is sent at once, from
inside ``loss.backward()``, on the learner's own thread and sockets. Backward produces the
last layers' gradients first; with the parts striped over the servers, the first ones ready
go to every server (with ranges, the last server's parts left first and server 0 waited), and
every server's part 0 last; the part a request marks last (no x{more}) is held until its server's other
parts are out. What backward did not reach (a parameter without a gradient this pass, whose
slice stays zero) goes after it.

Exactness: the bytes pushed are the finished gradient's, as after backward (a part is sent
only once every parameter it overlaps is accumulated: autograd accumulates each parameter
once per pass, weights shared between layers included); the server sums the same parts. A
second backward pass in one step would add to parts already sent: it raises, naming the
parameter. On a half wire (``wire.gradient_dtype`` float16 or bfloat16) each part is narrowed
the moment it is ready, with its own slice of the error-feedback residual
(``Frames.share_parts_later``), into the bits that narrowing the finished range at once gives
after backward: the narrowing kernels work element by element.

On CPU only: on a GPU the gradient reaches the host in one transfer after backward, and a
send buffer (advstar) or shared-memory slots copy the gradient when the request is made; all
of them push after backward as before (``enabled``). So does a run with one part in all (one
server, ``wire.parts`` 1): nothing to send early.

Not thread-safe: the learner thread that runs backward owns it and the channels.
"""

from __future__ import annotations

import functools

from ..wire import Kind


def enabled(flat, carriers) -> bool:
    """Whether parts can leave during backward: a real model on CPU (not staged) and
    payload frames that can be made before backward and filled part by part
    (``Frames.streams``: float32 views or a half codec, no send buffer; not shared-memory
    slots). Pure."""
    return (
        getattr(flat, "module", None) is not None
        and not flat.staged
        and all(getattr(c, "streams", False) for c in carriers)
    )


class BackwardParts:
    """Which parts of ``flat``'s gradient the running backward pass has finished.

    ``cuts``: the parts as (lo, hi) flat offsets, disjoint. ``on_ready(j)`` is called from
    the backward pass once every parameter overlapping part ``j`` has its gradient, between
    ``arm()`` and ``disarm()``.
    """

    def __init__(self, flat, cuts, on_ready):
        self.on_ready = on_ready
        params = dict(flat.module.named_parameters())
        self._of: dict[str, list[int]] = {}  # parameter -> the parts it overlaps, last first
        self._needs = [0] * len(cuts)
        for name, a, b, _shape in flat.layout:
            js = [j for j, (lo, hi) in enumerate(cuts) if lo < b and a < hi]
            js.sort(key=lambda j: -cuts[j][0])
            self._of[name] = js
            for j in js:
                self._needs[j] += 1
        self._left: list[int] = []
        self._seen: set[str] = set()
        self.armed = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in params.items()
        ]

    def _hook(self, name: str):
        def done(_p) -> None:
            if not self.armed:
                return
            if name in self._seen:
                raise RuntimeError(
                    f"parameter {name!r} accumulated its gradient twice in one step (two "
                    "backward passes?): its part was pushed after the first; a step runs "
                    "one backward pass"
                )
            self._seen.add(name)
            for j in self._of[name]:
                self._left[j] -= 1
                if self._left[j] == 0:
                    self.on_ready(j)

        return done

    def arm(self) -> None:
        """A backward pass begins: nothing finished yet."""
        self._left, self._seen, self.armed = list(self._needs), set(), True

    def disarm(self) -> list[int]:
        """The backward pass ended: the parts it did not finish (parameters it gave no
        gradient), last first."""
        self.armed = False
        return [j for j in reversed(range(len(self._left))) if self._left[j] > 0]

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


class StreamedPush:
    """The sharded exchange's push during backward: each server's parts (or its whole
    slice) sent as ``BackwardParts`` reports them finished. Not thread-safe."""

    def __init__(self, flat, servers):
        """``servers``: the cluster shape's (``shape.Server``: each its range's parts)."""
        self.flat = flat
        self.owner: list[tuple[int, int]] = []  # global part -> (server, part)
        cuts = []
        for server in servers:
            for i, part in enumerate(server.parts):
                self.owner.append((server.index, i))
                cuts.append((part.lo, part.hi))
        self.parts = BackwardParts(flat, cuts, self._ready)
        self.during = self.after = 0  # messages sent inside backward, and after it
        self._in_backward = False

    def push(self, backward, requests: dict[int, list]) -> None:
        """Run ``backward()`` and send each server's request as backward finishes its parts.
        ``requests``: server -> its messages' send calls in part order, the first one (part 0,
        no x{more}) to go last. Blocks for backward; sends never wait for a reply."""
        self._todo = {k: dict(enumerate(calls)) for k, calls in requests.items()}
        self._held: set[int] = set()  # servers whose part 0 is ready but waits for the rest
        self.parts.arm()
        self._in_backward = True
        try:
            backward()
        finally:
            self._in_backward = False
            left = self.parts.disarm()
        for j in left:
            self._ready(j)
        for k in list(self._todo):  # anything still held (nothing else was ready)
            for i in sorted(self._todo[k], reverse=True):
                self._send(self._todo[k].pop(i))
        self._todo = {}

    def _send(self, call) -> None:
        call()
        if self._in_backward:
            self.during += 1
        else:
            self.after += 1

    def _ready(self, j: int) -> None:
        k, i = self.owner[j]
        todo = self._todo.get(k)
        if todo is None or i not in todo:
            return  # a server that finished training, or sent already
        if i == 0 and len(todo) > 1:
            self._held.add(k)
            return
        self._send(todo.pop(i))
        if k in self._held and len(todo) == 1:
            self._held.discard(k)
            self._send(todo.pop(0))

    def close(self) -> None:
        """Remove the hooks."""
        self.parts.close()


def request_calls(ch, ts: int, carrier, grads, server, weights) -> list:
    """One server's request as send calls in part order (part 0 to go last): PUSHPULL in
    parts (``Channel.parts``), or whole when its share is one part. ``grads``: the model's
    whole flat gradient; ``server``: the shape's (``shape.Server``, its parts); ``weights``:
    where its reply's weights are loaded. Each call encodes its part from ``grads`` as it is
    when the call runs (``Frames.share_parts_later``: float32 views, or a half codec's
    narrowing of that part), then sends it. Does not block."""
    if len(server.parts) > 1:
        parts = carrier.share_parts_later(grads, server)
        msgs = ch.parts(Kind.PUSHPULL, ts, [(at, f) for at, f, _ in parts], weights, last=0)

        def send(msg, fill) -> None:
            fill()
            ch.send_part(msg)

        return [functools.partial(send, m, fill) for m, (_, _, fill) in zip(msgs, parts)]

    def whole() -> None:
        payloads, fields = carrier.gradient(server.share.gather(grads))
        ch.send(Kind.PUSHPULL, ts, payloads, **fields)

    return [whole]
