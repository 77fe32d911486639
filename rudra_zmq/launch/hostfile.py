"""Hostfiles: which hosts to launch on, and how many learners (slots) each one runs.

``rudra-zmq launch CONFIG --hostfile F`` reads the form Open MPI, DeepSpeed and Horovod share;
``-H node1:4,node2:2`` gives the same on the command line (Horovod's ``-H``). One slot is one
learner. A hostfile::

    # one host per line; '#' starts a comment anywhere on a line
    node1 slots=4                  # Open MPI / DeepSpeed / Horovod
    node2:2                        # Horovod / MPICH
    10.0.0.7 slots=2 max_slots=8   # max_slots is accepted and ignored (Open MPI)
    [fd00::7] slots=2              # IPv6: bare, or in brackets (needed before ':N')
    node5                          # a bare host has 1 slot, as in Open MPI

Host names are letters, digits, '.', '-' and '_' (not starting with '-' or '.'), an IPv4
address, or an IPv6 address (kept in its compressed form, without brackets). Each host appears
once: DeepSpeed refuses duplicates, and so do we (give a host one line with all its slots).

``--include`` / ``--exclude`` keep or drop slots in DeepSpeed's syntax: ``node1@node2:0,2`` --
'@' separates hosts, ':' lists slot indices on that host, a bare host means all its slots.

Pure and thread-safe; only :func:`load` reads a file, and :func:`is_local` asks the OS for this
machine's names once (``gethostname`` and ``getfqdn``, the latter bounded by ``FQDN_TIMEOUT_S``).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

MAX_SLOTS = 4096  # per host: a typo such as slots=40000000 must not allocate a huge tuple
FQDN_TIMEOUT_S = 2.0  # getfqdn may wait on a slow resolver; is_local must not wait with it
EXPECTED = "expected 'host slots=N' (or 'host:N', or a bare 'host' for 1 slot)"
EXPECTED_H = "expected -H 'host1:N,host2:M' (a host without ':N' has 1 slot)"
EXPECTED_SELECT = "expected 'host1@host2:0,2' ('@' between hosts, ':' before slot indices)"

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}", re.ASCII)
_DOTTED = re.compile(r"[0-9.]+", re.ASCII)  # looks like IPv4, so must be a valid one
_INT = re.compile(r"[0-9]{1,6}", re.ASCII)  # bounded: int() of 5,000 digits raises
_SCOPE = re.compile(r"[A-Za-z0-9._-]+", re.ASCII)  # an IPv6 zone, as in fe80::1%eth0


class HostfileError(ValueError):
    """A hostfile, ``-H`` list or ``--include``/``--exclude`` that cannot be used; the message
    says where (``hosts.txt:3``), quotes the bad text and gives the expected form."""


class _Bad(Exception):
    """What is wrong with one piece of text; the caller adds where it was."""


@dataclass(frozen=True)
class Host:
    """A host and the slot indices (one learner each) to use on it, ascending and unique:
    normally ``0..N-1``; ``--include host:1,3`` keeps only some."""

    name: str
    slots: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "slots", tuple(self.slots))
        if list(self.slots) != sorted(set(self.slots)) or any(s < 0 for s in self.slots):
            raise ValueError(
                f"Host {self.name!r}: slots must be ascending, unique and >= 0, got {self.slots}"
            )

    @property
    def count(self) -> int:
        """How many learners run on this host."""
        return len(self.slots)


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile's ``text``, in order of appearance; ``source`` names the file in
    errors. Raises HostfileError on any line it cannot read, or if no host is given. Pure."""
    hosts: list[Host] = []
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host = _parse_line(re.sub(r"\s*=\s*", "=", line))  # 'slots = 4' reads as slots=4
        except _Bad as e:
            raise HostfileError(f"{source}:{lineno}: {e} in {line!r}; {EXPECTED}") from None
        if host.name in first_line:
            raise HostfileError(
                f"{source}:{lineno}: host {host.name!r} is listed twice (first on line "
                f"{first_line[host.name]}); give it one line with all its slots (DeepSpeed "
                f"refuses duplicate hosts too)"
            )
        first_line[host.name] = lineno
        hosts.append(host)
    if not hosts:
        raise HostfileError(f"{source}: no hosts (every line is blank or a comment); {EXPECTED}")
    return hosts


def parse_hosts_arg(text: str) -> list[Host]:
    """The hosts of a ``-H host1:2,host2:4`` argument (Horovod's form; a host without ``:N``
    has 1 slot), in order. Raises HostfileError naming the bad entry. Pure."""
    hosts: list[Host] = []
    for spec in text.split(","):
        spec = spec.strip()
        try:
            if not spec:
                raise _Bad("an empty entry")
            name, n_text = _spec(spec)
            n = 1 if n_text is None else _count(n_text, spec)
        except _Bad as e:
            raise HostfileError(f"-H {text!r}: {e}; {EXPECTED_H}") from None
        if any(h.name == name for h in hosts):
            raise HostfileError(
                f"-H {text!r}: host {name!r} is listed twice; give it once with all its slots"
            )
        hosts.append(Host(name, tuple(range(n))))
    return hosts


def parse_names(text: str, option: str) -> list[str]:
    """``"h1,h2,[fd00::7]"`` -> checked host names, in order (a name may repeat). Raises
    HostfileError naming ``option`` and the bad part."""
    names = []
    for part in text.split(","):
        try:
            name, extra = _spec(part.strip())
        except _Bad as exc:
            raise HostfileError(f"{option} {text!r}: {exc}") from None
        if extra is not None:
            raise HostfileError(f"{option} {text!r}: give host names only, not {part!r}")
        names.append(name)
    return names


def select(hosts: list[Host], include: str | None = None, exclude: str | None = None) -> list[Host]:
    """The hosts and slots that ``include`` keeps or ``exclude`` leaves (DeepSpeed's
    ``host1@host2:0,2``), in the order of ``hosts``; hosts left without slots are dropped.
    Neither given: ``hosts`` unchanged. Raises HostfileError if both are given, if either
    names a host or slot not in ``hosts``, or if nothing is left. Pure."""
    if include is not None and exclude is not None:
        raise HostfileError(
            f"--include {include!r} and --exclude {exclude!r} were both given; "
            f"give one of them (DeepSpeed allows only one too)"
        )
    if include is None and exclude is None:
        return list(hosts)
    flag, text = ("--include", include) if include is not None else ("--exclude", exclude)
    known = {h.name: h for h in hosts}
    named: dict[str, set[int]] = {}
    for spec in text.split("@"):
        spec = spec.strip()
        try:
            if not spec:
                raise _Bad("an empty host entry")
            name, slot_text = _spec(spec)
            if name not in known:
                raise _Bad(f"host {name!r} is not in the host list (known: {_names(known)})")
            have = known[name].slots
            slots = set(have) if slot_text is None else set()
            for s in [] if slot_text is None else slot_text.split(","):
                if not _INT.fullmatch(s.strip()):
                    raise _Bad(f"bad slot index {s!r} in {spec!r}")
                if int(s) not in have:
                    raise _Bad(
                        f"host {name!r} has no slot {int(s)} (its slots: "
                        f"{', '.join(map(str, have))})"
                    )
                slots.add(int(s))
        except _Bad as e:
            raise HostfileError(f"{flag} {text!r}: {e}; {EXPECTED_SELECT}") from None
        named.setdefault(name, set()).update(slots)
    if include is not None:
        out = [Host(h.name, tuple(sorted(named[h.name]))) for h in hosts if h.name in named]
    else:
        out = [
            Host(h.name, tuple(s for s in h.slots if s not in named.get(h.name, ()))) for h in hosts
        ]
        out = [h for h in out if h.slots]
    if not out:
        raise HostfileError(
            f"{flag} {text!r} leaves no slots to launch on (it excludes all "
            f"{sum(h.count for h in hosts)} slots of the {len(hosts)} hosts)"
        )
    return out


def is_local(name: str) -> bool:
    """Whether ``name`` is this machine: ``localhost``, 127.0.0.0/8, ``::1``, or this machine's
    ``gethostname()`` / ``getfqdn()`` (case-insensitive; looked up once, and getfqdn given at
    most ``FQDN_TIMEOUT_S``). No other DNS lookups. Thread-safe."""
    name = name.strip().strip("[]").rstrip(".").lower()
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name == "localhost" or name in _local_names()
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1
    return ip.is_loopback


def load(
    path=None, hosts_arg: str | None = None, include: str | None = None, exclude: str | None = None
) -> list[Host]:
    """The hosts to launch on: from the hostfile at ``path`` or from ``hosts_arg`` (``-H``;
    exactly one of them), then :func:`select` with ``include``/``exclude``. Raises
    HostfileError for a missing or unreadable file and for any error above. Blocks only to
    read the file."""
    if (path is None) == (hosts_arg is None):
        both = path is not None
        raise HostfileError(
            f"{'both a hostfile and -H were given' if both else 'no hosts given'}"
            f": pass --hostfile F or -H host1:N,host2:M{', not both' * both}"
        )
    if path is None:
        hosts = parse_hosts_arg(hosts_arg)
    else:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a BOM is not a host
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise HostfileError(f"cannot read hostfile {str(path)!r}: {why}") from None
        hosts = parse_hostfile(text, source=str(path))
    return select(hosts, include, exclude)


def describe(hosts: list[Host]) -> str:
    """One line for logs: ``3 hosts, 6 slots: a (2), b (2), c (2)``; a host using only some
    of its slots shows them: ``b (slots 1,3)``. Pure."""
    total = sum(h.count for h in hosts)
    parts = [
        f"{h.name} ({h.count})"
        if h.slots == tuple(range(h.count))
        else f"{h.name} (slots {','.join(map(str, h.slots))})"
        for h in hosts
    ]
    return (
        f"{len(hosts)} host{'s' * (len(hosts) != 1)}, {total} slot{'s' * (total != 1)}: "
        f"{', '.join(parts)}"
    )


def _parse_line(line: str) -> Host:
    spec, *options = line.split()
    name, n_text = _spec(spec)
    n = 1 if n_text is None else _count(n_text, spec)
    given = n_text is not None
    for opt in options:
        key, eq, value = opt.partition("=")
        if eq and key == "slots":
            if given:
                raise _Bad(f"the slot count is given twice ({spec!r}, {opt!r})")
            n, given = _count(value, opt), True
        elif eq and key == "max_slots":
            _count(value, opt)  # checked, then ignored: we run exactly `slots` learners
        else:
            raise _Bad(f"unexpected {opt!r}")
    return Host(name, tuple(range(n)))


def _spec(spec: str) -> tuple[str, str | None]:
    """'host', 'host:X', '[v6]', '[v6]:X' or a bare IPv6 -> (checked name, X or None)."""
    if spec.startswith("["):
        name, close, rest = spec[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise _Bad(f"bad bracketed address {spec!r} (write '[IPv6]' or '[IPv6]:N')")
        if name and ":" not in name:
            raise _Bad(f"brackets are for IPv6 addresses, not {spec!r}")
        return _name(name, spec), (rest[1:] if rest else None)
    if spec.count(":") >= 2:
        return _name(spec, spec), None  # a bare IPv6 address: brackets are needed for ':N'
    name, colon, rest = spec.partition(":")
    return _name(name, spec), (rest if colon else None)


def _name(text: str, spec: str) -> str:
    if not text:
        raise _Bad(f"no host name in {spec!r}")
    if ":" in text:
        try:
            ip = ipaddress.IPv6Address(text)
        except ValueError:
            raise _Bad(f"{text!r} is not a valid IPv6 address") from None
        if ip.scope_id is not None and not _SCOPE.fullmatch(ip.scope_id):
            raise _Bad(f"bad IPv6 zone in {text!r}")
        return str(ip)
    if _DOTTED.fullmatch(text):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise _Bad(f"{text!r} is not a valid IPv4 address") from None
    if not _NAME.fullmatch(text):
        raise _Bad(
            f"bad host name {text!r} (letters, digits, '.', '-', '_', not starting "
            f"with '-' or '.'; an IPv4 address; or an IPv6 address)"
        )
    return text


def _count(text: str, token: str) -> int:
    if not _INT.fullmatch(text) or not 1 <= int(text) <= MAX_SLOTS:
        raise _Bad(f"bad slot count {token!r} (an integer from 1 to {MAX_SLOTS})")
    return int(text)


def _names(known) -> str:
    names = list(known)
    return ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")


@functools.cache
def _local_names() -> frozenset[str]:
    """This machine's names, lower case; cached (functools.cache is thread-safe)."""
    found = [socket.gethostname()]
    worker = threading.Thread(
        target=lambda: found.append(socket.getfqdn()), daemon=True, name="rudra-getfqdn"
    )
    worker.start()
    worker.join(FQDN_TIMEOUT_S)  # a slow resolver leaves only gethostname's answer
    return frozenset(n.rstrip(".").lower() for n in list(found) if n)
