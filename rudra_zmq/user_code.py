"""User code a config names by import path: ``model.name`` and ``data.dataset`` as
``package.module:function``.

One resolver for both, so every role's process finds a model and a dataset the same way:
``resolve`` imports ``package.module`` by its dotted name (``importlib``) and looks up what
follows the colon (``function``, or ``Class.method``). The module must be importable by every
role's process, on every host: installed, or its folder on ``PYTHONPATH``. ``import_root``
says which folder this process imported it from, so that ``rudra_zmq.train`` can hand that
folder to the roles it starts.

No package imports here: ``datasets``, ``user_data``, ``models`` and ``config`` build on it.
Nothing here blocks beyond importing the user's module and calling the user's function.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

IMPORT_RULE = (
    "the module must be importable by every role's process, on every host: install "
    "it, or put its folder on PYTHONPATH (rudra_zmq.train passes the folder it "
    "imported it from to the roles it starts)"
)


class UserCodeError(ValueError):
    """Code a config names cannot be used: the path does not import, names no callable, or
    the function raised or returned the wrong thing. The message quotes the value."""


def is_import_path(value) -> bool:
    """Whether a config value names user code (``package.module:function``) rather than a
    built-in name (built-in names never hold a colon). Does not import anything."""
    return isinstance(value, str) and ":" in value


def resolve(value: str, key: str):
    """The callable that ``value`` (``package.module:function``) names; ``key`` is the config
    key, for the error messages. Imports the module (blocks for its first import; later calls
    find it in ``sys.modules``). Raises UserCodeError naming the value."""
    module_name, _, attr = value.partition(":")
    parts = module_name.split(".") + attr.split(".")
    if not all(p.isidentifier() for p in parts):
        raise UserCodeError(
            f"{key} {value!r} is not an import path: write "
            "package.module:function, for example mypkg.models:small_cnn"
        )
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # whatever the user's module raises while it is imported
        raise UserCodeError(
            f"{key} {value!r}: importing {module_name} failed "
            f"({type(exc).__name__}: {exc}); {IMPORT_RULE}"
        ) from exc
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise UserCodeError(
                f"{key} {value!r}: {module_name} ({_origin(module_name)}) has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise UserCodeError(f"{key} {value!r} is a {type(obj).__name__}, not a function")
    return obj


def call(value: str, key: str, *args):
    """Call the function ``value`` names with ``args`` and return what it returns. Blocks for
    as long as the function runs. An exception inside it becomes a UserCodeError naming the
    value and the call, chained to the original (its traceback stays in the log)."""
    fn = resolve(value, key)
    try:
        return fn(*args)
    except Exception as exc:
        shown = ", ".join(map(repr, args))
        raise UserCodeError(
            f"{key} {value!r}: calling it with ({shown}) raised {type(exc).__name__}: {exc}"
        ) from exc


def import_root(value: str) -> str | None:
    """The folder this process imports ``value``'s top-level package (or module) from: the
    ``sys.path`` entry a process started elsewhere needs. None when it cannot be found or lies
    inside this interpreter's installation (any process of this interpreter finds it
    there). Imports only the top-level package. Does not block otherwise."""
    top = value.partition(":")[0].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package (regular or namespace)
        root = Path(list(spec.submodule_search_locations)[0]).parent
    elif spec.origin and Path(spec.origin).is_file():  # a single-file module
        root = Path(spec.origin).parent
    else:  # built-in or frozen
        return None
    root = root.resolve()
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(root == p or p in root.parents for p in prefixes):
        return None
    return str(root)


def _origin(module_name: str) -> str:
    module = sys.modules.get(module_name)
    return getattr(module, "__file__", None) or "no file"


__all__ = ["UserCodeError", "is_import_path", "resolve", "call", "import_root", "IMPORT_RULE"]
