"""Rudra-adv*: each weight version travels once from the root PS through the learners.

With ``architecture.kind: advstar`` the root publishes every new version into a broadcast tree
of the learners (``architecture.broadcast_fanout`` = k, k = 1 a chain; learner i's children are
k(i+1) .. k(i+1)+k-1, ``topology.broadcast_children``). A version is sent as ``total`` BCAST
chunks; a member forwards each chunk the moment it arrives (the received frames, zero-copy),
so the chain pipelines.

- Flow control is credit-based per link, in chunks: a sender starts a version on a link only if
  the link has credit for all of it; otherwise the link later gets the newest complete version,
  whole. A slow member only misses superseded versions, and nobody waits for it.
- Every chunk is validated before anything is forwarded or kept; a refused chunk changes nothing.
- A complete version is an immutable :class:`Version` of the received frames (never written, no
  copy) that becomes the newest by one reference assignment, so no reader sees half of one. The
  learner copies the newest into its model between steps (``copy_latest_into``).

Three modules: ``root.py`` (:class:`~.root.BroadcastRoot`, in the root PS), ``member.py``
(:class:`~.member.BroadcastMember`, in each learner) and ``link.py`` (the sending side of each
hop, ``Fanout``, and the I/O thread both run). Threads: the root and each member run one I/O thread that owns their sockets after ``start()``; the
owner talks to it over an inproc PAIR pipe (``publish``, ``close``). No torch here. Windows and
validation: ``docs/architecture.md``; the messages: ``docs/wire.md``.
"""
