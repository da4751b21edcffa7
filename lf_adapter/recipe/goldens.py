"""Golden recipes kept in step with the generator: `lfa generate --check` regenerates recipes/manifest.yaml."""

from __future__ import annotations

import difflib
import shlex
import tempfile
from pathlib import Path

import yaml

from .. import UserError
from .generate import GenerateRequest, generate

# golden recipes are written for this LLaMA-Factory unless their manifest entry names another (`llamafactory:`),
# so `--check` gives the same answer whatever is installed
GOLDEN_LLAMAFACTORY = "0.9.5"
# and for the transformers that LLaMA-Factory release installs (CI's two stacks): it decides the warmup key
GOLDEN_TRANSFORMERS = {"0.9.5": "5.6.0", "0.9.4": "4.57.1"}


def _request_from_args(args: list[str], out_dir: Path, llamafactory: str = GOLDEN_LLAMAFACTORY) -> GenerateRequest:
    values, flags, sets, pins = {}, set(), [], []
    i = 0
    while i < len(args):
        key = args[i].lstrip("-").replace("-", "_")
        if key in ("allow_packing", "no_sorted_steps", "no_padding_free", "no_token_budget"):
            flags.add(key)
            i += 1
            continue
        if key == "set":
            sets.append(args[i + 1])
        elif key == "pin":
            pins.append(args[i + 1])
        elif key in ("launcher", "llamafactory_version"):
            values[key] = args[i + 1]
        else:
            values[key] = args[i + 1]
        i += 2
    return GenerateRequest(
        task=values["task"],
        out_dir=out_dir,
        model=values.get("model"),
        dataset=values.get("dataset"),
        template=values.get("template"),
        hardware=values.get("hardware", "detect"),
        gpus=int(values["gpus"]) if "gpus" in values else None,
        allow_packing="allow_packing" in flags,
        sort_steps="no_sorted_steps" not in flags,
        padding_free="no_padding_free" not in flags,
        token_budget="no_token_budget" not in flags,
        precision=values.get("precision"),
        sets=tuple(sets),
        pins=tuple(pins),
        launcher=values.get("launcher", "torchrun"),
        llamafactory_version=values.get("llamafactory_version", llamafactory),
        transformers_version=GOLDEN_TRANSFORMERS.get(values.get("llamafactory_version", llamafactory), "4.57.1"),
        command="lfa generate " + shlex.join(args),
        use_measured=False,  # goldens come from the models alone, not from what this machine measured
    )


def golden_files(root: Path, entry: dict) -> dict[str, str]:
    return generate(
        _request_from_args(
            list(entry["args"]), root / entry["dir"], str(entry.get("llamafactory", GOLDEN_LLAMAFACTORY))
        )
    ).files


def check_goldens(root: Path) -> list[str]:
    """Regenerate every recipe in root/manifest.yaml; return drift lines (empty when all match)."""
    manifest = root / "manifest.yaml"
    if not manifest.is_file():
        raise UserError(f"{manifest} does not exist")
    drift = []
    for entry in yaml.safe_load(manifest.read_text()):
        folder = root / entry["dir"]
        files = golden_files(root, entry)
        for name, text in files.items():
            path = folder / name
            old = path.read_text() if path.is_file() else ""
            if old != text:
                diff = difflib.unified_diff(
                    old.splitlines(), text.splitlines(), str(path), "regenerated", lineterm="", n=0
                )
                drift += list(diff)[:40] or [f"{path}: missing"]
        drift += [
            f"{path}: no longer generated"
            for path in sorted(folder.glob("*"))
            if path.is_file() and path.name not in files
        ]
    return drift


def write_goldens(root: Path) -> None:
    from .render import write_recipe_dir

    for entry in yaml.safe_load((root / "manifest.yaml").read_text()):
        files = golden_files(root, entry)
        folder = root / entry["dir"]
        for stale in [p for p in folder.glob("*") if p.is_file() and p.name not in files]:
            stale.unlink()
        write_recipe_dir(files, folder, force=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        write_goldens(Path("recipes"))
