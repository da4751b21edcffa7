"""Stage 2: task definitions (catalog/tasks/*.yaml) as typed values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import UserError, catalog_dir
from .schema import raise_problems, unknown_keys


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    file_name: str | None
    formatting: str = "alpaca"
    columns: dict = field(default_factory=dict)

    def dataset_info_entry(self, file_name: str) -> dict:
        return {self.name: {"file_name": file_name, "formatting": self.formatting, "columns": dict(self.columns)}}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    stage: str
    finetuning_type: str
    default_model: str | None
    model_from_task: str | None
    chat_template: str | None
    dataset: DatasetSpec
    prompt_format: str | None
    hyperparameters: dict
    original_plan: dict

    @property
    def effective_batch_size(self) -> int:
        return int(self.hyperparameters["effective_batch_size"])

    @property
    def cutoff_len(self) -> int:
        return int(self.hyperparameters["cutoff_len"])


def task_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted((catalog_dir() / "tasks").glob("*.yaml"))}


def load_task(name: str) -> TaskSpec:
    path = task_files().get(name)
    if path is None:
        raise UserError(f"unknown task '{name}'; known tasks: {', '.join(task_files())} (see `lfa tasks`)")
    data = yaml.safe_load(path.read_text())
    raise_problems(
        unknown_keys(data, [f.name for f in dataclasses.fields(TaskSpec)])
        + unknown_keys(data.get("dataset") or {}, [f.name for f in dataclasses.fields(DatasetSpec)], "dataset."),
        f"task {path}",
    )
    return TaskSpec(
        name=data["name"],
        description=data["description"],
        stage=data["stage"],
        finetuning_type=data["finetuning_type"],
        default_model=data.get("default_model"),
        model_from_task=data.get("model_from_task"),
        chat_template=data.get("chat_template"),
        dataset=DatasetSpec(**data["dataset"]),
        prompt_format=data.get("prompt_format"),
        hyperparameters=dict(data["hyperparameters"]),
        original_plan=dict(data["original_plan"]),
    )


def list_tasks() -> list[TaskSpec]:
    return [load_task(name) for name in task_files()]


def chat_template_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted((catalog_dir() / "chat").glob("*.yaml"))}
