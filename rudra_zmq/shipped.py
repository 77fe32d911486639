"""What the package ships beside its code, found by name: configs, grids and examples.

An installed wheel carries them as package data (``rudra_zmq/configs``,
``rudra_zmq/configs/grids``, ``rudra_zmq/examples``); a source tree or an editable install has
them beside the package (``configs/``, ``configs/grids/``, ``examples/``). So ``rudra-zmq run
quickstart``, ``rudra-zmq sweep table2`` and ``rudra-zmq examples slurm.sbatch`` work from any
folder, and so do the repository paths the docs use (``configs/grids/table2.yaml``) where no
such file exists in the current folder. Reads files only; never blocks.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # the package
# kind -> its folder's parts below the package (a wheel) or the source tree's root
KINDS = {"config": ("configs",), "grid": ("configs", "grids"), "example": ("examples",)}
_YAML = (".yaml", ".yml")


def folder(kind: str) -> Path | None:
    """The folder holding the shipped files of ``kind`` (config | grid | example), or None."""
    parts = KINDS[kind]
    for base in (HERE, HERE.parent):
        path = base.joinpath(*parts)
        if path.is_dir():
            return path
    return None


def names(kind: str) -> list[str]:
    """The shipped names of ``kind``: YAML files without ``.yaml`` for configs and grids,
    whole file names for examples (Python caches left out)."""
    where = folder(kind)
    if where is None:
        return []
    files = [p for p in where.iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    if kind == "example":
        return sorted(p.name for p in files if p.suffix not in (".pyc", ".pyo"))
    return sorted(p.stem for p in files if p.suffix in _YAML)


def _shipped_name(kind: str, text: str) -> str | None:
    """The name ``text`` gives in the shipped layout (``table2``, ``grids/table2``,
    ``configs/grids/table2.yaml`` -> ``table2``), or None where it is some other path."""
    parts = [p for p in Path(text).parts if p not in (".",)]
    prefix = list(KINDS[kind])
    # accept the layout's folders as a leading prefix, in full or from any folder of it
    for start in range(len(prefix) + 1):
        if parts[:-1] == prefix[start:]:
            break
    else:
        return None
    last = parts[-1] if parts else ""
    if kind != "example" and last.endswith(_YAML):
        last = last.rsplit(".", 1)[0]
    return last or None


def resolve(kind: str, text: str) -> Path | None:
    """The file ``text`` names: itself where it exists, else the shipped file of that name
    (see the module docstring for the accepted forms). None for a bare name (no folder, no
    ``.yaml``) that is neither: the caller raises with :func:`unknown`'s message. Any other
    missing path comes back as it is, for the caller's reader to name."""
    path = Path(text)
    if path.exists():
        return path
    name = _shipped_name(kind, text)
    if name in names(kind):
        return folder(kind) / (name if kind == "example" else name + ".yaml")
    if "/" not in text and not text.endswith(_YAML):
        return None
    return path


def unknown(kind: str, text: str) -> str:
    """The message for a ``text`` that is neither a file nor a shipped ``kind``."""
    if kind == "example":
        return f"no example {text!r}; the examples are: {', '.join(names(kind))}"
    return (
        f"{kind} {text!r} is not a file and not a built-in {kind}; give a YAML file "
        "or one of: "
        f"{', '.join(names(kind)) or '(none found)'}"
    )


# ----------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    """Register ``rudra-zmq examples`` on the CLI's subparsers."""
    p = sub.add_parser(
        "examples",
        help="list the shipped examples, print one or copy them",
        description="The example scripts shipped with rudra_zmq (a Slurm batch "
        "script, an mpirun MPMD line, a hostfile, a user model). "
        "Without arguments: list them with their paths.",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="print this example to stdout")
    p.add_argument(
        "--copy",
        metavar="DIR",
        help="copy every example into DIR (made if absent;"
        " files already there are left as they are and named)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Handler of ``rudra-zmq examples``: 0 done, 2 an unknown name."""
    where, known = folder("example"), names("example")
    if args.name:
        if args.name not in known:
            print(f"rudra-zmq: error: {unknown('example', args.name)}", file=sys.stderr)
            return 2
        sys.stdout.write((where / args.name).read_text())
        return 0
    if args.copy:
        dest = Path(args.copy)
        dest.mkdir(parents=True, exist_ok=True)
        for name in known:
            target = dest / name
            if target.exists():
                print(f"{target}: exists, left as it is")
                continue
            shutil.copy2(where / name, target)
            print(f"{target}")
        return 0
    for name in known:
        print(f"{name:20s} {where / name}")
    print(
        "print one with `rudra-zmq examples NAME`, copy them all with "
        "`rudra-zmq examples --copy DIR`"
    )
    return 0
