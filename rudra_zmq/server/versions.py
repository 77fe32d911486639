"""Weight versions that can be sent zero-copy while the next update is computed.

The parameter server answers pulls by handing ZeroMQ the weight array itself (``copy=False``):
ZeroMQ's I/O thread may read it long after ``send`` returned. So a version that was handed out
must never be written again. Instead of copying each pulled version into a snapshot (a full
extra pass over memory per update), the update kernel writes the *next* version into another
buffer (``out=``) and the current buffer becomes read-only history::

    update k:   w_k (current, maybe in flight)  --kernel-->  w_{k+1} (a free buffer)
    afterwards: w_{k+1} is current; w_k returns to the spares and is reused only once no
                send holds it any more

A spare is free when nothing but this pool refers to it: pyzmq keeps a reference to every
zero-copy buffer (or a view of it) until libzmq has released the message, so the array's
reference count tells exactly whether a send may still read it. If every spare is still in
flight a new buffer is allocated (as many as there are sends in flight, the same bound as one
snapshot per pulled version); at most ``max_spares`` idle buffers are kept.

Not thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

import sys

import numpy as np

# References to a free spare as counted in ``_free_index``: the spares list and getrefcount's
# own argument (indexing, not iterating: an iterator would hold extra references).
_FREE_REFS = 2


class WeightVersions:
    """The current weight version plus spare buffers for the next one."""

    def __init__(self, weights: np.ndarray, max_spares: int = 3):
        if weights.dtype != np.float32 or weights.ndim != 1 or not weights.flags.c_contiguous:
            raise ValueError(
                f"weights must be a 1-D contiguous float32 array, got "
                f"{weights.dtype} shape {weights.shape}"
            )
        self.current = weights
        self.max_spares = max_spares
        self._spares: list[np.ndarray] = []
        self.allocated = 1  # buffers ever allocated (current included): for tests/metrics

    def next_buffer(self) -> np.ndarray:
        """A buffer the next version may be written into: no send holds it, and it is not the
        current version. Allocates only if every spare is still in flight."""
        i = self._free_index()
        if i is not None:
            return self._spares.pop(i)
        self.allocated += 1
        return np.empty_like(self.current)

    def publish(self, new: np.ndarray) -> None:
        """Make ``new`` (written by the update) the current version; the old one becomes a
        spare (reused only once nothing refers to it). Idle spares beyond ``max_spares`` are
        dropped, so the pool does not keep a burst's worth of buffers forever."""
        old, self.current = self.current, new
        self._spares.append(old)
        if len(self._spares) > self.max_spares:
            i = self._free_index()
            if i is not None:
                del self._spares[i]

    def _free_index(self) -> int | None:
        spares = self._spares
        for i in range(len(spares)):
            if sys.getrefcount(spares[i]) <= _FREE_REFS:
                return i
        return None
