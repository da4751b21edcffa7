"""A review finding, a recipe's review, and where a key sits in the YAML text (file:line)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import yaml

from ..recipe.diff import DiffEntry
from ..recipe.read import LlamaFactoryLoader
from .summary import ReviewSummary

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    severity: str  # error | warning | info
    rule: str
    message: str
    file: str
    line: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RecipeReview:
    path: str
    findings: list[Finding] = field(default_factory=list)
    summary: ReviewSummary | None = None
    diff: list[DiffEntry] | None = None
    base: str | None = None  # "new recipe" or the base ref

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.summary.to_dict() if self.summary else {},
            "base": self.base,
            "diff": None if self.diff is None else [e.to_dict() for e in self.diff],
        }


def _top_level_nodes(text: str) -> list[tuple[yaml.Node, yaml.Node]]:
    try:
        node = yaml.compose(text, Loader=LlamaFactoryLoader)
    except yaml.YAMLError:
        return []
    if not isinstance(node, yaml.MappingNode):
        return []
    return [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]


def key_lines(text: str) -> dict[str, int]:
    """1-based line of every top-level key."""
    return {k.value: k.start_mark.line + 1 for k, _ in _top_level_nodes(text)}


def raw_scalars(text: str) -> dict[str, str]:
    """Top-level keys whose value is a plain (unquoted) scalar, as written."""
    return {k.value: v.value for k, v in _top_level_nodes(text) if isinstance(v, yaml.ScalarNode) and v.style is None}
