"""Strict loading of lfa's data files (hardware profiles, the model catalog, failure classes, tasks): a key this
version does not know is an error that names the nearest known key, never a silently dropped setting."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from . import UserError


def unknown_keys(data: dict, allowed: Iterable[str], prefix: str = "") -> list[str]:
    """One problem per key of data that is not in allowed, each with the nearest allowed key."""
    allowed = list(allowed)
    problems = []
    for key in (k for k in data if k not in allowed):
        near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        problems.append(f"unknown key '{prefix}{key}'" + (f" (did you mean '{prefix}{near[0]}'?)" if near else ""))
    return problems


def raise_problems(problems: list[str], where: str) -> None:
    if problems:
        raise UserError(f"{where}: " + "; ".join(problems))


def check_keys(data: dict, allowed: Iterable[str], where: str) -> None:
    raise_problems(unknown_keys(data, allowed), where)
