"""The emulated LAN's hosts for ``bench lan-table1`` and ``bench lan-overlap``: where
``bench/lan/netns.sh`` is, whether this machine can run it, and the namespaces it builds (up
on enter, down on exit: after an error or Ctrl-C too). Needs root and ``ip netns``."""

from __future__ import annotations

import os
import shutil
import subprocess

from . import synthetic_cluster as sc

NETNS_SH = os.path.join("bench", "lan", "netns.sh")  # in the source tree


def find_netns_sh() -> str | None:
    """``bench/lan/netns.sh`` of the source tree this package runs from, or under the current
    directory; None if neither exists."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.path.join(repo, NETNS_SH), os.path.abspath(NETNS_SH)):
        if os.path.isfile(path):
            return path
    return None


def lan_available() -> str | None:
    """None if this machine can build the emulated LAN, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


class Lan:
    """``netns.sh up`` on enter, ``down`` on exit (also after an error or Ctrl-C)."""

    def __init__(self, n_hosts: int, rate: str, netns_sh: str):
        self.n, self.rate, self.sh = n_hosts, rate, netns_sh
        self.prefix = f"rzt{os.getpid() % 1_000_000}"
        self.hosts: list[sc.Host] = []

    def __enter__(self):
        res = subprocess.run(
            [self.sh, "up", str(self.n), self.rate, "--prefix", self.prefix],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode != 0:
            raise RuntimeError(f"netns.sh up failed (exit {res.returncode}): {res.stderr}")
        for ln in res.stdout.splitlines():
            _, _i, ns, addr = ln.split()
            self.hosts.append(sc.Host(ns, addr))
        return self

    def __exit__(self, *exc):
        subprocess.run([self.sh, "down", "--prefix", self.prefix], timeout=120)
