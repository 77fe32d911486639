"""One launcher value, parsed: the raw text of a variable or flag as a rank, count, port,
address or role, and SLURM's hostlist (``node[01-03,07]``) and tasks-per-node (``2(x3),1``)
syntaxes. A malformed value raises :class:`BadValue` saying what was expected; ``ranks.py``
names the variable it came from. Pure; thread-safe; nothing blocks."""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Mapping

ROLES = ("servers", "server", "learner")
DMLC_ROLES = {"server": "servers", "scheduler": "servers", "worker": "learner"}
MAX_HOSTS = 1_000_000  # a nodelist that expands past this is a typo, not a cluster
NODELIST_EXAMPLE = "'node[01-03,07],gpu5'"


class RanksError(ValueError):
    """A launcher variable or flag holds a value rudra_zmq cannot use; the message quotes it."""


class BadValue(Exception):
    """A value is malformed; args[0] says why and what was expected (no variable name yet)."""


# ---- one value: raw text (or an int from the command line) -> value, or BadValue ----


def _int(
    raw,
    low: int = 0,
    high: int | None = None,
    expected: str = "a non-negative integer (0, 1, 2, ...)",
) -> int:
    text = str(raw).strip()
    if not re.fullmatch(r"\d+", text) or int(text) < low or high is not None and int(text) > high:
        raise BadValue(f"expected {expected}")
    return int(text)


index = _int  # a rank or id: 0, 1, 2, ...
count = functools.partial(_int, low=1, expected="a positive integer (1, 2, ...)")
port = functools.partial(_int, low=1, high=65535, expected="a TCP port, an integer from 1 to 65535")


def addr(raw) -> str:
    """A host name or IP address (no spaces)."""
    text = str(raw).strip()
    if any(c.isspace() for c in text):
        raise BadValue("expected a host name or IP address (no spaces)")
    return text


def role(
    raw,
    table: Mapping[str, str] = {r: r for r in ROLES},  # noqa: B006 (read only)
    expected: str = "'servers', 'server' or 'learner'",
) -> str:
    """The role ``raw`` names in ``table`` (rudra_zmq's own names by default)."""
    text = str(raw).strip()
    if text not in table:
        raise BadValue(f"expected {expected}")
    return table[text]


dmlc_role = functools.partial(
    role, table=DMLC_ROLES, expected="one of 'server', 'scheduler', 'worker'"
)


# ---- SLURM syntaxes ----


def hostlist(text: str) -> list[str]:
    """A SLURM hostlist's hosts; BadValue (saying what was expected) if malformed."""
    try:
        return _expand(text.strip())
    except BadValue as exc:
        raise BadValue(
            f"{exc.args[0]}; expected a SLURM hostlist like {NODELIST_EXAMPLE}"
        ) from None


def _expand(text: str) -> list[str]:
    items, depth, start = [], 0, 0  # split at commas outside brackets
    for i, c in enumerate(text):
        if c == "[":
            if depth:
                raise BadValue(f"a '[' inside brackets at position {i}")
            depth = 1
        elif c == "]":
            if not depth:
                raise BadValue(f"a ']' without '[' at position {i}")
            depth = 0
        elif c == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise BadValue("a '[' is never closed")
    items.append(text[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item or any(c.isspace() for c in item):
            raise BadValue("an empty name or a space")
        parts = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ...
        choices = [[p] if k % 2 == 0 else _group(p) for k, p in enumerate(parts)]
        if len(hosts) + math.prod(map(len, choices)) > MAX_HOSTS:
            raise BadValue(f"more than {MAX_HOSTS:,} hosts")
        hosts.extend("".join(p) for p in itertools.product(*choices))
    return hosts


def _group(body: str) -> list[str]:
    """``01-03,07`` -> 01 02 03 07: zero padding kept (the width of the range's start)."""
    out: list[str] = []
    for piece in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise BadValue(f"[{body}] holds something other than numbers and ranges like 1-3")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise BadValue(f"the range {piece.strip()} runs backwards")
        if len(out) + int(hi) - int(lo) >= MAX_HOSTS:
            raise BadValue(f"more than {MAX_HOSTS:,} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM hostlist: ``node[01-03,07],gpu5,rack[1-2]-n[1-2]`` -> node01 node02
    node03 node07 gpu5 rack1-n1 rack1-n2 rack2-n1 rack2-n2 (padding kept; several bracket
    groups in one name give their product, last group fastest). Blank text gives [];
    malformed text raises :class:`RanksError` quoting it."""
    if not text.strip():
        return []
    try:
        return hostlist(text)
    except BadValue as exc:
        raise RanksError(f"nodelist {text!r} is malformed: {exc.args[0]}") from None


def tasks(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's counts; BadValue if malformed."""
    out: list[int] = []
    for piece in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not m or m.group(2) is not None and int(m.group(2)) < 1:
            raise BadValue("expected counts like 2(x3),1 (a count, optionally (xN) with N >= 1)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE syntax: ``2(x3),1`` -> [2, 2, 2, 1]; RanksError if malformed."""
    try:
        return tasks(text)
    except BadValue as exc:
        raise RanksError(f"tasks per node {text!r} is malformed: {exc.args[0]}") from None
