"""CurveZMQ for every socket of a run (``security.curve: true``): the "Ironhouse" pattern.

The server roles (PS, tree nodes, data and statistics servers, the adv* broadcast senders)
share one key pair; each client has its own, allow-listed in the key directory
(``security/keys.py``: ``rudra-zmq keys init/add/revoke/list``). In each process a ZAP handler
(pyzmq's authenticator) admits only allow-listed keys and names each connection by its key's
name: the ZMTP ``User-Id`` of every message it sends. Roles check that name against the
sender id each message claims (``may_speak``): a key made for learner 1 cannot speak as
learner 0, and a revoked key is refused from its next message on.

Fail closed: the handler is started before the first bind, every server socket sets
``ZAP_DOMAIN`` with ``ZAP_ENFORCE_DOMAIN``, and libzmq older than 4.3.5 (CURVE CVEs) is
refused. ``transport.bind``/``transport.connect`` apply this to every socket of the process
once ``transport.set_security`` was called.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .. import wire
from . import keys

MIN_LIBZMQ = (4, 3, 5)  # CURVE fixes: CVE-2019-6250 (4.3.1), CVE-2019-13132 (4.3.2), 4.3.5
ZAP_DOMAIN = b"rudra"
HANDSHAKE_MS = 5_000  # a peer that does not finish the handshake in 5 s is dropped
RELOAD_S = 1.0  # the allow-list is read again at most this often, if it changed


RUN_TOKEN_ENV = "RUDRA_ZMQ_RUN_TOKEN"  # set by `rudra-zmq run` for the roles it starts
KEYS_ENV = "RUDRA_ZMQ_KEYS"  # the key directory `rudra-zmq run` made (per run)


def new_run_token() -> str:
    """A random token the launcher gives the PS and the statistics server (environment):
    without CURVE it is how the statistics server knows a record really is the PS's."""
    return secrets.token_hex(16)


def run_token() -> str | None:
    """This process's run token, or None (a role started by hand)."""
    return os.environ.get(RUN_TOKEN_ENV) or None


def token_matches(given, expected: str) -> bool:
    """Constant-time comparison of a received token with ours."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


class SecurityError(RuntimeError):
    """CURVE cannot be used as configured; the message says why and what to do."""


def check_libzmq() -> None:
    """Raise SecurityError unless this libzmq has CURVE and is 4.3.5 or newer."""
    if zmq.zmq_version_info() < MIN_LIBZMQ:
        raise SecurityError(
            f"security.curve needs libzmq 4.3.5 or newer (earlier ones have CURVE CVEs); this "
            f"pyzmq uses libzmq {zmq.zmq_version()}: pip install -U pyzmq (its wheels bundle "
            "a current libzmq)"
        )
    if not zmq.has("curve"):
        raise SecurityError(
            f"libzmq {zmq.zmq_version()} was built without CURVE: install a "
            "pyzmq wheel (which has it) or rebuild libzmq with libsodium"
        )


def default_key_name(sender: int) -> str:
    """The client key a role uses by default: ``learner-N``, ``node-N`` or ``ps``."""
    if sender >= 0:
        return f"learner-{sender}"
    if wire.node_id(sender) is not None:
        return f"node-{wire.node_id(sender)}"
    return {wire.SENDER_PS: "ps"}.get(sender, "tool")


class AllowList:
    """The allow-listed client keys of a key directory, read again when ``clients/`` changes
    (looked at no more than every RELOAD_S). Thread-safe (the ZAP thread and a role read it)."""

    def __init__(self, keys_dir: Path):
        self._dir = Path(keys_dir) / "clients"
        self._lock = threading.Lock()
        self._by_key: dict = {}
        self._by_name: dict = {}
        self._mtime = None
        self._checked = 0.0
        self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RELOAD_S:
            return
        with self._lock:
            self._checked = now
            try:
                mtime = self._dir.stat().st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime == self._mtime and not force:
                return
            by_key = keys.allowed(self._dir.parent) if mtime is not None else {}
            self._by_key, self._mtime = by_key, mtime
            self._by_name = {info.name: info for info in by_key.values()}

    def name_of(self, z85_key: bytes) -> str | None:
        """The name of an allow-listed key (z85), or None."""
        self._refresh()
        info = self._by_key.get(z85_key)
        return None if info is None else info.name

    def senders_of(self, name: str | None):
        """The sender ids the key ``name`` may speak as (empty if unknown or revoked)."""
        self._refresh()
        info = self._by_name.get(name) if name else None
        return frozenset() if info is None else info.senders

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: admit allow-listed keys only."""
        return self.name_of(key) is not None


class _Authenticator(ThreadAuthenticator):
    """The ZAP handler of one context: names each connection by its key's name."""

    def __init__(self, ctx: zmq.Context, allow: AllowList):
        super().__init__(ctx)
        self._allow = allow

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._allow.name_of(z85.encode(client_public_key)) or ""


class Curve:
    """One process's CURVE settings: the key directory and, optionally, the client key name
    every client socket uses (default: the role's own, ``default_key_name``). Thread-safe."""

    def __init__(self, keys_dir, key_name: str | None = None):
        check_libzmq()
        self.dir = Path(keys_dir)
        if key_name is not None and not keys.is_key_name(key_name):
            raise SecurityError(f"--key {key_name!r} is not a key name (letters, digits, _ . -)")
        self.key_name = key_name
        self.server_public = keys.server_keys(self.dir, secret=False)[0]
        self.allow = AllowList(self.dir)
        self._server_secret: bytes | None = None
        self._auths: dict[int, tuple[zmq.Context, _Authenticator]] = {}
        self._lock = threading.Lock()

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before its bind) a CURVE server behind this context's ZAP handler,
        started first if need be (fail closed)."""
        if self._server_secret is None:
            self._server_secret = keys.server_keys(self.dir, secret=True)[1]
        self._authenticator(sock.context)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)

    def client(self, sock: zmq.Socket, sender: int) -> None:
        """Make ``sock`` (before its connect) a CURVE client with the key of ``sender``."""
        public, secret = keys.client_keys(self.dir, self.key_name or default_key_name(sender))
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)

    def may_speak(self, frame, sender: int) -> bool:
        """Whether the message ``frame`` belongs to came over a connection whose key may
        speak as ``sender`` (its ``User-Id``). Needs zero-copy frames (``zmq.Frame``)."""
        return sender in self.allow.senders_of(user_id(frame))

    def _authenticator(self, ctx: zmq.Context) -> None:
        with self._lock:
            if id(ctx) in self._auths:
                return
            auth = _Authenticator(ctx, self.allow)
            auth.start()
            auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self.allow)
            self._auths[id(ctx)] = (ctx, auth)

    def release(self, ctx: zmq.Context) -> None:
        """Stop ``ctx``'s ZAP handler (before ``ctx.term()``, which would wait for it)."""
        with self._lock:
            entry = self._auths.pop(id(ctx), None)
        if entry is not None:
            entry[1].stop()


def for_role(cfg, keys_dir: str | None, key_name: str | None) -> Curve:
    """The ``Curve`` of a role process: the key directory from ``--keys``, else the one
    ``rudra-zmq run`` made (environment), else ``security.keys``. Raises SecurityError
    (none given, old libzmq) or OSError/ValueError (a missing or bad key file)."""
    where = keys_dir or os.environ.get(KEYS_ENV) or cfg.security.keys
    if not where:
        raise SecurityError(
            "security.curve is on but no key directory was given: pass --keys "
            "DIR (made by `rudra-zmq keys init DIR`) or set security.keys"
        )
    return Curve(where, key_name)


def user_id(frame) -> str | None:
    """The ZMTP User-Id (the key's name) of a received zero-copy frame, or None."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
