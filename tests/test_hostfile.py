"""rudra_zmq.launch.hostfile: the hostfile, -H and --include/--exclude forms of Open MPI, DeepSpeed
and Horovod, read exactly; every error names where it was and quotes the bad text."""

import socket
import time
from pathlib import Path

import pytest

from rudra_zmq.launch import hostfile
from rudra_zmq.launch.hostfile import (
    Host,
    HostfileError,
    describe,
    is_local,
    load,
    parse_hostfile,
    parse_hosts_arg,
    select,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(30)


def H(name, n):
    """A host with slots 0..n-1."""
    return Host(name, tuple(range(n)))


# --- parse_hostfile: what it accepts ---------------------------------------------------------

ACCEPTED = [
    ("node1 slots=4", [H("node1", 4)]),  # Open MPI / DeepSpeed
    ("node1:4", [H("node1", 4)]),  # Horovod / MPICH
    ("node1", [H("node1", 1)]),  # Open MPI bare host
    ("node1 slots=2 max_slots=8", [H("node1", 2)]),  # max_slots ignored
    ("node1 max_slots=8 slots=2", [H("node1", 2)]),
    ("node1:3 max_slots=3", [H("node1", 3)]),
    ("node1 slots = 4", [H("node1", 4)]),  # spaces around '='
    ("  \tnode1 \t slots=4  \t", [H("node1", 4)]),  # surrounding whitespace
    ("node1 slots=4 # four GPUs", [H("node1", 4)]),  # trailing comment
    ("node1 slots=4#no space", [H("node1", 4)]),
    ("# a comment\n\n   \nnode1\n  # indented comment\n", [H("node1", 1)]),
    ("a slots=1\r\nb:2\r\n", [H("a", 1), H("b", 2)]),  # CRLF
    ("gpu-01.cluster.example_org slots=2", [H("gpu-01.cluster.example_org", 2)]),
    ("10.0.0.7 slots=2", [H("10.0.0.7", 2)]),  # IPv4
    ("10.0.0.7:2", [H("10.0.0.7", 2)]),
    ("[fd00::7] slots=2", [H("fd00::7", 2)]),  # IPv6 in brackets
    ("[fd00::7]:2", [H("fd00::7", 2)]),
    ("[FD00:0:0::7]", [H("fd00::7", 1)]),  # kept compressed
    ("fd00::7 slots=3", [H("fd00::7", 3)]),  # bare IPv6
    ("::1", [H("::1", 1)]),
    ("fe80::1%eth0 slots=2", [H("fe80::1%eth0", 2)]),  # IPv6 with a zone
    ("c:2\na slots=1\nb", [H("c", 2), H("a", 1), H("b", 1)]),  # order kept
    (f"big slots={hostfile.MAX_SLOTS}", [H("big", hostfile.MAX_SLOTS)]),
]


@pytest.mark.parametrize("text, hosts", ACCEPTED)
def test_parse_hostfile_reads_each_accepted_form(text, hosts):
    assert parse_hostfile(text) == hosts


# --- parse_hostfile: what it refuses, and the message -----------------------------------------

REFUSED = [  # (text, line number, bad text quoted, what the message says)
    ("a slots=0", 1, "'slots=0'", "bad slot count"),
    ("a slots=x", 1, "'slots=x'", "bad slot count"),
    ("a slots=", 1, "'slots='", "bad slot count"),
    ("a slots=-2", 1, "'slots=-2'", "bad slot count"),
    ("a slots=2.5", 1, "'slots=2.5'", "bad slot count"),
    (f"a slots={hostfile.MAX_SLOTS + 1}", 1, f"'slots={hostfile.MAX_SLOTS + 1}'", "from 1 to"),
    ("a slots=" + "9" * 5000, 1, "bad slot count", "from 1 to"),  # no int() overflow
    ("a:0", 1, "'a:0'", "bad slot count"),
    ("a:x", 1, "'a:x'", "bad slot count"),
    ("a:", 1, "'a:'", "bad slot count"),
    ("a max_slots=x", 1, "'max_slots=x'", "bad slot count"),
    ("ok\n\nb slots=4 gpus=2", 3, "'gpus=2'", "unexpected"),  # junk token
    ("a slots=4 extra", 1, "'extra'", "unexpected"),
    ("a slot=4", 1, "'slot=4'", "unexpected"),
    ("a:2 slots=2", 1, "'slots=2'", "given twice"),
    ("a slots=2 slots=3", 1, "'slots=3'", "given twice"),
    ("slots=4", 1, "'slots=4'", "bad host name"),  # host missing
    ("user@node1 slots=2", 1, "'user@node1'", "bad host name"),
    ("-oProxyCommand=x", 1, "'-oProxyCommand=x'", "bad host name"),  # never an ssh option
    (".hidden", 1, "'.hidden'", "bad host name"),
    ("nöde slots=2", 1, "'nöde'", "bad host name"),
    ("a/b", 1, "'a/b'", "bad host name"),
    (":2", 1, "':2'", "no host name"),
    ("999.1.1.1 slots=2", 1, "'999.1.1.1'", "not a valid IPv4 address"),
    ("10.0.0 slots=2", 1, "'10.0.0'", "not a valid IPv4 address"),
    ("fd00::zz slots=2", 1, "'fd00::zz'", "not a valid IPv6 address"),
    ("[fd00::7", 1, "'[fd00::7'", "bad bracketed address"),
    ("[fd00::7]2", 1, "'[fd00::7]2'", "bad bracketed address"),
    ("[node1]", 1, "'[node1]'", "brackets are for IPv6"),
    ("[]:2", 1, "'[]:2'", "no host name"),
    ("fe80::1%$(reboot)", 1, "'fe80::1%$(reboot)'", "bad IPv6 zone"),
    ("fe80::1%a/b", 1, "'fe80::1%a/b'", "not a valid IPv6 address"),
]


@pytest.mark.parametrize("text, line, bad, what", REFUSED)
def test_parse_hostfile_error_names_line_quotes_text_and_expected_form(text, line, bad, what):
    with pytest.raises(HostfileError) as e:
        parse_hostfile(text, source="hosts.txt")
    msg = str(e.value)
    assert msg.startswith(f"hosts.txt:{line}: "), msg
    assert bad in msg and what in msg, msg
    assert "expected 'host slots=N'" in msg, msg


def test_a_host_listed_twice_is_an_error_naming_both_lines():
    with pytest.raises(HostfileError) as e:
        parse_hostfile("a slots=2\n# b\nb:1\na slots=2\n", source="hosts.txt")
    msg = str(e.value)
    assert msg.startswith("hosts.txt:4: host 'a' is listed twice (first on line 1)"), msg
    assert "DeepSpeed" in msg


def test_the_same_ipv6_address_written_two_ways_is_a_duplicate():
    with pytest.raises(
        HostfileError,
        match=r"hosts:2: host 'fd00::7' is listed twice "
        r"\(first on line 1\)",
    ):
        parse_hostfile("[fd00::7]:2\nfd00:0::7\n", source="hosts")


@pytest.mark.parametrize("text", ["", "\n\n", "# only comments\n   # here\n"])
def test_a_hostfile_without_hosts_is_an_error(text):
    with pytest.raises(HostfileError, match=r"^hosts.txt: no hosts .*expected 'host slots=N'"):
        parse_hostfile(text, source="hosts.txt")


def test_the_default_source_is_named_hostfile():
    with pytest.raises(HostfileError, match=r"^hostfile:1: "):
        parse_hostfile("a slots=0")


# --- -H ---------------------------------------------------------------------------------------

HOSTS_ARGS = [
    ("a:2,b:4", [H("a", 2), H("b", 4)]),
    ("a", [H("a", 1)]),
    ("a,b:3,c", [H("a", 1), H("b", 3), H("c", 1)]),
    (" a:2 , b ", [H("a", 2), H("b", 1)]),
    ("10.0.0.1:2,[fd00::1]:3,::1", [H("10.0.0.1", 2), H("fd00::1", 3), H("::1", 1)]),
    ("localhost:8", [H("localhost", 8)]),
]


@pytest.mark.parametrize("text, hosts", HOSTS_ARGS)
def test_parse_hosts_arg_reads_horovod_form(text, hosts):
    assert parse_hosts_arg(text) == hosts


HOSTS_ARGS_REFUSED = [
    ("a:2,b:x", "bad slot count 'b:x'"),
    ("a:0", "bad slot count 'a:0'"),
    ("a:2,,b", "an empty entry"),
    ("", "an empty entry"),
    ("a:2,a:3", "host 'a' is listed twice"),
    ("a b:2", "bad host name 'a b'"),
    ("a:2:3", "'a:2:3' is not a valid IPv6 address"),  # 2+ colons: a bare IPv6
]


@pytest.mark.parametrize("text, what", HOSTS_ARGS_REFUSED)
def test_parse_hosts_arg_errors_quote_the_argument_and_the_bad_entry(text, what):
    with pytest.raises(HostfileError) as e:
        parse_hosts_arg(text)
    msg = str(e.value)
    assert msg.startswith(f"-H {text!r}: "), msg
    assert what in msg, msg


# --- --include / --exclude ----------------------------------------------------------------------

CLUSTER = [H("a", 2), H("b", 4), H("c", 2), H("fd00::7", 2)]

SELECTED = [
    (None, None, CLUSTER),
    ("a", None, [H("a", 2)]),
    ("c@a", None, [H("a", 2), H("c", 2)]),  # order of the list
    ("b:1,3", None, [Host("b", (1, 3))]),
    ("b:3,1,3", None, [Host("b", (1, 3))]),  # sorted, unique
    ("a:0@b:2@a:1", None, [H("a", 2), Host("b", (2,))]),  # a host named twice
    ("b:1@b", None, [H("b", 4)]),
    ("[fd00::7]:1", None, [Host("fd00::7", (1,))]),
    ("fd00::7", None, [H("fd00::7", 2)]),
    (" a @ b: 0, 1 ", None, [H("a", 2), Host("b", (0, 1))]),
    (None, "a", [H("b", 4), H("c", 2), H("fd00::7", 2)]),
    (None, "b:0,2@c", [H("a", 2), Host("b", (1, 3)), H("fd00::7", 2)]),
    (None, "a:0@a:1", [H("b", 4), H("c", 2), H("fd00::7", 2)]),  # no slots left: dropped
    (None, "[fd00:0::7]:0", [H("a", 2), H("b", 4), H("c", 2), Host("fd00::7", (1,))]),
]


@pytest.mark.parametrize("include, exclude, hosts", SELECTED)
def test_select_keeps_what_include_names_or_exclude_leaves(include, exclude, hosts):
    assert select(CLUSTER, include=include, exclude=exclude) == hosts


def test_select_applies_to_an_already_selected_list():
    some = [Host("b", (1, 3))]
    assert select(some, include="b:3") == [Host("b", (3,))]
    with pytest.raises(HostfileError, match=r"host 'b' has no slot 0 \(its slots: 1, 3\)"):
        select(some, exclude="b:0")


SELECT_REFUSED = [
    ("x", None, "--include 'x': host 'x' is not in the host list (known: a, b, c, fd00::7)"),
    (None, "a@x:1", "--exclude 'a@x:1': host 'x' is not in the host list"),
    ("b:4", None, "--include 'b:4': host 'b' has no slot 4 (its slots: 0, 1, 2, 3)"),
    (None, "c:0,5", "host 'c' has no slot 5 (its slots: 0, 1)"),
    ("b:x", None, "bad slot index 'x' in 'b:x'"),
    ("b:", None, "bad slot index '' in 'b:'"),
    ("b:1,,2", None, "bad slot index ''"),
    ("a@@b", None, "an empty host entry"),
    ("", None, "--include '': an empty host entry"),
    ("a", "b", "--include 'a' and --exclude 'b' were both given"),
    (
        None,
        "a@b@c@fd00::7",
        "--exclude 'a@b@c@fd00::7' leaves no slots to launch on "
        "(it excludes all 10 slots of the 4 hosts)",
    ),
]


@pytest.mark.parametrize("include, exclude, what", SELECT_REFUSED)
def test_select_errors_name_the_flag_and_the_bad_host_or_slot(include, exclude, what):
    with pytest.raises(HostfileError) as e:
        select(CLUSTER, include=include, exclude=exclude)
    assert what in str(e.value), str(e.value)


def test_select_lists_at_most_ten_known_hosts():
    many = [H(f"n{i}", 1) for i in range(25)]
    with pytest.raises(HostfileError, match=r"known: n0, n1, .*, n9, \.\.\. \(15 more\)\)"):
        select(many, include="zz")


# --- is_local -----------------------------------------------------------------------------------


@pytest.fixture
def this_machine(monkeypatch):
    """This machine is 'box' / 'box.lab.example'; the cached names are reset around the test."""
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "box.lab.example")
    hostfile._local_names.cache_clear()
    yield
    hostfile._local_names.cache_clear()


LOCALITY = [
    ("localhost", True),
    ("LOCALHOST", True),
    ("localhost.", True),
    ("127.0.0.1", True),
    ("127.4.5.6", True),
    ("::1", True),
    ("[::1]", True),
    ("0:0:0:0:0:0:0:1", True),
    ("::ffff:127.0.0.1", True),
    ("box", True),
    ("BOX", True),
    ("box.lab.example", True),
    ("box.lab.example.", True),
    ("box2", False),
    ("box.other.example", False),
    ("node1", False),
    ("localhost2", False),
    ("10.0.0.7", False),
    ("128.0.0.1", False),
    ("fd00::7", False),
    ("::", False),
    ("0.0.0.0", False),
]


@pytest.mark.parametrize("name, local", LOCALITY)
def test_is_local(this_machine, name, local):
    assert is_local(name) is local


def test_is_local_does_not_wait_long_for_a_slow_resolver(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(socket, "getfqdn", lambda *a: time.sleep(5) or "box.slow")
    monkeypatch.setattr(hostfile, "FQDN_TIMEOUT_S", 0.1)
    hostfile._local_names.cache_clear()
    try:
        start = time.monotonic()
        assert is_local("box") and not is_local("box.slow")
        assert time.monotonic() - start < 2
    finally:
        hostfile._local_names.cache_clear()


def test_is_local_knows_the_real_hostname():
    hostfile._local_names.cache_clear()
    assert is_local(socket.gethostname())


# --- load ---------------------------------------------------------------------------------------


def test_load_reads_a_file_then_selects(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("\ufeffa slots=2\nb:4\n", encoding="utf-8")  # a BOM is not a host
    assert load(path) == [H("a", 2), H("b", 4)]
    assert load(str(path), exclude="b:0") == [H("a", 2), Host("b", (1, 2, 3))]


def test_load_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("a slots=2\nb slots=zero\n")
    with pytest.raises(HostfileError, match=rf"^{path}:2: bad slot count 'slots=zero'"):
        load(path)


def test_load_reads_hosts_arg():
    assert load(hosts_arg="a:2,b", include="a:1") == [Host("a", (1,))]


@pytest.mark.parametrize(
    "make",
    [
        lambda d: d / "missing.txt",  # no such file
        lambda d: d,  # a directory
        lambda d: (d / "bin").write_bytes(b"\xff\xfe a") and d / "bin",  # not UTF-8
    ],
)
def test_load_refuses_a_file_it_cannot_read_naming_the_path(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(HostfileError, match=rf"^cannot read hostfile '{path}': "):
        load(path)


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({}, "no hosts given: pass --hostfile F or -H host1:N,host2:M"),
        (
            {"path": "h", "hosts_arg": "a:1"},
            "both a hostfile and -H were given: pass --hostfile F or -H host1:N,host2:M, not both",
        ),
    ],
)
def test_load_needs_exactly_one_source(kwargs, what):
    with pytest.raises(HostfileError) as e:
        load(**kwargs)
    assert str(e.value) == what


# --- describe, Host, the example ---------------------------------------------------------------


@pytest.mark.parametrize(
    "hosts, line",
    [
        ([H("a", 2), H("b", 2), H("c", 2)], "3 hosts, 6 slots: a (2), b (2), c (2)"),
        ([H("a", 1)], "1 host, 1 slot: a (1)"),
        ([Host("b", (1, 3)), H("c", 4)], "2 hosts, 6 slots: b (slots 1,3), c (4)"),
    ],
)
def test_describe(hosts, line):
    assert describe(hosts) == line


def test_host_counts_its_slots_and_checks_them():
    assert Host("a", (1, 3)).count == 2
    assert Host("a", [0, 1]).slots == (0, 1)
    with pytest.raises(ValueError, match="ascending, unique"):
        Host("a", (1, 0))
    with pytest.raises(ValueError, match="ascending, unique"):
        Host("a", (0, 0))


def test_the_example_hostfile_parses_to_its_three_hosts():
    path = ROOT / "examples" / "hostfile"
    assert load(path) == [H("node1", 4), H("node2", 2), H("10.0.0.7", 2)]
    assert describe(load(path)) == "3 hosts, 8 slots: node1 (4), node2 (2), 10.0.0.7 (2)"
    assert load(path, exclude="node2") == [H("node1", 4), H("10.0.0.7", 2)]
    assert load(path, include="node1:0,1") == [H("node1", 2)]
