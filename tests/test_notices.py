"""Notices: a role's warning that the launcher also shows on the terminal (``notices.py``).
End to end (a damaged checkpoint on --resume, an evicted learner, on the launcher's output):
tests/test_fault_servers.py and tests/test_fault_learners.py."""

import logging

from rudra_zmq.notices import MARKER, LogNotices, notice, notice_text


def test_a_log_is_followed_from_its_end_line_by_line(tmp_path):
    log = tmp_path / "ps.log"
    log.write_text(f"{MARKER} from an earlier run\n")
    follow = LogNotices(log)
    with open(log, "a") as f:
        f.write(
            f"plain line\n2026 rudra_zmq.ps WARNING: {MARKER} learner 3 evicted\n{MARKER} half a li"
        )
        f.flush()
        assert follow.new() == ["learner 3 evicted"]
        f.write("ne\n")
        f.flush()
        assert follow.new() == ["half a line"] and follow.new() == []
    assert LogNotices(tmp_path / "missing.log").new() == []


def test_a_notice_is_a_warning_with_the_marker(tmp_path):
    log = tmp_path / "ps.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logger = logging.getLogger("rudra_zmq.test_notices")
    logger.addHandler(handler)
    try:
        follow = LogNotices(log)
        notice(logger, "checkpoint %s is damaged", "ckpt-00000002")
        handler.flush()
    finally:
        logger.removeHandler(handler)
        handler.close()
    line = log.read_text()
    assert "WARNING" in line and notice_text(line) == "checkpoint ckpt-00000002 is damaged"
    assert follow.new() == ["checkpoint ckpt-00000002 is damaged"]
