"""What a run may write into: lfa never writes into a folder it did not create. output_dir is this run's when it is
new, empty, or carries the marker lfa wrote at its first use; the root, the home folder, a repository root and the
folders above the recipe are never an output_dir. Pure checks, used by `lfa train` (before anything is written) and
`lfa review`."""

from __future__ import annotations

import json
from pathlib import Path

LEDGER_NAME = "ledger.json"
SUPERVISOR_FILE = "supervisor.pid"  # a detached run's supervisor (its ProcessRecord as JSON) until the ledger exists

MARKER = ".lfa-output.json"  # written into output_dir at first use: which run owns it
# what lfa itself leaves in an output_dir before the marker existed: its locks
LFA_FILES = (".lfa-train.lock",)


def forbidden_output_dir(output_dir: Path, recipe_folder: Path, home: Path | None = None) -> str | None:
    """Why output_dir can never be a training output folder, or None."""
    output_dir, recipe_folder = output_dir.resolve(), recipe_folder.resolve()
    if home is None:
        try:
            home = Path.home()
        except (KeyError, RuntimeError):  # no HOME and no passwd entry
            home = Path(output_dir.anchor)
    home = home.resolve()
    if output_dir == Path(output_dir.anchor):
        return "the file system's root"
    if output_dir == home:
        return "your home folder"
    if (output_dir / ".git").exists():
        return "a repository's root"
    if output_dir == recipe_folder or output_dir in recipe_folder.parents:
        return "the recipe's own folder or one above it"
    return None


def read_marker(output_dir: Path) -> dict | None:
    try:
        data = json.loads((output_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def foreign_entries(output_dir: Path) -> list[str]:
    """What output_dir holds besides lfa's own lock and marker (sorted names; empty when it does not exist)."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in output_dir.iterdir()
        if p.name not in (MARKER, *LFA_FILES) and not p.name.startswith(".lfa-train")
    )


def output_dir_problem(
    output_dir: Path, recipe_folder: Path, run_dir: Path, run_has_history: bool, shared: bool = False
) -> str | None:
    """One message when `lfa train` must not use output_dir, else None. run_has_history: this run folder's ledger
    already recorded attempts (a run from before markers existed adopts its own output_dir). shared: a node of a
    multi-node run, whose nodes share output_dir under their own run folders."""
    where = forbidden_output_dir(output_dir, recipe_folder)
    if where:
        return (
            f"output_dir {output_dir} is {where}: LLaMA-Factory would write checkpoints and overwrite files there; "
            "point output_dir at a new folder (e.g. saves/<task>)"
        )
    if output_dir.exists() and not output_dir.is_dir():
        return f"output_dir {output_dir} is a file, not a folder"
    marker = read_marker(output_dir)
    if marker is not None:
        owner = marker.get("run_dir")
        if owner and not shared and Path(owner).resolve() != run_dir.resolve():
            return (
                f"output_dir {output_dir} belongs to run {owner}: resume that run (lfa train RECIPE --run-dir "
                f"{owner}) or give this one its own output_dir"
            )
        return None
    entries = foreign_entries(output_dir)
    if entries and not run_has_history:
        return (
            f"output_dir {output_dir} already holds files lfa did not write ({_shown(entries)}); LLaMA-Factory would "
            "overwrite them. Point output_dir at a new or empty folder"
        )
    return None


def claim_output_dir(output_dir: Path, run_dir: Path, recipe: Path) -> None:
    """Create output_dir if needed and mark it as this run's (once)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if read_marker(output_dir) is None:
        (output_dir / MARKER).write_text(
            json.dumps({"run_dir": str(run_dir.resolve()), "recipe": str(recipe.resolve())}) + "\n"
        )


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `lfa train` must not record a run in run_dir (followed through symlinks): an existing folder that holds
    files but no run of lfa's (no ledger, no detached supervisor's record)."""
    if not run_dir.is_dir() or any((run_dir / name).is_file() for name in (LEDGER_NAME, SUPERVISOR_FILE)):
        return None
    if generated_by_lfa(run_dir / "launch.sh"):  # a recipe folder lfa generate made
        return None
    # lfa's own: the lock and the ledger's reserve (a supervisor that stopped before writing a ledger leaves them)
    entries = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".lfa-"))
    if not entries:
        return None
    return (
        f"run folder {run_dir} already holds files lfa did not write ({_shown(entries)}); "
        "pass --run-dir a new or empty folder, or --name another run name"
    )


def generated_by_lfa(path: Path) -> bool:
    """Whether path is a file lfa generate wrote (its header says so in the first lines)."""
    try:
        with path.open(errors="replace") as fh:
            return any(line.startswith("# Generated by lfa") for line in (fh.readline(), fh.readline()))
    except OSError:
        return False


REPORT_MARK = '<meta name="generator" content="lfa report">'  # in every report.html lfa writes


def report_dir_problem(out_dir: Path) -> str | None:
    """Why `lfa report --out` must not write into out_dir (followed through symlinks): a file, or a folder that
    holds files but no report of lfa's."""
    if out_dir.exists() and not out_dir.is_dir():
        return f"--out {out_dir} is a file, not a folder"
    if not out_dir.is_dir():
        return None
    entries = sorted(p.name for p in out_dir.iterdir())
    try:
        own = REPORT_MARK in (out_dir / "report.html").read_text(errors="replace")
    except OSError:
        own = False
    if not entries or own:
        return None
    return (
        f"--out {out_dir} already holds files lfa did not write ({_shown(entries)}): "
        "the report's files would overwrite them; pass a new or empty folder"
    )
