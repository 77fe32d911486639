"""Weights that arrive before forward needs them (``wire.priority``; P3's priority-based
parameter propagation, ByteScheduler's scheduling: the idea, not their code).

Backward finishes the first layers' gradients last, and the next forward needs their weights
first. With parts (``wire.parts``) pushed during backward (``buckets.py``):

- :class:`PriorityPush` holds the parts backward finished in an app-level queue per server
  and hands libzmq at most ``depth`` of them per connection at a time (tracked: a part
  counts until libzmq has taken it whole, i.e. written it to the kernel's socket buffer),
  the lowest offset first. ZeroMQ's queues are FIFO; a part only queued here can still be
  overtaken, so the first layers' parts, finished last, go out ahead of the later layers'
  parts backward finished earlier and the link had no time for yet. Which part of a request
  goes last (the one without x{more}) is picked when it is sent (``Channel.send_final``).
  The servers then complete their parts in layer order too, and answer each as it completes
  (``server/parts.py``, lowest first when several complete at once): the replies come back
  in layer order.
- :class:`EarlyWeights` lets the next forward run a layer as soon as its weights are in: a
  forward pre-hook on every module with parameters of its own waits until the parts
  covering them have come (each part of a reply is loaded as it comes: ``Channel.on_part``;
  a striped server's part is put in its place in the model at once), and a forward hook on
  the root settles the whole reply (every server's, STOP and rejoin included) before the
  loss and backward. The gradient buffer is zeroed after forward (``Learner._compute``):
  the previous step's parts may be in flight until the replies are in.

Hardsync stays exact: a layer runs on the very weights the whole reply would have given it
(the version every part of it belongs to); the pushes are the same bytes in another order,
summed per part by the server. The one requirement: a module reads only its own parameters
(and its children's, each waited for by its own hook); a module that reads another module's
parameter without calling it (weights tied by hand) must run with ``wire.priority=false``.
Parts need hardsync (``wire.parts``), so softsync keeps whole-vector waiting.

On CPU only, where parts can leave during backward (``buckets.enabled``: float32 views, or a
half codec narrowing each part as it goes). Not thread-safe: the learner thread
owns both, its channels and its model.
"""

from __future__ import annotations

import heapq

from .. import timeline

WAIT_MS = 50  # the longest one poll for the replies waits (1 ms while parts wait to go)
DEPTH = 2  # parts per connection in libzmq's hands at once: the link never waits on us,
#            and a first layer's part finds at most this many ahead of it on each connection


class PriorityPush:
    """One request per server at a time, its parts sent lowest offset first, at most
    ``depth`` per connection in libzmq's queue. Not thread-safe.

    ``channels``: one ``Channel`` per server; ``sizes``: each server's parts; ``request(k)``:
    server ``k``'s messages (``Channel.parts`` with ``last=-1``) and each part's ``fill()``
    (``Frames.share_parts_later``: nothing for float32 views, a half codec narrows that part
    into its frames), made when its first part goes (the stamp is then the step's); a part
    is filled just before it is handed to libzmq, once backward has finished it.
    """

    def __init__(self, channels, sizes, request, depth: int = DEPTH):
        self.channels, self.sizes, self.request, self.depth = channels, sizes, request, depth
        self._queue: dict[int, list[int]] = {}  # server -> heap of its parts ready, not sent
        self._left: dict[int, int] = {}  # server -> its parts backward has not finished
        self._msgs: dict[int, list] = {}  # server -> the request's messages, once made
        self._fills: dict[int, list] = {}  # server -> each part's fill(), once made
        self._flying: dict[int, list] = {}  # server -> trackers of parts libzmq still holds

    def begin(self, servers) -> None:
        """A new request to each of ``servers``: nothing ready yet. The previous one's parts
        must all be sent (its replies are in)."""
        self._queue = {k: [] for k in servers}
        self._left = {k: self.sizes[k] for k in servers}
        self._msgs, self._fills, self._flying = {}, {}, {k: [] for k in servers}

    def calls(self) -> dict[int, list]:
        """Each server's send calls for ``buckets.StreamedPush``, in part order: each marks
        its part ready and sends what the queues allow. Does not block."""
        return {
            k: [lambda k=k, i=i: self.ready(k, i) for i in range(self.sizes[k])]
            for k in self._queue
        }

    def ready(self, k: int, i: int) -> None:
        """Backward finished part ``i`` of server ``k``: queue it, then ``pump``. A server
        the request no longer goes to (it said STOP in the replies this step's forward
        settled, after ``calls``) is sent nothing."""
        if k not in self._queue:
            return
        heapq.heappush(self._queue[k], i)
        self._left[k] -= 1
        self.pump()

    def pump(self) -> bool:
        """Send what each connection has room for, lowest part first; the request's last
        part (all the others sent) without x{more}. Whether parts are still queued. Never
        blocks (the channels' queues hold a request's parts)."""
        waiting = False
        for k, queue in self._queue.items():
            flying = self._flying[k] = [t for t in self._flying[k] if not t.done]
            while queue and len(flying) < self.depth:
                i = heapq.heappop(queue)
                if k not in self._msgs:
                    self._msgs[k], self._fills[k] = self.request(k)
                self._fills[k][i]()
                ch = self.channels[k]
                if not queue and self._left[k] == 0:
                    flying.append(ch.send_final(i, track=True))
                else:
                    flying.append(ch.send_part(self._msgs[k][i], track=True))
            waiting = waiting or bool(queue)
        return waiting

    def drop(self) -> None:
        """The step was abandoned before backward (STOP, rejoin): forget its request."""
        self.begin([])


class EarlyWeights:
    """Forward pre-hooks that wait for each module's parts of the outstanding reply, and
    a forward hook on the root that settles the reply. Not thread-safe.

    ``poll()``: take what came of the replies (waits a little; the exchange's);
    ``settle()``: take the rest of them and load every range, or raise to abandon the step.
    """

    def __init__(self, flat, shape, poll, settle):
        self.flat, self.poll, self.settle = flat, poll, settle
        self.parts = shape.parts  # every part of the vector, by offset (Part.index)
        self.loaded = [True] * len(self.parts)  # nothing outstanding: every part is in
        self._of_server = {s.index: s.parts for s in shape.servers}
        self.ran_ahead = 0  # modules whose forward ran while some reply was still coming
        self.waited = 0  # modules whose forward waited for their parts
        self._handles = []
        spans = {name: (a, b) for name, a, b, _shape in flat.layout}
        names = {id(p): n for n, p in flat.module.named_parameters()}
        for module in flat.module.modules():
            own = [names[id(p)] for p in module.parameters(recurse=False) if id(p) in names]
            needs = sorted({p.index for n in own for p in shape.covering(*spans[n])})
            if needs:
                self._handles.append(
                    module.register_forward_pre_hook(lambda _m, _a, n=needs: self.wait(n))
                )
        self._handles.append(flat.module.register_forward_hook(lambda *_: self.settle()))

    def expect(self, servers) -> None:
        """Requests went out to ``servers``: their replies' parts are not in yet. A server
        that finished training (STOP) is sent none: its parts stay in, or the next forward
        would wait for them for ever."""
        for k in servers:
            for p in self._of_server[k]:
                self.loaded[p.index] = False

    def arrived(self, k: int, at: int, n: int, local) -> None:
        """``n`` floats of server ``k``'s reply came ahead at ``at`` in its share, decoded
        into ``local`` (its striped buffer; None: the model's weights themselves): each
        whole part of them is put in its place in the model and counted in."""
        for p in self._of_server[k]:
            if at <= p.at and p.at + p.numel <= at + n:
                if local is not None:
                    self.flat.weights[p.lo : p.hi] = local[p.at : p.at + p.numel]
                self.loaded[p.index] = True

    def server_in(self, k: int) -> None:
        """Server ``k``'s reply is in (loaded, or none to load: UPTODATE, STOP, an error)."""
        for p in self._of_server[k]:
            self.loaded[p.index] = True

    def wait(self, needs) -> None:
        """A module's forward is about to run: block until the parts ``needs`` are in."""
        if all(self.loaded[i] for i in needs):
            if not all(self.loaded):
                self.ran_ahead += 1
                self.poll(0)  # keep the pushes going and take what came
            return
        self.waited += 1
        with timeline.current().span("weights", "wire"):  # what forward waited for
            while not all(self.loaded[i] for i in needs):
                self.poll(WAIT_MS)  # back at once when a reply's message comes
        if not all(self.loaded):
            self.ran_ahead += 1

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
