"""A server keeps the ``members`` records it sends in its ``members.json``
(``server/journal.py``): numbered across its restarts, the newest ``KEEP`` only, a damaged
file ignored with a warning and a failed write logged, never raised."""

import json
import logging

import pytest

from rudra_zmq.results import record_fields as fields
from rudra_zmq.server import journal
from rudra_zmq.server.journal import Journal


def change(learner=0, event="evicted", ts=5):
    return {"type": "members", "t": 1e9, "ts": ts, "learner": learner, "event": event, "c": 1}


def kept(files) -> list[tuple]:
    return [(e["incarnation"], e["n"], e["learner"]) for e in journal.read(files, "members")]


def test_each_record_is_numbered_and_in_the_file_before_it_is_sent(tmp_path):
    first = Journal(tmp_path, "members", incarnation=1, resume=False)
    sent = first.add(change(0))
    assert sent == {**change(0), "incarnation": 1, "n": 1}
    assert kept(tmp_path) == [(1, 1, 0)]
    first.add(change(1, "joined"))
    assert kept(tmp_path) == [(1, 1, 0), (1, 2, 1)]


def test_a_restarted_server_keeps_the_earlier_records_and_numbers_its_own_apart(tmp_path):
    Journal(tmp_path, "members", 1, resume=False).add(change(0))
    second = Journal(tmp_path, "members", 2, resume=True)
    assert second.add(change(1))["n"] == 1
    # its incarnation number said again (restarts.json lost): its numbers go on, not over
    again = Journal(tmp_path, "members", 2, resume=True)
    assert again.add(change(0, "joined"))["n"] == 2
    assert kept(tmp_path) == [(1, 1, 0), (2, 1, 1), (2, 2, 0)]
    Journal(tmp_path, "members", 1, resume=False).add(change(1))  # a new run: a new file
    assert kept(tmp_path) == [(1, 1, 1)]


def test_the_file_keeps_only_the_newest_records(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "KEEP", 4)
    flapping = Journal(tmp_path, "members", 1, resume=False)
    for i in range(10):
        flapping.add(change(0, ("evicted", "joined")[i % 2], ts=i))
    assert [n for _, n, _ in kept(tmp_path)] == [7, 8, 9, 10]
    assert Journal(tmp_path, "members", 1, resume=True).add(change())["n"] == 11


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"members": {}}',
        '{"members": [7]}',
        '{"members": [{"type": "members", "event": "left", "incarnation": 1, "n": 1}]}',
        '{"members": [{"type": "members", "event": "joined", "incarnation": 0, "n": 1}]}',
        '{"members": [{"type": "members", "event": "joined", "incarnation": 1}]}',
    ],
)
def test_a_damaged_file_is_refused_by_its_reader_and_ignored_by_a_restarted_server(
    tmp_path, caplog, text
):
    (tmp_path / "members.json").write_text(text)
    with pytest.raises(ValueError):
        journal.read(tmp_path, "members")
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.ps"):
        restarted = Journal(tmp_path, "members", 2, resume=True)
    assert [r.message.startswith("ignoring") for r in caplog.records] == [True]
    assert restarted.add(change())["n"] == 1
    assert kept(tmp_path) == [(2, 1, 0)]


def test_a_damaged_entry_names_the_file_and_the_field(tmp_path):
    bad = {**change(), "learners": -3, "incarnation": 1, "n": 1}
    (tmp_path / "members.json").write_text(json.dumps({"members": [bad]}))
    with pytest.raises(fields.DamagedRecord, match=r"members.json, members\[0\].*learners is -3"):
        journal.read(tmp_path, "members")


def test_a_failed_write_is_logged_and_the_record_still_sent(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the files folder cannot be made
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.ps"):
        sent = Journal(blocked, "members", 1, resume=False).add(change())
    assert sent["n"] == 1
    assert [r.message.startswith("could not write") for r in caplog.records] == [True]
    assert journal.read(tmp_path, "members") is None  # no file: none kept
