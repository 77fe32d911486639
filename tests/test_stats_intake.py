"""What the statistics server takes in (stats/server.py), checked directly: who may send
what, and which records a METRIC may carry. No sockets."""

from types import SimpleNamespace

from rudra_zmq import wire
from rudra_zmq.stats.server import batch_items, forged, record_refusal
from rudra_zmq.wire import Kind


def msg(kind, sender, **fields):
    return SimpleNamespace(kind=kind, sender=sender, fields=fields)


def test_a_batch_is_expanded_and_one_without_a_list_of_items_is_refused():
    r = {"type": "learner", "loss": 1.0}
    assert batch_items(r) == [r]
    assert batch_items({"type": "batch", "items": [r, r]}) == [r, r]
    assert batch_items({"type": "batch", "items": "r"}) is None


def test_records_without_a_string_type_or_of_another_writers_kind_are_refused_naming_why():
    assert record_refusal({"type": "learner"}, 3) is None
    assert record_refusal({"type": "update"}, wire.SENDER_PS) is None
    assert record_refusal({"type": 7}, 3)[0] == "bad_metric"
    assert record_refusal({"type": "batch", "items": []}, 3)[0] == "bad_metric"
    code, why = record_refusal({"type": "update"}, 3)
    assert code == "forged" and "only the PS writes those" in why
    code, why = record_refusal({"type": "eval"}, wire.SENDER_PS)
    assert code == "forged" and "only this server writes those" in why


def test_without_curve_the_ps_and_every_eval_must_carry_the_runs_token():
    frames = [b"peer"]
    assert forged(frames, msg(Kind.METRIC, 3), None, "secret") is None  # a learner
    assert forged(frames, msg(Kind.EVAL, wire.SENDER_PS, token="secret"), None, "secret") is None
    assert "without the run's token" in forged(
        frames, msg(Kind.METRIC, wire.SENDER_PS, token="guess"), None, "secret"
    )
    assert "only the parameter server" in forged(frames, msg(Kind.EVAL, 3), None, None)


def test_with_curve_the_key_must_be_allowed_to_speak_as_the_sender():
    curve = SimpleNamespace(may_speak=lambda frame, sender: sender == 3)
    assert forged([b"k"], msg(Kind.METRIC, 3), curve, None) is None
    assert "may not speak as" in forged([b"k"], msg(Kind.METRIC, 4), curve, None)
