"""A socket's messages that libzmq may still hold half-sent, and closing it without dropping one.

libzmq 4.3.5 aborts the process ("Resource temporarily unavailable (src/session_base.cpp:
233)") when a closed socket's session drops its pipe (the linger ran out, or was 0) while its
engine has taken some frames of a multipart message and not the rest, and the connection then
ends before the pipe is gone: ``session_base_t::clean_pipes`` reads the rest of the message
from a pipe that no longer gives it and asserts (docs/wire.md, "Half-sent messages"). The
engine takes a message frame by frame as the connection drains, so a message of several
payload frames (a model in ``runtime.chunk_mib`` chunks, a minibatch's images and labels) is
half-taken for as long as its peer does not read; a header and one payload frame are taken
together.

So, the cause closed here: such a message is sent tracked (the last frame's
``MessageTracker``, done once libzmq has released it: the whole message was taken, or
dropped whole with its connection), and ``Outbox.close`` closes the socket with its finite
linger only once every tracked message is done, waiting up to that linger for them. A message
still half-taken then (a peer that does not read) gets an infinite linger instead: libzmq then
never drops the rest of it while its connection lives (it is sent, or the connection ends and
the rest is read out of the pipe, which is what clean_pipes needs), and ``transport.term``
waits for such a socket at most ``TERM_WAIT_S``.
"""

from __future__ import annotations

import logging
import time

import zmq

log = logging.getLogger("rudra_zmq.outbox")

_held = 0  # sockets this process closed with an infinite linger (a message half-taken)


def held() -> int:
    """How many sockets this process closed with a message still half-taken (infinite
    linger); ``transport.term`` bounds its wait when there are any. Thread-safe (a read)."""
    return _held


class Outbox:
    """The sends of one socket, with its messages of several payload frames tracked until
    libzmq has taken them whole. ``head``: the frames up to the header (1; 2 on a ROUTER: the
    peer's routing id, which libzmq consumes, and a header). Not thread-safe: the socket's
    owner uses it.
    """

    def __init__(self, sock: zmq.Socket, head: int = 1):
        self.sock, self.head = sock, head
        self._trackers: list[zmq.MessageTracker] = []

    def send(self, frames, flags: int = 0, track: bool = False) -> zmq.MessageTracker | None:
        """Send ``frames`` zero-copy as one message (``send_multipart(copy=False)``); one of
        several payload frames is tracked, and so is any with ``track`` (a sender that bounds
        what it has in libzmq's queue: ``learner/priority.py``). Returns the tracker (done
        once libzmq has taken the message whole), or None. Blocks as ``send_multipart`` with
        ``flags`` (``zmq.NOBLOCK``: raises ``zmq.Again``, nothing sent)."""
        if len(frames) - self.head < 2 and not track:  # taken whole by libzmq: not tracked
            self.sock.send_multipart(frames, flags, copy=False)
            return None
        sock = self.sock
        for frame in frames[:-1]:  # only the first can raise Again: then nothing was sent
            sock.send(frame, flags | zmq.SNDMORE, copy=False)
        # the last frame zero-copy whatever its size, so that its tracker is libzmq's release
        # of it, the whole message taken (pyzmq copies a small frame: a tracker done at once)
        sock.copy_threshold = 0
        try:
            tracker = sock.send(frames[-1], flags, copy=False, track=True)
        finally:
            sock.copy_threshold = zmq.COPY_THRESHOLD
        self.pending()
        self._trackers.append(tracker)
        return tracker

    def pending(self) -> int:
        """Tracked messages libzmq has not taken whole yet. Never blocks."""
        self._trackers = [t for t in self._trackers if not t.done]
        return len(self._trackers)

    def wait(self, ms: int) -> int:
        """Wait up to ``ms`` for every tracked message to be taken whole; returns how many
        are not. Blocks up to ``ms``."""
        deadline = time.monotonic() + ms / 1000
        for tracker in self._trackers:
            try:
                tracker.wait(max(0.001, deadline - time.monotonic()))
            except zmq.NotDone:
                break
        return self.pending()

    def close(self, linger_ms: int, connected: bool = True, wait: bool = True) -> bool:
        """Close the socket, first waiting up to ``linger_ms`` for every tracked message to be
        taken whole (``wait``; a caller that just did ``wait`` says False); it then gets
        ``linger_ms`` for what is queued (whole messages, which libzmq drops safely). One not
        taken by then, on a connection that is up (``connected``: a client knows; a ROUTER's
        messages go to connected peers only), may be half-sent: the socket gets an infinite
        linger instead (module docstring). A client whose connection is down has nothing
        half-sent (libzmq reads the rest of one out when a connection ends). Returns whether
        the linger was ``linger_ms``. Blocks up to ``linger_ms``."""
        global _held
        if self.sock.closed:
            return True
        if wait:
            self.wait(linger_ms)
        held_back = connected and self.pending() > 0
        if held_back:
            _held += 1
            log.info(
                "%d message(s) not sent whole after %d ms (the peer reads nothing): the socket "
                "closes with an infinite linger, so libzmq never drops the rest of one",
                len(self._trackers),
                linger_ms,
            )
        self.sock.close(linger=-1 if held_back else linger_ms)
        return not held_back
