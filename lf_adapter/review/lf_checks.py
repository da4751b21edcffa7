"""LLaMA-Factory's own argument checks run on a recipe, and which keys depend on the installed versions."""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import io
import os
import re
import tempfile
from functools import lru_cache

import yaml

from .. import catalog_dir
from ..recipe.read import Recipe
from .findings import Finding, raw_scalars

# keys checked by lfa's own rules, with the card the recipe is meant for: the machine running the review (a CI
# runner) is not the one that trains, so LLaMA-Factory's device checks would judge the wrong machine
DEVICE_KEYS = ("bf16", "fp16", "deepspeed", "enable_liger_kernel", "flash_attn", "use_unsloth")


def version_matches(installed: str, spec: str) -> bool:
    """A development or pre-release build counts as its release line: 0.9.5.dev0 is LLaMA-Factory 0.9.5 (whose
    keys it already has), not 'below 0.9.5'."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(Version(installed).base_version)
    except InvalidVersion:
        return True  # an unparseable local build: do not call its keys wrong
    return release in SpecifierSet(spec)


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def version_keys() -> list[dict]:
    return yaml.safe_load((catalog_dir() / "review" / "version_keys.yaml").read_text())


@lru_cache(maxsize=1)
def llamafactory_fields() -> dict[str, object] | None:
    """Every key LLaMA-Factory's train parser accepts -> its type annotation (None without LLaMA-Factory)."""
    try:
        with _quiet():
            from llamafactory.hparams.parser import _TRAIN_ARGS
    except Exception:  # not installed, or broken: review falls back to lfa's rules
        return None
    import dataclasses
    import typing

    fields = {}
    for cls in _TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields[f.name] = hints.get(f.name, f.type)
    return fields


@lru_cache(maxsize=1)
def llamafactory_templates() -> frozenset[str] | None:
    """LLaMA-Factory's chat templates with lfa's registered (None without LLaMA-Factory)."""
    from ..plugin import hooks

    try:
        with _quiet():
            from llamafactory.data import template
    except Exception:
        return None
    hooks.register_chat_templates(template)  # skips the ones already registered
    return frozenset(template.TEMPLATES)


@contextlib.contextmanager
def _quiet():
    """LLaMA-Factory and transformers log at import and parse time; review prints findings only."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _choices(annotation) -> list[str]:
    import enum

    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    return []


def _accepts(annotation, value) -> bool:
    """Does a YAML value fit a dataclass field annotation (loosely: the scalar kinds that matter)?"""
    import enum
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if value is None:
        return annotation is type(None)
    if annotation is typing.Any or origin in (list, dict, tuple) or annotation in (list, dict):
        return True
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, str) and value in _choices(annotation)
    return True


def llamafactory_findings(recipe: Recipe, lines: dict[str, int]) -> list[Finding]:
    """Keys, types and the checks LLaMA-Factory's get_train_args applies, without loading a model."""
    fields = llamafactory_fields()
    path = str(recipe.path)
    if fields is None:
        return [
            Finding(
                "info",
                "llamafactory_missing",
                "LLaMA-Factory is not importable here: only lfa's rules ran (pip install 'lf-adapter[train]')",
                path,
            )
        ]
    findings = []
    written = raw_scalars(recipe.text)
    for key, value in recipe.data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            findings.append(
                Finding(
                    "error", "unknown_key", f"`{key}` is not a LLaMA-Factory argument{hint}", path, lines.get(key, 1)
                )
            )
        elif isinstance(value, bool) and not _accepts(fields[key], value):
            findings.append(
                Finding(
                    "error",
                    "yaml_boolean",
                    f"`{key}: {written.get(key, value)}` "
                    f"is read as the boolean {str(value).lower()} (YAML 1.1), but {key} takes a "
                    f'string: quote it, e.g. {key}: "no"',
                    path,
                    lines.get(key, 1),
                )
            )
        elif not _accepts(fields[key], value):
            choices = _choices(fields[key])
            findings.append(
                Finding(
                    "error",
                    "wrong_type",
                    f"`{key}: {value!r}` does not fit {key}'s type "
                    f"({getattr(fields[key], '__name__', fields[key])})"
                    + (f": one of {', '.join(choices)}" if choices else "")
                    + (
                        "; transformers' eager attention is `disabled` in LLaMA-Factory"
                        if key == "flash_attn" and value == "eager"
                        else ""
                    ),
                    path,
                    lines.get(key, 1),
                )
            )
    if any(f.severity == "error" for f in findings):
        return findings  # the parser would stop at the first of these
    from llamafactory.hparams.parser import get_train_args

    args = {k: v for k, v in recipe.data.items() if k not in DEVICE_KEYS}
    with tempfile.TemporaryDirectory() as scratch, _quiet():
        args["output_dir"] = os.path.join(scratch, "output")  # the output folder's state is not the recipe's
        try:
            get_train_args(args)
        except (ValueError, TypeError, ImportError, RuntimeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            key = next((k for k in recipe.data if re.search(rf"\b{re.escape(k)}\b", message)), None)
            findings.append(
                Finding(
                    "error",
                    "llamafactory_check",
                    f"LLaMA-Factory rejects it: {message}",
                    path,
                    lines.get(key, 1) if key else 1,
                )
            )
    return findings
