"""`rudra_zmq.security.keys`: the CurveZMQ key directory, its sender rules, `rudra-zmq keys`, and a
CURVE handshake made with its keys."""

import argparse
import os
import stat

import pytest
import zmq
import zmq.auth.thread

from rudra_zmq import wire
from rudra_zmq.security import keys

pytestmark = pytest.mark.timeout(60)


def mode(path):
    """The permission bits of ``path``."""
    return stat.S_IMODE(os.stat(path).st_mode)


def run_cli(argv, capsys):
    """Run `rudra-zmq keys ARGV` through add_parser; return (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="rudra-zmq")
    keys.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["keys", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_init_and_add_make_the_layout_with_private_modes(tmp_path):
    d = tmp_path / "keys"
    umask = os.umask(0o022)  # a permissive umask must not leak into secrets
    try:
        assert keys.init(d) == d
        keys.add(d, "learner-0")
        assert os.umask(0o022) == 0o022  # restored after each call
    finally:
        os.umask(umask)
    for sub in ("", "clients", "secret", "revoked"):
        assert mode(d / sub) == 0o700, sub
    assert mode(d / "server.key_secret") == 0o600
    assert mode(d / "secret" / "learner-0.key_secret") == 0o600
    assert (d / "server.key").is_file() and (d / "clients" / "learner-0.key").is_file()
    assert sorted(p.name for p in d.iterdir()) == [
        "clients",
        "revoked",
        "secret",
        "server.key",
        "server.key_secret",
    ]  # no staging left
    pub, sec = keys.server_keys(d)
    assert len(pub) == 40 and len(sec) == 40 and keys.server_keys(d, secret=False) == (pub, None)
    cpub, csec = keys.client_keys(d, "learner-0")
    assert zmq.auth.load_certificate(d / "clients" / "learner-0.key") == (cpub, None)
    assert cpub != pub and len(csec) == 40
    with pytest.raises(ValueError, match="already holds a server key"):
        keys.init(d)


def test_senders_follow_the_name_and_the_learners_metadata(tmp_path):
    d = keys.init(tmp_path / "k")
    assert keys.add(d, "learner-3").senders == {3}
    assert keys.add(d, "node-1").senders == {wire.node_sender(1)}
    assert keys.add(d, "ps").senders == {wire.SENDER_PS}
    assert keys.add(d, "worker").senders == frozenset()
    assert keys.add(d, "learner-5", learners=[1, 0]).senders == {0, 1}  # replaces {5}
    assert keys.add(d, "host-a", learners=[2, 3, 2]).senders == {2, 3}
    assert keys.add(d, "node-2", learners=[7]).senders == {wire.node_sender(2), 7}
    assert keys.add(d, "learner-6", learners=[]).senders == frozenset()
    # stored in the public certificate's metadata, and read back from there
    text = (d / "clients" / "learner-5.key").read_text()
    assert 'metadata\n    learners = "0,1"\ncurve\n' in text
    assert keys.stored_learners(d / "clients" / "learner-5.key") == [0, 1]
    assert keys.stored_learners(d / "secret" / "learner-5.key_secret") == [0, 1]
    assert keys.stored_learners(d / "clients" / "learner-3.key") is None
    again = {k.name: k.senders for k in keys.list_keys(d)}
    assert again["learner-5"] == {0, 1} and again["node-2"] == {wire.node_sender(2), 7}
    assert again["learner-6"] == frozenset() and again["learner-3"] == {3}
    with pytest.raises(ValueError, match="bad learner ids"):
        keys.add(d, "x", learners=[-1])


def test_parse_and_describe_learners():
    assert keys.parse_learners("0,1,2") == [0, 1, 2]
    assert keys.parse_learners("0-3") == [0, 1, 2, 3]
    assert keys.parse_learners("5, 0-1,1") == [0, 1, 5]
    for bad in ("a", "3-1", "-1", "1-x", "1-"):
        with pytest.raises(ValueError, match="bad learner ids"):
            keys.parse_learners(bad)
    assert keys.describe_senders({3}) == "learner 3"
    assert keys.describe_senders({wire.node_sender(1)}) == "tree node 1"
    assert keys.describe_senders({wire.SENDER_PS}) == "parameter server"
    assert keys.describe_senders(set()) == "-"
    assert keys.describe_senders({wire.node_sender(0), 2, 1}) == "learner 1, learner 2, tree node 0"


def test_revoke_moves_the_key_out_of_allowed(tmp_path):
    d = keys.init(tmp_path / "k")
    a, b = keys.add(d, "learner-0"), keys.add(d, "learner-1")
    assert set(keys.allowed(d)) == {a.public, b.public}
    assert keys.allowed(d)[a.public] == a
    info = keys.revoke(d, "learner-0")
    assert info.revoked and info.path == d / "revoked" / "learner-0.key" and info.public == a.public
    assert not (d / "clients" / "learner-0.key").exists()
    assert list(keys.allowed(d)) == [b.public]
    assert [(k.name, k.revoked) for k in keys.list_keys(d)] == [
        ("learner-1", False),
        ("learner-0", True),
    ]
    with pytest.raises(ValueError, match="already revoked"):
        keys.revoke(d, "learner-0")
    with pytest.raises(ValueError, match=r"'nobody'.*known: learner-1"):
        keys.revoke(d, "nobody")
    with pytest.raises(ValueError, match="was revoked"):
        keys.client_keys(d, "learner-0")


def test_bad_names_and_double_add_are_refused_naming_the_value(tmp_path):
    d = keys.init(tmp_path / "k")
    for bad in ("", "-x", ".hidden", "a/b", "../up", "x" * 65, "sp ace"):
        with pytest.raises(ValueError) as exc:
            keys.add(d, bad)
        assert repr(bad) in str(exc.value) and keys.NAME_RULE in str(exc.value)
    keys.add(d, "x" * 64)
    keys.add(d, "learner-0")
    with pytest.raises(ValueError, match=r"'learner-0' already exists in .*clients"):
        keys.add(d, "learner-0")
    keys.revoke(d, "learner-0")
    with pytest.raises(ValueError, match=r"'learner-0' already exists in .*revoked"):
        keys.add(d, "learner-0")


def test_missing_files_name_the_command_that_creates_them(tmp_path):
    d = tmp_path / "none"
    with pytest.raises(FileNotFoundError, match=f"rudra-zmq keys init {d}"):
        keys.server_keys(d)
    with pytest.raises(FileNotFoundError, match=f"rudra-zmq keys init {d}"):
        keys.add(d, "learner-0")
    keys.init(d)
    missing = f"learner-9.key; create it with: rudra-zmq keys add {d} learner-9"
    with pytest.raises(FileNotFoundError, match=missing):
        keys.client_keys(d, "learner-9")
    keys.add(d, "learner-9")
    (d / "secret" / "learner-9.key_secret").unlink()
    with pytest.raises(FileNotFoundError, match="learner-9.key_secret; .*rudra-zmq keys add"):
        keys.client_keys(d, "learner-9")


def test_make_run_keys(tmp_path):
    keys.make_run_keys(tmp_path / "run", ["ps", "learner-0", "learner-1"])
    assert [k.name for k in keys.list_keys(tmp_path / "run")] == ["learner-0", "learner-1", "ps"]


def test_cli_init_add_revoke_list(tmp_path, capsys):
    d = str(tmp_path / "k")
    rc, out, _ = run_cli(["init", d], capsys)
    assert rc == 0 and f"rudra-zmq keys add {d} NAME" in out
    for name in ("learner-3", "node-1", "ps", "tool", "learner-0"):
        assert run_cli(["add", d, name], capsys)[0] == 0
    rc, out, _ = run_cli(["add", d, "multi", "--learners", "0-2"], capsys)
    assert rc == 0 and "learner 0, learner 1, learner 2" in out
    assert run_cli(["revoke", d, "learner-0"], capsys)[0] == 0
    rc, out, err = run_cli(["list", d], capsys)
    assert rc == 0 and err == ""
    lines = [line.split("  ") for line in out.splitlines()]
    rows = {cells[0]: [c.strip() for c in cells[1:] if c.strip()] for cells in lines}
    assert list(rows) == ["NAME", "learner-3", "multi", "node-1", "ps", "tool", "learner-0"]
    fp = keys.client_keys(d, "learner-3")[0][:8].decode()
    assert rows["learner-3"] == ["allowed", "learner 3", fp]
    assert rows["node-1"][:2] == ["allowed", "tree node 1"]
    assert rows["ps"][:2] == ["allowed", "parameter server"]
    assert rows["tool"][:2] == ["allowed", "-"]
    assert rows["learner-0"][:2] == ["revoked", "learner 0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["add", "{d}", "bad/name"], "bad key name 'bad/name'"),
        (["add", "{d}", "learner-3"], "'learner-3' already exists"),
        (["add", "{d}", "x", "--learners", "1-"], "bad learner ids '1-'"),
        (["revoke", "{d}", "nobody"], "known: learner-3"),
        (["init", "{d}"], "already holds a server key"),
        (["list", "{d}/missing"], "rudra-zmq keys init"),
    ],
)
def test_cli_errors_print_one_line_and_return_2(tmp_path, capsys, argv, message):
    d = tmp_path / "k"
    keys.make_run_keys(d, ["learner-3"])
    rc, out, err = run_cli([a.format(d=d) for a in argv], capsys)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err and err.startswith("rudra-zmq keys ")


def curve_pair(ctx, d, client_keys):
    """A bound CURVE ROUTER with ``d``'s server keys and a DEALER connected to it with
    ``client_keys`` (public, secret)."""
    spub, ssec = keys.server_keys(d)
    router = ctx.socket(zmq.ROUTER)
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, spub, ssec
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.curve_publickey, dealer.curve_secretkey = client_keys
    dealer.curve_serverkey = keys.server_keys(d, secret=False)[0]
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def test_curve_handshake_with_the_directory_keys(tmp_path):
    d = tmp_path / "k"
    keys.make_run_keys(d, ["learner-0"])
    ctx = zmq.Context()
    try:
        router, dealer = curve_pair(ctx, d, keys.client_keys(d, "learner-0"))
        dealer.send(b"hello")
        assert router.poll(5000), "no message through the CURVE connection"
        ident, msg = router.recv_multipart()
        assert msg == b"hello"
        router.send_multipart([ident, b"welcome"])
        assert dealer.poll(5000) and dealer.recv() == b"welcome"
        for s in (router, dealer):
            s.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_an_authenticator_using_allowed_refuses_a_revoked_key(tmp_path):
    d = tmp_path / "k"
    keys.make_run_keys(d, ["learner-0", "learner-1"])
    pairs = {n: keys.client_keys(d, n) for n in ("learner-0", "learner-1")}
    keys.revoke(d, "learner-1")  # its holder still has the (now refused) keys
    keys.add(d, "learner-2")  # added later: allowed() re-reads the directory
    pairs["learner-2"] = keys.client_keys(d, "learner-2")

    class Allowed:
        """ZAP credentials: admit exactly the keys in clients/ (re-read on every check)."""

        def callback(self, domain, key):
            return key in keys.allowed(d)

    ctx = zmq.Context()
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    try:
        auth.configure_curve_callback("*", credentials_provider=Allowed())
        for name, admitted in (("learner-0", True), ("learner-2", True), ("learner-1", False)):
            router, dealer = curve_pair(ctx, d, pairs[name])
            dealer.send(name.encode())
            got = router.poll(5000 if admitted else 500)
            assert bool(got) == admitted, name
            if got:
                assert router.recv_multipart()[1] == name.encode()
            for s in (router, dealer):
                s.close(linger=0)
    finally:
        auth.stop()
        ctx.destroy(linger=0)
