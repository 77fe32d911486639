"""Whether tests that build network namespaces (``ip netns``) can run here."""

import os
import shutil
import subprocess


def netns_missing(*tools: str) -> str | None:
    """Why network-namespace tests cannot run on this machine (not root, ``ip`` or one of
    ``tools`` not installed, ``ip netns`` not working), or None. Runs ``ip netns list``."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None
