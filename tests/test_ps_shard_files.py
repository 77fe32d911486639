"""A sharded run's files (server/end_files.py): the run's weights.npy and ps_final.json
are joined from every server's only once all K have finished this period's epochs."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from rudra_zmq.run_files import server_dir
from rudra_zmq.server import end_files
from rudra_zmq.server.end_files import assemble, write_end_files
from rudra_zmq.shape import ClusterShape


def finish(run_dir, i, w, ts, epoch, incarnation=1):
    d = server_dir(run_dir, i)
    d.mkdir(parents=True, exist_ok=True)
    write_end_files(d, _state(w, ts, epoch, incarnation))


def _state(w, ts, epoch, incarnation=1, done=True):
    engine = SimpleNamespace(timestamp=ts, epoch=epoch, updates=ts)
    w = np.asarray(w, np.float32)
    return SimpleNamespace(
        w=w, engine=engine, done=done, incarnations=[0] * incarnation, parts=None
    )


def test_a_server_killed_while_writing_its_weights_leaves_no_final_of_another_period(
    tmp_path, monkeypatch
):
    """A resumed period's end: the earlier period's ps_final.json goes before the new weights
    are written, so a crash between the two leaves old weights without a final (resume trains
    on), never new weights under the old period's final (a result line for the wrong epoch)."""
    write_end_files(tmp_path, _state([1, 2], ts=10, epoch=2.0))
    assert end_files.read_final(tmp_path)["epoch"] == 2.0

    def dies(file, arr, *args, **kwargs):  # writes a little, then the process is killed
        if isinstance(file, (str, os.PathLike)):
            file = open(file, "wb")  # left open, as by a killed process
        file.write(b"\x93NUMPY")
        file.flush()
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(end_files.np, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        write_end_files(tmp_path, _state([5, 6], ts=20, epoch=4.0))
    assert end_files.read_final(tmp_path) is None
    np.testing.assert_array_equal(np.load(tmp_path / "weights.npy"), [1, 2])  # whole
    monkeypatch.undo()
    write_end_files(tmp_path, _state([5, 6], ts=20, epoch=4.0))
    np.testing.assert_array_equal(np.load(tmp_path / "weights.npy"), [5, 6])
    assert end_files.read_final(tmp_path)["timestamp"] == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ps_final.json", "weights.npy"]


def test_the_run_files_are_joined_once_every_server_finished_this_periods_epochs(tmp_path):
    dirs = ClusterShape(2).joined_dirs(tmp_path)
    finish(tmp_path, 0, [1, 2], ts=10, epoch=3.0)
    assert not assemble(tmp_path, dirs, 3.0)  # server 1 has not finished
    finish(tmp_path, 1, [3], ts=11, epoch=2.0)  # an earlier period's end (resumed since)
    assert not assemble(tmp_path, dirs, 3.0) and not (tmp_path / "weights.npy").exists()
    finish(tmp_path, 1, [3], ts=12, epoch=3.01, incarnation=2)
    assert assemble(tmp_path, dirs, 3.0)
    np.testing.assert_array_equal(np.load(tmp_path / "weights.npy"), [1, 2, 3])
    final = json.loads((tmp_path / "ps_final.json").read_text())
    assert (final["timestamp"], final["epoch"], final["incarnation"]) == (10, 3.0, 2)
    assert [f["timestamp"] for f in final["servers"]] == [10, 12] and final["done"]
    assert not list(tmp_path.glob(".*.tmp"))  # written through temporary files, renamed


def test_one_servers_files_are_the_runs_own_and_nothing_is_joined(tmp_path):
    write_end_files(tmp_path, _state([1, 2], ts=10, epoch=3.0))
    before = (tmp_path / "ps_final.json").read_text()
    assert not assemble(tmp_path, ClusterShape(1).joined_dirs(tmp_path), 3.0)
    assert (tmp_path / "ps_final.json").read_text() == before


def test_resume_joins_servers_files_copied_in_afterwards_and_says_nothing_to_do(tmp_path):
    """No shared file system (servers on ranks of their own): each server's folder copied
    into the run directory afterwards; `run --resume` joins them and trains nothing."""
    from rudra_zmq.config import load_config
    from rudra_zmq.launch.resume import finished_note

    cfg = load_config(None, ["architecture.servers=2", "train.epochs=3"])
    finish(tmp_path, 0, [1, 2], ts=10, epoch=3.0)
    assert finished_note(tmp_path, cfg) is None  # server 1's files not here: resume
    finish(tmp_path, 1, [3], ts=10, epoch=3.0)
    note = finished_note(tmp_path, cfg)
    assert note.startswith("rudra-zmq: joined the 2 servers' weights into weights.npy; nothing")
    np.testing.assert_array_equal(np.load(tmp_path / "weights.npy"), [1, 2, 3])


def test_the_launcher_joins_once_and_leaves_a_join_already_made_alone(tmp_path, monkeypatch):
    """launcher.join_server_files: the first call joins; once the run's ps_final.json says training
    ended at train.epochs, a later call (the run's end) reads and writes nothing again."""
    from rudra_zmq.config import load_config
    from rudra_zmq.launch import launcher

    cfg = load_config(None, ["architecture.servers=2", "train.epochs=3"])
    finish(tmp_path, 0, [1, 2], ts=10, epoch=3.0)
    finish(tmp_path, 1, [3], ts=10, epoch=3.0)
    launcher.join_server_files(cfg, tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "weights.npy"), [1, 2, 3])
    calls = []
    monkeypatch.setattr(launcher, "assemble", lambda *a: calls.append(a))
    launcher.join_server_files(cfg, tmp_path)
    assert calls == []
    (tmp_path / "ps_final.json").unlink()  # not joined for this end: joined again
    launcher.join_server_files(cfg, tmp_path)
    assert len(calls) == 1
