"""The fields of the records a run directory holds, checked where they are read back.

``rudra-zmq replay``, ``run --resume``, ``report`` and ``compare`` read records that a run
wrote (``metrics.jsonl``, ``ps_final.json``, a checkpoint's manifest, ``point.json``) and that a
user may hand them damaged: a field missing, negative, huge, of another JSON type, NaN. Each
reader declares its record's fields once, as a ``{name: Field}`` map beside the reader, and
:func:`check` refuses a record that breaks it with one :class:`DamagedRecord` naming the file,
the record, the field and its value, before any of it is used: a refusal in one line, never a
traceback further on. Fields a record carries beyond those declared are not looked at.

Pure: no files (the readers open them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# Beyond what any run writes, and where arithmetic on them (float conversion, numpy int64)
# would overflow: a value past these is damage, not a long run.
INT_MAX = 2**53  # timestamps, steps, counts: exact as floats too
NUMBER_MAX = 1e15  # seconds, epochs, rates


class DamagedRecord(ValueError):
    """A record read back from a run's file is not what its writer writes; the message names
    the file, the record, the field and the value, and what was expected."""


@dataclass(frozen=True)
class Field:
    """What one field must hold: ``what`` says it in words (for the message); ``ok`` tests a
    value; ``required``: whether a record must carry it."""

    what: str
    ok: Callable[[object], bool]
    required: bool = True

    def optional(self) -> Field:
        """The same field, which a record may leave out (null is still checked by ``ok``)."""
        return Field(self.what, self.ok, False)

    def or_null(self) -> Field:
        """The same field, which may also be null (JSON's null: a writer's None)."""
        return Field(f"{self.what} or null", lambda v: v is None or self.ok(v), self.required)


def is_int(v) -> bool:
    """Whether ``v`` is an int (a JSON integer), not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """Whether ``v`` is a finite int or float, not a bool."""
    return (is_int(v) and abs(v) <= INT_MAX) or (isinstance(v, float) and math.isfinite(v))


def _bounds(lo, hi, top) -> str:
    """How ``what`` words [lo, hi] (``top``: the default bound, said last)."""

    def word(x) -> str:
        big = isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0
        return f"2^{x.bit_length() - 1}" if big else f"{x:g}"

    if hi != top:
        return f" in [{word(lo)}, {word(hi)}]"
    if lo == -top:
        return f" (of magnitude at most {word(top)})"
    return f" >= {word(lo)} (at most {word(top)})"


def integer(lo: int = 0, hi: int = INT_MAX) -> Field:
    """An integer in [lo, hi]."""
    return Field(f"an integer{_bounds(lo, hi, INT_MAX)}", lambda v: is_int(v) and lo <= v <= hi)


def number(lo: float = 0.0, hi: float = NUMBER_MAX) -> Field:
    """A finite number in [lo, hi] (an integer too)."""
    return Field(
        f"a finite number{_bounds(lo, hi, NUMBER_MAX)}",
        lambda v: is_number(v) and lo <= v <= hi,
    )


def text(*choices: str) -> Field:
    """A string (one of ``choices`` when given)."""
    if choices:
        return Field(f"one of {', '.join(map(repr, choices))}", lambda v: v in choices)
    return Field("a string", lambda v: isinstance(v, str))


def flag() -> Field:
    """true or false."""
    return Field("true or false", lambda v: isinstance(v, bool))


def integers(lo: int = 0, hi: int = INT_MAX) -> Field:
    """A list of integers in [lo, hi]."""
    one = integer(lo, hi).ok
    return Field(
        f"a list of integers{_bounds(lo, hi, INT_MAX)}",
        lambda v: isinstance(v, list) and all(map(one, v)),
    )


def numbers(lo: float = 0.0, hi: float = NUMBER_MAX) -> Field:
    """A list of finite numbers in [lo, hi]."""
    one = number(lo, hi).ok
    return Field(
        f"a list of finite numbers{_bounds(lo, hi, NUMBER_MAX)}",
        lambda v: isinstance(v, list) and all(map(one, v)),
    )


def mapping() -> Field:
    """A JSON object."""
    return Field("an object", lambda v: isinstance(v, dict))


def shown(value) -> str:
    """``value`` as the message quotes it: its JSON-ish repr, cut to 60 characters."""
    text_ = "NaN" if isinstance(value, float) and math.isnan(value) else repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def json_type(value) -> str:
    """The JSON name of ``value``'s type (object, array, string, number, true/false, null)."""
    for tp, name in ((dict, "an object"), (list, "an array"), (str, "a string")):
        if isinstance(value, tp):
            return name
    if isinstance(value, bool):
        return "a boolean"
    return "null" if value is None else "a number"


def check(record, fields: dict[str, Field], where: str) -> dict:
    """``record`` when it is an object whose fields hold what ``fields`` declares; raises
    DamagedRecord naming ``where`` (the file and the record: ``RUN/metrics.jsonl line 7, an
    eval record``), the field and its value otherwise. Pure."""
    if not isinstance(record, dict):
        raise DamagedRecord(f"{where} is {json_type(record)} ({shown(record)}), not an object")
    for name, field in fields.items():
        if name not in record:
            if field.required:
                raise DamagedRecord(f"{where} has no {name!r} field ({field.what})")
            continue
        if not field.ok(record[name]):
            raise DamagedRecord(f"{where}: {name} is {shown(record[name])}; expected {field.what}")
    return record


__all__ = [
    "DamagedRecord",
    "Field",
    "check",
    "flag",
    "integer",
    "integers",
    "is_int",
    "is_number",
    "json_type",
    "mapping",
    "number",
    "numbers",
    "shown",
    "text",
]
