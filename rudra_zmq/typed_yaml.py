"""YAML into typed dataclasses, strictly: the loading under ``config.py``.

``read_mapping`` reads a YAML file with ``yaml.safe_load``; ``apply_override`` applies one
``--set section.key=value`` to the raw mapping (the key must exist, the value parses as YAML);
``build`` turns the mapping into the dataclasses, converting int to float and nothing else.
Every error is a ConfigError that quotes the key, the value and what is allowed. Which
dataclasses and which keys were removed is ``config.py``'s to say. Pure, but for the file
``read_mapping`` reads.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import yaml

# yaml.safe_load's loader in C where PyYAML has libyaml: the same documents, ~7x faster
# (a config read back by compare, report and every role's start-up)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
INT_MAX = 2**63 - 1  # int64: what numpy and the wire hold
FLOAT_MAX = 1e15  # beyond any rate, interval or epoch count


class ConfigError(ValueError):
    """A configuration value or key that is not accepted; the message says which and why."""


def one_of(key: str, value, allowed) -> None:
    """Raise ConfigError unless ``value`` (of ``key``) is one of ``allowed``, naming them."""
    if value not in allowed:
        raise ConfigError(f"{key} is {value!r}; expected one of {', '.join(allowed)}")


def check_type(key: str, value, tp):
    """Return ``value`` converted to ``tp`` (int -> float only) or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return check_type(key, value, inner)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is float and type(value) in (int, float):
        if not math.isfinite(value) or abs(value) > FLOAT_MAX:
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is int and type(value) is int and abs(value) > INT_MAX:
        raise ConfigError(f"{key} is {value}: out of range (at most {INT_MAX:,} in magnitude)")
    if tp is bool and type(value) is bool or tp in (int, str) and type(value) is tp:
        return value
    raise ConfigError(f"{key} must be {tp.__name__}, got {value!r} ({type(value).__name__})")


def build(cls, data: dict, prefix: str, removed: dict, kept: dict | None = None):
    """An instance of the dataclass ``cls`` from the mapping ``data`` (its section ``prefix``,
    "" at the top), nested dataclasses built from nested mappings and every value checked
    against its field's type. Raises ConfigError naming an unknown key (with the valid ones),
    a key of ``removed`` (key -> why it went) or a value of the wrong type. A removed key
    holding its value in ``kept`` (key -> the value that behaves as every run now does: the
    configs that runs saved before it went) is dropped instead."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kept = kept or {}
    unknown = set(data) - known
    for name in sorted(unknown):
        key = f"{prefix}.{name}" if prefix else name
        if key in kept and data[name] == kept[key]:
            data = {k: v for k, v in data.items() if k != name}
            unknown.discard(name)
        elif key in removed:
            raise ConfigError(f"{key} was removed: {removed[key]}; delete it from the config")
    if unknown:
        where = f"section {prefix!r}" if prefix else "the top level"
        raise ConfigError(
            f"unknown key(s) {', '.join(map(repr, sorted(unknown)))} in {where}; "
            f"valid keys: {', '.join(sorted(known))}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, key, removed, kept)
        else:
            kwargs[name] = check_type(key, value, tp)
    return cls(**kwargs)


def apply_override(root, data: dict, item: str, removed: dict[str, str]) -> None:
    """Set ``section.key=value`` (``item``; the value parsed as YAML) in the raw mapping
    ``data`` of the dataclass ``root``. The key must name a field of ``root``, or of a section
    below it, and not a section itself; ``removed`` as in :func:`build`. Raises ConfigError."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    path, raw = item.split("=", 1)
    if path.strip() in removed:
        raise ConfigError(
            f"override {path.strip()!r}: that key was removed: {removed[path.strip()]}"
        )
    keys = path.strip().split(".")
    cls, node = root, data
    for i, k in enumerate(keys):
        fields_ = {f.name: f for f in dataclasses.fields(cls)}
        if k not in fields_:
            raise ConfigError(
                f"override {path!r}: {k!r} is not a key of "
                f"{'.'.join(keys[:i]) or 'the config'}; valid keys: "
                f"{', '.join(sorted(fields_))}"
            )
        tp = typing.get_type_hints(cls)[k]
        if i == len(keys) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"override {path!r} names a section; name one of its keys")
            try:
                node[k] = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError as exc:
                raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"override {path!r}: {k!r} is a value, not a section")
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {path!r}: section {k!r} is not a mapping in the file")
        cls = tp


def read_mapping(path, what: str, examples: str) -> dict:
    """A YAML file whose top level is a mapping (empty: {}), read with ``safe_load``.
    FileNotFoundError or ConfigError name the file (a ``what``; examples in ``examples``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=SAFE_LOADER)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} {str(path)!r} does not exist (see {examples} for examples)"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc})") from None
    if data is None:  # an empty file: every default
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {data!r}")
    return data
