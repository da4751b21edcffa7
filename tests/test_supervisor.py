"""The retry logic of `lfa train` with the trainer's start injected: a small real process that prints what a
trainer would (an OOM line, a crash, success) instead of LLaMA-Factory, so each case takes a second. The same
paths run through the real llamafactory-cli in test_faults.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lf_adapter.run.preflight import prepare
from lf_adapter.run.request import TrainRequest
from lf_adapter.run.supervisor import attempt_loop, supervise

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "31.73 GiB of which 1.02 GiB is free."
)

# stands in for llamafactory-cli: fails with an OOM while the micro-batch is above 2, else "trains" and exits 0
FAKE_TRAINER = f"""
import sys
from pathlib import Path
mbs = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("per_device_train_batch_size=")]
if mbs and mbs[-1] > 2:
    print({OOM!r}, flush=True)
    sys.exit(1)
print("fake trainer: done", flush=True)
"""


def _fake_start(script):
    calls = []

    def start_process(command, cwd, env, log_file):
        calls.append(command)
        return subprocess.Popen(
            [sys.executable, "-c", script, *command[2:]],
            cwd=str(cwd),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    return start_process, calls


def test_an_oom_is_retried_with_a_halved_micro_batch_until_it_fits(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=3")
    start_process, calls = _fake_start(FAKE_TRAINER)
    request = TrainRequest(
        recipe,
        run_dir=tmp_path / "run",
        max_attempts=5,
        overrides=("per_device_train_batch_size=8", "gradient_accumulation_steps=1"),
    )
    assert supervise(request, finish=False, start_process=start_process) == 0
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [a["status"] for a in ledger["attempts"]] == ["failed"] * 3 + ["succeeded"]
    assert [a["remedy"]["action"] for a in ledger["attempts"][:3]] == [
        "halve_micro_batch",
        "gradient_checkpointing",
        "halve_micro_batch",
    ]  # the cuda_oom ladder on a CPU
    batches = [
        (a["overrides"]["per_device_train_batch_size"], a["overrides"]["gradient_accumulation_steps"])
        for a in ledger["attempts"]
    ]
    assert batches == [(8, 1), (4, 2), (4, 2), (2, 4)]  # the effective batch of 8 is kept on every attempt
    assert len(calls) == 4 and all(c[1] == "train" for c in calls)


def test_the_retry_budget_ends_the_run(cpu_recipe, tmp_path):
    start_process, calls = _fake_start(FAKE_TRAINER)
    setup = prepare(
        TrainRequest(
            cpu_recipe("max_steps=3"),
            run_dir=tmp_path / "run",
            max_attempts=2,
            overrides=("per_device_train_batch_size=8", "gradient_accumulation_steps=1"),
        )
    )
    assert attempt_loop(setup, start_process) == 1
    assert len(calls) == 2 and setup.ledger.status == "failed"


def test_a_failure_no_retry_can_fix_stops_at_once(cpu_recipe, tmp_path):
    crash = "import sys; print('ValueError: Template sk2decompil does not exist.'); sys.exit(1)"
    start_process, calls = _fake_start(crash)
    setup = prepare(TrainRequest(cpu_recipe("max_steps=3"), run_dir=tmp_path / "run", max_attempts=4))
    assert attempt_loop(setup, start_process) == 1
    assert len(calls) == 1 and setup.ledger.attempts[0].failure["retriable"] is False


def test_bad_input_is_refused_before_anything_starts(cpu_recipe, tmp_path):
    from lf_adapter import UserError

    start_process, calls = _fake_start(FAKE_TRAINER)
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        supervise(
            TrainRequest(cpu_recipe("max_steps=3"), run_dir=tmp_path / "run", overrides=("oops",)),
            start_process=start_process,
        )
    assert calls == []


def test_detached_start_command_line_reads_back_as_the_same_request():
    """start_detached re-runs `lfa train` from TrainRequest.train_argv: every field the CLI takes goes through it."""
    from dataclasses import fields

    from lf_adapter.cli.runs import train
    from lf_adapter.run.request import TRAIN_FLAGS

    assert {f.name for f in fields(TrainRequest)} - {"recipe", "json_events"} == set(TRAIN_FLAGS)
    request = TrainRequest(
        recipe=Path("/r/train.yaml"),
        run_dir=Path("/runs/x"),
        name="x",
        max_attempts=3,
        allow_hparam_change=True,
        json_events=True,
        overrides=("learning_rate=1.0e-5", "run_name=two words"),
        fresh=True,
        resume_anyway=True,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29501,
        hardware="v100-32g",
        stop_on_divergence=True,
        kernel_profile=True,
    )
    argv = request.train_argv()
    assert argv[1:5] == ["-m", "lf_adapter.cli", "train", "/r/train.yaml"]
    params = train.make_context("train", argv[4:]).params
    assert params["as_json"] is False  # a detached run writes its log, not JSON events
    assert params == {
        "recipe": "/r/train.yaml",
        "run_dir": "/runs/x",
        "name": "x",
        "max_attempts": 3,
        "allow_hparam_change": True,
        "as_json": False,
        "detach": False,
        "sets": ("learning_rate=1.0e-5", "run_name=two words"),
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29501,
        "hardware": "v100-32g",
        "resume_anyway": True,
        "fresh": True,
        "stop_on_divergence": True,
        "kernel_profile": True,
    }
    defaults = TrainRequest(recipe=Path("/r/train.yaml")).train_argv()
    assert defaults[4:] == ["/r/train.yaml", "--max-attempts", "4"]
