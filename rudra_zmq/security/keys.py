"""CurveZMQ key directories ("Ironhouse": encrypted, allow-listed clients) and ``rudra-zmq keys``.

DIR/server.key{,_secret}: the servers' pair; clients/NAME.key: allowed client public keys;
secret/NAME.key_secret: their secrets (0600, dirs 0700); revoked/NAME.key: no longer allowed.
``learner-N`` may speak as learner N, ``node-N`` as tree node N, ``ps`` as the PS; metadata
``learners = "0,1,2"`` replaces learner-N's ids, extends others'. Blocks on local file I/O only.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from .. import wire

NAME_RULE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_RULE)


@dataclass(frozen=True)
class KeyInfo:
    """One client key: name, z85 public key, senders it may speak as, revoked?, its file."""

    name: str
    public: bytes
    senders: frozenset[int]
    revoked: bool
    path: Path


def is_key_name(name) -> bool:
    """Whether ``name`` is a valid key name (``NAME_RULE``: letters, digits, ``_ . -``). Pure."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid key name, else raise ValueError naming it and the rule."""
    if not is_key_name(name):
        raise ValueError(f"bad key name {name!r}: names must match {NAME_RULE}")
    return name


def senders_for(name: str, learners=None) -> frozenset[int]:
    """The wire senders key ``name`` may speak as, given its explicit learner ids (or None)."""
    out = set(learners or ())
    if m := re.fullmatch(r"node-(\d+)", name):
        out.add(wire.node_sender(int(m.group(1))))
    elif (m := re.fullmatch(r"learner-(\d+)", name)) and learners is None:
        out.add(int(m.group(1)))  # explicit ids replace the name's default
    return frozenset(out | ({wire.SENDER_PS} if name == "ps" else set()))


def parse_learners(text: str) -> list[int]:
    """``"0,1,2"``, ``"0-3"`` or ``"0-3,7"`` -> sorted learner ids; ValueError if malformed."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"bad learner ids {text!r}: expected e.g. 0,1,2 or 0-3")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return sorted(ids)


def describe_senders(senders) -> str:
    """``"learner 3"``, ``"tree node 1"``, ``"parameter server"``, ... or ``"-"`` for none."""
    order = sorted(senders, key=lambda s: (s < 0, abs(s)))  # learners first, ascending
    return ", ".join(map(wire.sender_name, order)) or "-"


def stored_learners(path) -> list[int] | None:
    """The ids of ``learners = "0,1,2"`` in a ZPL certificate's metadata section, or None."""
    # the section runs from its unindented "metadata" line to the next unindented line
    m = re.search(r"^metadata[ \t]*\n((?:(?:[ \t#].*)?\n)*)", Path(path).read_text("utf-8"), re.M)
    v = re.search(r"^[ \t]+learners[ \t]*=[ \t]*\"?([^\"\n]*)\"?", m.group(1) if m else "", re.M)
    return None if v is None else parse_learners(v.group(1))


def _scan(d: Path, sub: str) -> list[KeyInfo]:
    """Every valid ``d/sub/NAME.key`` certificate, by name."""
    _require_dir(d)
    paths = [p for p in sorted((d / sub).glob("*.key")) if is_key_name(p.stem)]
    return [
        KeyInfo(
            p.stem,
            zmq.auth.load_certificate(p)[0],
            senders_for(p.stem, stored_learners(p)),
            sub == "revoked",
            p,
        )
        for p in paths
    ]


def _require_dir(d: Path) -> None:
    """Raise FileNotFoundError unless ``d`` was made by :func:`init`."""
    if not (d / "server.key").is_file() or not (d / "clients").is_dir():
        raise FileNotFoundError(
            f"{d} is not a key directory (no {d / 'server.key'}); "
            f"create it with: rudra-zmq keys init {d}"
        )


def _make_pair(d: Path, name: str, pub_dst: Path, sec_dst: Path, learners=None) -> None:
    """Create a key pair under umask 0o077 (no window where the secret is readable) in a
    staging dir under ``d``, link its public half to ``pub_dst`` (FileExistsError if there:
    a racing creator loses), then move its secret half to ``sec_dst``. ``learners``: a
    metadata string such as "0,1,2" for both halves, or None."""
    stage = tempfile.mkdtemp(prefix=".new-", dir=d)  # 0700 whatever the umask
    old = os.umask(0o077)
    try:
        meta = None if learners is None else {"learners": f'"{learners}"'}
        pub, sec = zmq.auth.create_certificates(stage, name, meta)
        if meta:  # pyzmq writes metadata to the secret file only
            Path(pub).write_text(
                f"#   ZeroMQ CURVE Public Certificate\n\nmetadata\n    learners = "
                f'"{learners}"\ncurve\n    public-key = '
                f'"{zmq.auth.load_certificate(pub)[0].decode()}"\n'
            )
        os.chmod(pub, 0o644)  # public halves may be copied freely
        os.link(pub, pub_dst)
        os.replace(sec, sec_dst)
    finally:
        os.umask(old)
        shutil.rmtree(stage, ignore_errors=True)


def init(dir) -> Path:
    """Create key directory ``dir`` with its sub-directories and the server key pair; return it.
    Refuses (ValueError) if ``dir`` already holds server.key."""
    d = Path(dir)
    if (d / "server.key").exists():
        raise ValueError(
            f"{d} already holds a server key ({d / 'server.key'}); use another "
            f"directory, or add clients with: rudra-zmq keys add {d} NAME"
        )
    for sub in ("", "clients", "secret", "revoked"):  # "": DIR itself, first
        (d / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d / sub, 0o700)  # also when it existed already
    _make_pair(d, "server", d / "server.key", d / "server.key_secret")
    return d


def add(dir, name: str, learners=None) -> KeyInfo:
    """Create client key pair ``name``: clients/NAME.key (with ``learners`` in its metadata)
    and secret/NAME.key_secret. Refuses (ValueError) a bad name or learner id, or a NAME
    already in clients/ or revoked/."""
    d, name = Path(dir), check_name(name)
    _require_dir(d)
    if learners is not None and any(type(i) is not int or i < 0 for i in learners):
        raise ValueError(f"bad learner ids {learners!r}: expected integers >= 0")
    for sub in ("clients", "revoked"):
        if (d / sub / f"{name}.key").exists():
            raise ValueError(f"key {name!r} already exists in {d / sub}; choose another name")
    ids = None if learners is None else ",".join(map(str, sorted(set(learners))))
    try:
        _make_pair(d, name, d / "clients" / f"{name}.key", d / "secret" / f"{name}.key_secret", ids)
    except FileExistsError:
        raise ValueError(f"key {name!r} already exists in {d / 'clients'}") from None
    return next(k for k in _scan(d, "clients") if k.name == name)


def revoke(dir, name: str) -> KeyInfo:
    """Move clients/NAME.key to revoked/ so authenticators stop admitting it. Refuses
    (ValueError) a name that is not an allowed client key, naming the known ones."""
    d, name = Path(dir), check_name(name)
    _require_dir(d)
    src, dst = d / "clients" / f"{name}.key", d / "revoked" / f"{name}.key"
    if not src.is_file() and dst.is_file():
        raise ValueError(f"key {name!r} is already revoked ({dst})")
    if not src.is_file():
        raise ValueError(
            f"no client key {name!r} in {d / 'clients'} (known: "
            f"{', '.join(k.name for k in _scan(d, 'clients')) or 'none'})"
        )
    os.replace(src, dst)
    return next(k for k in _scan(d, "revoked") if k.name == name)


def list_keys(dir) -> list[KeyInfo]:
    """Every client key: the allowed ones (clients/), then the revoked ones, each by name."""
    return _scan(Path(dir), "clients") + _scan(Path(dir), "revoked")


def allowed(dir) -> dict[bytes, KeyInfo]:
    """z85 public key -> KeyInfo for clients/ only: what an authenticator admits. Reads one
    small file per key and makes no ZeroMQ calls, so it is cheap to call again."""
    return {k.public: k for k in _scan(Path(dir), "clients")}


def _pair(pub_path: Path, sec_path: Path, command: str, secret=True) -> tuple[bytes, bytes | None]:
    """load_certificate both halves; a missing file is named with the command that makes it."""
    for path in (pub_path, sec_path) if secret else (pub_path,):
        if not path.is_file():
            raise FileNotFoundError(f"missing key file {path}; create it with: {command}")
    public = zmq.auth.load_certificate(pub_path)[0]
    spub, sec = zmq.auth.load_certificate(sec_path) if secret else (public, None)
    if secret and (sec is None or spub != public):
        raise ValueError(f"{sec_path} holds no secret key for {pub_path}")
    return public, sec


def server_keys(dir, secret: bool = True) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 server keys of ``dir``; secret is None when ``secret`` is False."""
    d = Path(dir)
    return _pair(d / "server.key", d / "server.key_secret", f"rudra-zmq keys init {d}", secret)


def client_keys(dir, name: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of client ``name``; raises if missing or revoked."""
    d, name = Path(dir), check_name(name)
    if (d / "revoked" / f"{name}.key").is_file():
        raise ValueError(f"key {name!r} was revoked; add a new one: rudra-zmq keys add {d} NEW")
    return _pair(
        d / "clients" / f"{name}.key",
        d / "secret" / f"{name}.key_secret",
        f"rudra-zmq keys add {d} {name}",
    )


def make_run_keys(dir, names) -> None:
    """:func:`init` ``dir`` and :func:`add` each of ``names`` (``rudra-zmq run``'s keys)."""
    init(dir)
    for name in names:
        add(dir, name)


def cmd_keys(args) -> int:
    """Run one ``keys`` sub-command; a ValueError/OSError prints one line to stderr, returns 2."""
    try:
        if args.keys_command == "init":
            d = init(args.dir)
            print(
                f"initialized {d}: server key {server_keys(d, False)[0][:8].decode()}; "
                f"add clients with: rudra-zmq keys add {d} NAME"
            )
        elif args.keys_command == "add":
            ids = None if args.learners is None else parse_learners(args.learners)
            k = add(args.dir, args.name, ids)
            print(f"added {k.name} (may speak as {describe_senders(k.senders)}): {k.path}")
        elif args.keys_command == "revoke":
            print(f"revoked {args.name}: moved to {revoke(args.dir, args.name).path}")
        else:
            rows = [("NAME", "STATUS", "MAY SPEAK AS", "KEY")] + [
                (
                    k.name,
                    "revoked" if k.revoked else "allowed",
                    describe_senders(k.senders),
                    k.public[:8].decode(),
                )
                for k in list_keys(args.dir)
            ]
            widths = [max(len(r[i]) for r in rows) for i in range(4)]
            for r in rows:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return 0
    except (ValueError, OSError) as exc:
        print(f"rudra-zmq keys {args.keys_command}: error: {exc}", file=sys.stderr)
        return 2


def add_parser(sub) -> None:
    """Register ``rudra-zmq keys {init,add,revoke,list} DIR ...`` on the CLI's subparsers."""
    p = sub.add_parser(
        "keys",
        help="manage CurveZMQ keys (encrypted, allow-listed clients)",
        description="init makes DIR; add, revoke, list manage its clients",
    )
    ks = p.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    for cmd, text in {
        "init": "create DIR (0700) and the server key pair",
        "add": "create and allow client key NAME (learner-N, node-N, ps, other)",
        "revoke": "stop allowing client key NAME (moves it to revoked/)",
        "list": "list client keys: status, what each may speak as",
    }.items():
        q = ks.add_parser(cmd, help=text, description=text)
        q.add_argument("dir", metavar="DIR")
        if cmd in ("add", "revoke"):
            q.add_argument("name", metavar="NAME")
        if cmd == "add":
            q.add_argument("--learners", metavar="IDS", help="learner ids: 0,1,2 or 0-3")
        q.set_defaults(func=cmd_keys)
