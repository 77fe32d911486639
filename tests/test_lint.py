"""The code is linted and formatted as pyproject.toml's [tool.ruff] says (issue 23): `ruff
check` and `ruff format --check` over the repository, run by the suite so that `.ci/run` and the
README's test command check them. ruff comes with the test extra; without it this fails."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    assert Path(exe).exists(), "ruff is not installed: pip install -e '.[test]' brings it"
    return [exe]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_passes(args):
    done = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"ruff {' '.join(args)} failed (ruff check --fix . / ruff format . mend most):\n"
        f"{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )
