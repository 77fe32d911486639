"""Find this process's rank and the cluster facts from its launcher's environment.

A process started by srun, mpirun, torchrun or a ps-lite/BytePS-style script learns its rank,
the world size, its place on its node, the master's address and the host list from the
variables that launcher sets. :func:`resolve` reads them; ``rudra-zmq env`` prints what it found
and where from (:func:`add_parser`).

Precedence, per field, first found wins:

1. the command line (``cli``: ``--role --rank --world-size --local-rank --master-addr
   --master-port``);
2. ``RUDRA_ROLE RUDRA_RANK RUDRA_WORLD_SIZE RUDRA_LOCAL_RANK RUDRA_MASTER_ADDR
   RUDRA_MASTER_PORT RUDRA_NUM_LEARNERS``;
3. ps-lite/BytePS: ``DMLC_ROLE`` (server, scheduler -> servers; worker -> learner),
   ``DMLC_PS_ROOT_URI DMLC_PS_ROOT_PORT DMLC_NUM_WORKER DMLC_WORKER_ID``;
4. torchrun: ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT``;
5. Open MPI: ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}``;
6. PMI/PMIx (MPICH, Intel MPI): ``PMI_RANK PMI_SIZE PMIX_RANK MPI_LOCALRANKID MPI_LOCALNRANKS``;
7. SLURM: ``SLURM_PROCID SLURM_NTASKS|SLURM_NPROCS SLURM_LOCALID SLURM_NODEID``,
   ``SLURM_JOB_NODELIST|SLURM_NODELIST`` (expanded into ``hosts``; its first host is the
   master's address if nothing above named one), ``SLURM_NTASKS_PER_NODE`` or this node's entry
   of ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) for the local world size.

Nothing found means None (no default rank, world size or port: the caller has its own). An
empty or blank value counts as not set. Only the value that wins is parsed, so a malformed
variable of a lower-precedence launcher is ignored. Errors (:class:`RanksError`) quote the
variable, its value and what was expected. Each value's syntax (counts, ports, roles, SLURM's
hostlists and tasks per node) is ``rank_values.py``'s.

Pure: reads only the mapping it is given (``os.environ`` by default), no side effects, no
sockets; thread-safe. Nothing blocks.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from . import rank_values as values
from .rank_values import RanksError

CLI_KEYS = ("role", "rank", "world_size", "local_rank", "master_addr", "master_port")


@dataclass(frozen=True)
class Found:
    """One resolved fact and where it came from (``"--rank"``, ``"SLURM_PROCID"``, ...)."""

    value: object
    source: str


@dataclass
class Ranks:
    """What the environment says about this process; each field a :class:`Found` or None.

    ``role`` None means the caller derives it from the rank.
    """

    role: Found | None = None
    rank: Found | None = None
    world_size: Found | None = None
    local_rank: Found | None = None
    local_world_size: Found | None = None
    master_addr: Found | None = None
    master_port: Found | None = None
    learner_id: Found | None = None
    num_learners: Found | None = None
    hosts: Found | None = None
    node_rank: Found | None = None

    def value(self, name: str):
        """The value of field ``name``, or None when unknown; AttributeError on a bad name."""
        if name not in _FIELDS:
            raise AttributeError(f"Ranks has no field {name!r}; fields: {', '.join(_FIELDS)}")
        found = getattr(self, name)
        return None if found is None else found.value


_FIELDS = tuple(f.name for f in fields(Ranks))


# The parser of each field's value (``rank_values.py``).
_PARSE: dict[str, Callable] = {
    "role": values.role,
    "rank": values.index,
    "world_size": values.count,
    "local_rank": values.index,
    "local_world_size": values.count,
    "master_addr": values.addr,
    "master_port": values.port,
    "learner_id": values.index,
    "num_learners": values.count,
    "node_rank": values.index,
    "hosts": lambda raw: values.hostlist(str(raw)),
}

# Environment variables per field, in precedence order (the command line comes first).
_ENV: dict[str, tuple[str, ...]] = {
    "role": ("RUDRA_ROLE", "DMLC_ROLE"),
    "rank": ("RUDRA_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"),
    "world_size": (
        "RUDRA_WORLD_SIZE",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
    ),
    "local_rank": (
        "RUDRA_LOCAL_RANK",
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ),
    "local_world_size": (
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ),  # then SLURM_TASKS_PER_NODE
    "master_addr": ("RUDRA_MASTER_ADDR", "DMLC_PS_ROOT_URI", "MASTER_ADDR"),  # then nodelist
    "master_port": ("RUDRA_MASTER_PORT", "DMLC_PS_ROOT_PORT", "MASTER_PORT"),
    "learner_id": ("DMLC_WORKER_ID",),
    "num_learners": ("RUDRA_NUM_LEARNERS", "DMLC_NUM_WORKER"),
    "hosts": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "node_rank": ("GROUP_RANK", "OMPI_COMM_WORLD_NODE_RANK", "SLURM_NODEID"),
}
_PARSER_OF_VAR = {"DMLC_ROLE": values.dmlc_role}


def _set(raw) -> bool:
    return raw is not None and str(raw).strip() != ""


def _parse(source: str, raw, parse: Callable):
    try:
        return parse(raw)
    except values.BadValue as exc:
        raise RanksError(f"{source}={raw!r} is not valid: {exc.args[0]}") from None


def _first(environ: Mapping[str, str], names, default_parse: Callable) -> Found | None:
    """The first of ``names`` set in ``environ``, parsed; None when none is set."""
    for name in names:
        raw = environ.get(name)
        if _set(raw):
            return Found(_parse(name, raw, _PARSER_OF_VAR.get(name, default_parse)), name)
    return None


# ---- resolve ----


def resolve(
    cli: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> Ranks:
    """Find each field by the precedence in the module docstring and check them together.

    ``cli`` maps :data:`CLI_KEYS` to flag values (None or blank = not given); ``environ``
    defaults to ``os.environ``. Raises :class:`RanksError` on a malformed winning value, a rank
    not below the world size, a local rank not below the local world size, or a learner id not
    below the number of learners. Pure and thread-safe.
    """
    cli = dict(cli or {})
    unknown = sorted(set(cli) - set(CLI_KEYS))
    if unknown:
        raise RanksError(f"cli keys {unknown} are not known: expected some of {list(CLI_KEYS)}")
    environ = os.environ if environ is None else environ
    r = Ranks()
    for name in _FIELDS:
        parse = _PARSE[name]
        if _set(cli.get(name)):
            flag = "--" + name.replace("_", "-")
            setattr(r, name, Found(_parse(flag, cli[name], parse), flag))
        else:
            setattr(r, name, _first(environ, _ENV[name], parse))
    if r.local_world_size is None:
        r.local_world_size = _slurm_tasks_here(environ)
    if r.master_addr is None and r.hosts is not None and r.hosts.value:
        r.master_addr = Found(r.hosts.value[0], f"{r.hosts.source} (first host)")
    _check_below(r, "rank", "world_size")
    _check_below(r, "local_rank", "local_world_size")
    _check_below(r, "learner_id", "num_learners")
    return r


def _slurm_tasks_here(environ: Mapping[str, str]) -> Found | None:
    """This node's entry of SLURM_TASKS_PER_NODE (by SLURM_NODEID), or the common count."""
    var = "SLURM_TASKS_PER_NODE"
    raw = environ.get(var)
    if not _set(raw):
        return None
    counts = _parse(var, raw, values.tasks)
    node = _first(environ, ("SLURM_NODEID",), values.index)
    if node is None and len(set(counts)) != 1:
        return None  # nodes differ and we do not know which one we are on
    if node is not None and node.value >= len(counts):
        raise RanksError(
            f"SLURM_NODEID={environ['SLURM_NODEID']!r} is past the end of "
            f"{var}={raw!r}: expected a node index below {len(counts)}"
        )
    here = counts[0 if node is None else node.value]
    if here < 1:
        raise RanksError(f"{var}={raw!r} gives this node {here} tasks: expected at least 1")
    return Found(here, var if node is None else f"{var} (node {node.value})")


def _check_below(r: Ranks, low: str, high: str) -> None:
    a, b = getattr(r, low), getattr(r, high)
    if a is not None and b is not None and a.value >= b.value:
        raise RanksError(
            f"{low} {a.value} (from {a.source}={a.value}) is not below {high} "
            f"{b.value} (from {b.source}={b.value}): expected 0 <= {low} < {high}"
        )


# ---- describe and ``rudra-zmq env`` ----


def _show(found: Found | None) -> str:
    if found is None:
        return "-"
    v = found.value
    if isinstance(v, list):
        return ",".join(v) if len(v) <= 4 else f"{','.join(v[:4])},... ({len(v)} hosts)"
    return str(v)


def describe(r: Ranks) -> list[str]:
    """One line per field, ``rank  3   (from SLURM_PROCID)`` or ``-   (not set)``."""
    texts = [_show(getattr(r, name)) for name in _FIELDS]
    nw = max(map(len, _FIELDS)) + 2
    vw = min(24, max(map(len, texts)))
    lines = []
    for name, text in zip(_FIELDS, texts):
        found = getattr(r, name)
        where = "not set" if found is None else f"from {found.source}"
        lines.append(f"{name:<{nw}}{text:<{vw}}   ({where})")
    return lines


def cmd_env(args, environ: Mapping[str, str] | None = None) -> int:
    """``rudra-zmq env``: print :func:`describe` of what :func:`resolve` finds; 2 on error."""
    cli = {k: getattr(args, k, None) for k in CLI_KEYS}
    try:
        r = resolve(cli, environ)
    except RanksError as exc:
        print(f"rudra-zmq: error: {exc}", file=sys.stderr)
        return 2
    for line in describe(r):
        print(line)
    return 0


def add_parser(sub, environ: Mapping[str, str] | None = None) -> None:
    """Register ``rudra-zmq env [--rank N] ...`` on the CLI's subparsers (``environ``: tests)."""
    p = sub.add_parser(
        "env",
        help="show the rank and cluster facts found in the environment",
        description="show what srun, mpirun, torchrun or DMLC_* variables say "
        "about this process, and where each fact came from",
    )
    p.add_argument("--role", metavar="servers|learner", help="this process's role")
    p.add_argument("--rank", metavar="N", help="global rank (0-based)")
    p.add_argument("--world-size", metavar="N", help="number of processes")
    p.add_argument("--local-rank", metavar="N", help="rank on this node (0-based)")
    p.add_argument("--master-addr", metavar="A", help="the master's host name or IP address")
    p.add_argument("--master-port", metavar="P", help="the master's TCP port")
    p.set_defaults(func=functools.partial(cmd_env, environ=environ))
