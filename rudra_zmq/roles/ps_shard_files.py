"""The run files of a sharded run (``architecture.servers`` = K > 1): each server writes its
range's ``weights.npy`` and its ``ps_final.json`` in ``RUN/servers/server-I/``; the run's own
``RUN/weights.npy`` and ``RUN/ps_final.json`` (what the launcher, the statistics server,
``--resume`` and ``report`` read) are assembled from them once every server has finished
training (:func:`assemble`).

Each server calls :func:`assemble` after writing its own files, so the last one to finish
writes the run's; two finishing together both write the same bytes (each through its own
temporary file and ``os.replace``). A server file at fewer epochs than ``train.epochs`` (a
period of the run before it was resumed to train on) does not count. Reads and writes files;
blocks for them; no sockets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..run_files import PS_FINAL_FILE, WEIGHTS_FILE, server_dir
from .ps_report import npy_writer, read_final, write_atomically


def finals(run_dir, servers: int, epochs: float) -> list[dict] | None:
    """Every server's ``ps_final.json``, in server order, when each says training is done at
    ``epochs`` or later; None otherwise. Reads K small files."""
    out = []
    for i in range(servers):
        final = read_final(server_dir(run_dir, i))
        if final is None or not final["epoch"] >= epochs:
            return None
        out.append(final)
    return out


def assemble(run_dir, servers: int, epochs: float) -> bool:
    """Write ``RUN/weights.npy`` (the K ranges joined in order) and then ``RUN/ps_final.json``
    (server 0's timestamp and updates, the least epoch, the greatest incarnation, and every
    server's own final under ``"servers"``) once all K servers have finished; returns whether
    it did. Raises ValueError when a server's weights file is not a 1-D float32 array."""
    run_dir = Path(run_dir)
    done = finals(run_dir, servers, epochs)
    if done is None:
        return False
    parts = []
    for i in range(servers):
        w = np.load(server_dir(run_dir, i) / WEIGHTS_FILE, allow_pickle=False)
        if w.dtype != np.float32 or w.ndim != 1:
            raise ValueError(f"{server_dir(run_dir, i) / WEIGHTS_FILE} holds {w.dtype} {w.shape}")
        parts.append(w)
    write_atomically(run_dir / WEIGHTS_FILE, npy_writer(np.concatenate(parts)))
    final = {
        "timestamp": done[0]["timestamp"],
        "epoch": min(f["epoch"] for f in done),
        "updates": done[0].get("updates"),
        "done": True,
        "incarnation": max(f.get("incarnation", 1) for f in done),
        "servers": done,
    }
    write_atomically(run_dir / PS_FINAL_FILE, lambda p: p.write_text(json.dumps(final) + "\n"))
    return True
