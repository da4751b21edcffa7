"""The code's format and lint rules (ruff, configured in pyproject.toml) hold everywhere: a drift fails the suite, and
`ruff format . && ruff check --fix .` mends most of it."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def _ruff(*args: str) -> subprocess.CompletedProcess:
    beside = Path(sys.executable).with_name("ruff")  # the test extra's, in the venv that runs the tests
    ruff = str(beside) if beside.exists() else shutil.which("ruff") or "ruff"
    return subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)


def test_the_code_is_formatted_and_lint_clean():
    formatted = _ruff("format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    linted = _ruff("check", ".")
    assert linted.returncode == 0, linted.stdout + linted.stderr
