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


def _lf_adapter_imports(path: Path) -> set[str]:
    """The lf_adapter modules a file imports (relative imports resolved), at any depth of the file."""
    import ast

    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names] if not node.module or node.level else [module]
            found.update(n for n in [module, *names] if n.startswith("lf_adapter"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lf_adapter"))
    return found


def test_the_wings_do_not_lean_on_each_other_and_the_plugin_imports_only_what_runs_in_llamafactory():
    package = REPO / "lf_adapter"
    for wing, other in (("review", "run"), ("run", "review")):
        for path in (package / wing).rglob("*.py"):
            leaning = {m for m in _lf_adapter_imports(path) if m.startswith(f"lf_adapter.{other}")}
            assert not leaning, f"{path.relative_to(REPO)} imports {sorted(leaning)}"
    allowed = ("lf_adapter.plugin", "lf_adapter.nvml_session", "lf_adapter.catalog_dir")
    for path in (package / "plugin").rglob("*.py"):
        outside = {m for m in _lf_adapter_imports(path) if m != "lf_adapter" and not m.startswith(allowed)}
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"
