"""What `lfa train` was asked to do (the CLI and the detached start build and read it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

# the request's fields as `lfa train` flags (booleans are flags without a value); json_events is the caller's
# choice of output, not the run's, so a detached run (output to its log) never gets it
TRAIN_FLAGS = {
    "run_dir": "--run-dir",
    "name": "--name",
    "max_attempts": "--max-attempts",
    "allow_hparam_change": "--allow-hparam-change",
    "node_rank": "--node-rank",
    "hardware": "--hardware",
    "fresh": "--fresh",
    "resume_anyway": "--resume-anyway",
    "stop_on_divergence": "--stop-on-divergence",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "overrides": "--set",
    "kernel_profile": "--kernel-profile",
}


@dataclass
class TrainRequest:
    recipe: Path
    run_dir: Path | None = None
    name: str | None = None
    max_attempts: int = 4
    allow_hparam_change: bool = False
    json_events: bool = False
    overrides: tuple[str, ...] = ()
    fresh: bool = False  # start without the checkpoints already in output_dir (renamed aside)
    resume_anyway: bool = False  # resume although the recipe or its data changed since the checkpoints
    node_rank: int | None = None  # multi-node: this node's rank (one supervisor per node)
    master_addr: str | None = None  # override the profile's rendezvous host
    master_port: int | None = None
    hardware: str | None = None  # plan remedies for this profile instead of the recipe's own
    stop_on_divergence: bool = False  # stop (and retry) when the loss sits at ln(vocab) or keeps rising
    kernel_profile: bool = False  # profile optimizer steps 3-4: time by kernel kind and GPU idle, in the report

    def train_argv(self) -> list[str]:
        """The `lfa train` command line that makes this request again (the detached start runs it)."""
        args = [sys.executable, "-m", "lf_adapter.cli", "train", str(self.recipe)]
        for field in fields(self):
            flag, value = TRAIN_FLAGS.get(field.name), getattr(self, field.name)
            if flag is None or value is None or value is False:
                continue
            if value is True:
                args.append(flag)
            elif isinstance(value, tuple):
                args += [x for item in value for x in (flag, item)]
            else:
                args += [flag, str(value)]
        return args
