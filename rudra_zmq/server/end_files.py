"""The parameter server's end files in the run directory: ``weights.npy``, then
``ps_final.json`` (where training ended, in the server's own words).

- written by each server at the end of training (:func:`write_end_files`), every file
  replaced atomically (:func:`write_atomically`), so a reader or a crash sees the old file or
  the new one, never half of one;
- read back by the statistics server (the final weights when their EVAL never reached it:
  :func:`final_weights`), the launcher and ``--resume`` (:func:`read_final`,
  :func:`final_done`), a learner restarted after some of several servers finished (their
  ranges' final weights: :func:`finished_ranges`); the PS writes ``weights.npy`` first, so
  once ``ps_final.json`` names a timestamp, ``weights.npy`` holds the weights at it;
- with several servers (``architecture.servers`` = K > 1) each server writes its range's
  files in its own folder, ``RUN/servers/server-I/`` (``shape.Server.files_dir``), and the
  run's own ``RUN/weights.npy`` and ``RUN/ps_final.json`` (what the launcher, the statistics
  server, ``--resume`` and ``report`` read) are assembled from them once every server has
  finished training (:func:`assemble`, over ``shape.ClusterShape.joined_dirs``; one server's
  files are the run's own, nothing to join). Each server calls
  :func:`assemble` after writing its own files, so the last one to finish writes the run's;
  two finishing together both write the same bytes (each through its own temporary file and
  ``os.replace``). A server file at fewer epochs than ``train.epochs`` (a period of the run
  before it was resumed to train on) does not count.

Reads and writes files; blocks for them; no sockets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..results.record_fields import DamagedRecord
from ..results.records import load_final
from ..run_files import PS_FINAL_FILE, WEIGHTS_FILE


def write_end_files(files_dir: Path, state, **extra) -> None:
    """The server's weights (``weights.npy``), then ``ps_final.json``, in ``files_dir``, each
    replaced atomically; an older ``ps_final.json`` (a period before a resume) goes first, so
    that a crash between the two never pairs these weights with another period's end. Blocks
    for the writes."""
    files_dir = Path(files_dir)
    (files_dir / PS_FINAL_FILE).unlink(missing_ok=True)
    write_atomically(files_dir / WEIGHTS_FILE, npy_writer(state.w))
    write_final(files_dir, state, **extra)


def write_atomically(path: Path, write) -> None:
    """``write(tmp)`` to a hidden file beside ``path`` named by this process (two servers
    may write the run's files at once), then rename it to ``path``: a reader or a crash sees
    the old file or the new one, never half of one. Blocks for the write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_json(path: Path, obj, log) -> None:
    """``obj`` as one JSON line in ``path`` (its folder made), replaced atomically: a server's
    small files it keeps as it goes (``restarts.json``, ``members.json``). Never raises for
    a write error: it is logged as a warning on ``log``. Blocks for the write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda p: p.write_text(json.dumps(obj) + "\n"))
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)


def npy_writer(arr: np.ndarray):
    """A ``write`` for :func:`write_atomically` saving ``arr`` as .npy (through a file
    object: given a name, np.save would append ".npy" to the temporary one)."""

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            np.save(f, arr)

    return write


def write_final(run_dir: Path, state, restarts=None, incarnation: int | None = None) -> None:
    """``RUN_DIR/ps_final.json``: where training ended, from the server's own ``state`` (the
    launcher's result line reads it, not what the statistics server was told), with the
    server's ``restarts`` (``restart_record``: from what, what each lost) and its
    ``incarnation`` (default: the state's count). Atomic; blocks for a small write."""
    eng = state.engine
    final = {
        "timestamp": eng.timestamp,
        "epoch": eng.epoch,
        "updates": eng.updates,
        "done": state.done,
        "incarnation": incarnation or len(state.incarnations),
        "restarts": list(restarts or ()),
    }
    if state.parts is not None:  # wire.parts: how many went ahead of their update
        final["parts"] = state.parts.record()
    write_atomically(
        Path(run_dir) / PS_FINAL_FILE, lambda p: p.write_text(json.dumps(final) + "\n")
    )


def read_final(run_dir) -> dict | None:
    """``RUN_DIR/ps_final.json`` when it says training is done (``records.load_final``, with
    ``done`` true); None when it is missing, damaged or says anything else. Reads one small
    file."""
    try:
        final = load_final(run_dir)
    except DamagedRecord:
        return None
    return final if final is not None and final["done"] else None


def _done_at(files_dir, epochs: float) -> dict | None:
    """``files_dir``'s ``ps_final.json`` when it says training is done at ``epochs`` or later
    (a finished run resumed to train on has an older one, at fewer epochs), else None (also
    when it is missing or unreadable). Reads one small file."""
    final = read_final(files_dir)
    return final if final is not None and final["epoch"] >= epochs else None


def _weights_file(files_dir) -> np.ndarray | None:
    """``files_dir/weights.npy`` as written (any dtype and shape: the caller checks them),
    None when it is missing or unreadable. Never unpickles. Reads one file."""
    try:
        return np.load(Path(files_dir) / WEIGHTS_FILE, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None


def final_weights(run_dir, ts: int, numel: int) -> np.ndarray | None:
    """The weights at timestamp ``ts`` from ``run_dir/weights.npy``, once ``ps_final.json``
    says training ended there; None until then (or when either file is unreadable). Raises
    ValueError when the file holds something other than ``numel`` float32 values."""
    run_dir = Path(run_dir)
    final = read_final(run_dir)
    if final is None or final["timestamp"] != ts:
        return None
    w = _weights_file(run_dir)
    if w is None:
        return None
    if w.dtype != np.float32 or w.shape != (numel,):
        raise ValueError(
            f"{run_dir / WEIGHTS_FILE} holds {w.dtype} {w.shape}, not the model's "
            f"{numel:,} float32 values (is it another run's?)"
        )
    return w


def final_done(run_dir, epochs: float) -> dict | None:
    """The ``done`` record (type, ts, t, epoch) that ``run_dir/ps_final.json`` stands for when
    it says training is done at ``epochs`` or later (a finished run resumed to train on has an
    older one, at fewer epochs), else None (also when it is missing or unreadable). A local
    file the PS wrote, so trusted as the PS's word. Reads one small file."""
    final = _done_at(run_dir, epochs)
    if final is None:
        return None
    try:
        t = (Path(run_dir) / PS_FINAL_FILE).stat().st_mtime
    except OSError:
        return None
    return {"type": "done", "ts": final["timestamp"], "t": t, "epoch": float(final["epoch"])}


def finished_ranges(run_dir, shape, epochs: float) -> dict[int, tuple[int, np.ndarray]]:
    """{k: (timestamp, final weights of its range)} of the servers of ``shape`` (several:
    ``shape.ClusterShape``, sized to the model) whose ``ps_final.json`` in ``run_dir`` says
    training is done at ``epochs`` or later: what a learner restarted after they finished
    trains the other ranges on (``weights.npy`` is written first, so it holds the weights at
    that timestamp). Skips a server whose weights file is unreadable or another size than
    its share. Reads 2K small files."""
    out = {}
    for s in shape.servers if shape.count > 1 else ():
        d = s.files_dir(run_dir)
        final = _done_at(d, epochs)
        w = None if final is None else _weights_file(d)
        if w is not None and w.dtype == np.float32 and w.shape == (s.share.numel,):
            out[s.index] = (int(final["timestamp"]), w)
    return out


def finals(dirs, epochs: float) -> list[dict] | None:
    """The ``ps_final.json`` in each of the servers' folders ``dirs``, in order, when each
    says training is done at ``epochs`` or later; None otherwise. Reads K small files."""
    out = []
    for d in dirs:
        final = _done_at(d, epochs)
        if final is None:
            return None
        out.append(final)
    return out


def assemble(run_dir, dirs, epochs: float, join=np.concatenate) -> bool:
    """Write ``RUN/weights.npy`` (the weights in the servers' folders ``dirs``, in order:
    ``shape.ClusterShape.joined_dirs``, joined by ``join``: ``ClusterShape.join`` puts
    stripes in place) and then ``RUN/ps_final.json`` (server 0's
    timestamp and updates, the least epoch, the greatest incarnation, and every server's own
    final under ``"servers"``) once every server has finished; returns whether it did (never
    for no folders: one server's files are the run's own). Raises ValueError when a server's
    weights file is not a 1-D float32 array."""
    run_dir = Path(run_dir)
    done = finals(dirs, epochs)
    if not done:
        return False
    parts = []
    for d in dirs:
        w = np.load(Path(d) / WEIGHTS_FILE, allow_pickle=False)
        if w.dtype != np.float32 or w.ndim != 1:
            raise ValueError(f"{Path(d) / WEIGHTS_FILE} holds {w.dtype} {w.shape}")
        parts.append(w)
    write_atomically(run_dir / WEIGHTS_FILE, npy_writer(join(parts)))
    final = {
        "timestamp": done[0]["timestamp"],
        "epoch": min(f["epoch"] for f in done),
        "updates": done[0].get("updates"),
        "done": True,
        "incarnation": max(f.get("incarnation", 1) for f in done),
        "restarts": [r for f in done for r in f.get("restarts", [])],
        "servers": done,
    }
    write_atomically(run_dir / PS_FINAL_FILE, lambda p: p.write_text(json.dumps(final) + "\n"))
    return True
