"""Failure classes and remedies (run/monitor.py, run/remedies.py, catalog/failures): real error texts classified,
the OOM, NaN and DeepSpeed ladders, re-planning after an OOM, lfa doctor and the divergence watch."""

from pathlib import Path

import pytest

from lf_adapter.hardware import load_profile
from lf_adapter.plan import Plan
from lf_adapter.run.monitor import LineReader, classify, parse_cuda_oom
from lf_adapter.run.remedies import Attempt, Context, next_remedy

FIXTURES = Path(__file__).parent / "fixtures" / "failures"


@pytest.mark.parametrize(
    "fixture, kind, retriable",
    [
        ("cuda_oom_h200_lf095.log", "cuda_oom", True),
        ("force_torchrun.log", "launch_force_torchrun", True),
        ("launch_distributed.log", "launch_distributed", True),
        ("bf16_unsupported.log", "bf16_unsupported", True),
        ("liger_missing.log", "liger_missing", True),
        ("disk_full_torch_save.log", "disk_full", True),
        ("nccl_timeout.log", "nccl_timeout", True),
        ("hub_network.log", "hub_network", True),
        ("config_unknown_key.log", "config_error", False),
        ("config_template.log", "config_error", False),
        # reconstructed from DeepSpeed 0.19.8's message (runtime/engine.py:2345) inside an LF 0.9.5 torchrun traceback
        ("deepspeed_offload_client_optimizer.log", "deepspeed_offload_optimizer", True),
        # captured on the H200: LLaMA-Factory 0.9.5 + DeepSpeed 0.19.8, ZeRO-3, cosine_with_min_lr with min_lr
        ("zero3_min_lr_scheduler_h200.log", "scheduler_min_lr_zero3", True),
        # captured here: LLaMA-Factory 0.9.5 + Ray 2.60, USE_RAY=1 on a 2-CPU machine (it then waits forever)
        ("ray_unschedulable_cpu_lf095.log", "ray_unschedulable", False),
        # captured here: LLaMA-Factory 0.9.5 with trl 0.29.0, its version check on, then DISABLE_VERSION_CHECK=1
        ("stack_trl_version_check_lf095.log", "software_stack", False),
        ("stack_trl_import_lf095.log", "software_stack", False),
    ],
)
def test_real_error_texts_are_classified(fixture, kind, retriable):
    failure = classify((FIXTURES / fixture).read_text().splitlines(), 1)
    assert (failure.kind, failure.retriable) == (kind, retriable)
    assert failure.evidence


def test_cuda_oom_details_are_parsed_from_the_real_h200_message():
    details = parse_cuda_oom((FIXTURES / "cuda_oom_h200_lf095.log").read_text())
    assert details["asked_gib"] == 1.97 and details["allocated_gib"] == 29.0
    assert details["reserved_unallocated_gib"] == 1.63 and details["capacity_gib"] == 139.8


def test_sigkill_without_text_is_host_oom_and_clean_exit_is_no_failure():
    assert classify(["step 3/10"], -9).kind == "host_oom_kill"
    assert classify(["done"], 0) is None


def _ladder(hw, steps):
    attempt, tried = Attempt(Plan("fp16", 8, 8, gradient_checkpointing=False)), set()
    oom = classify((FIXTURES / "cuda_oom_h200_lf095.log").read_text().splitlines(), 1)
    actions = []
    for _ in range(steps):
        remedy = next_remedy(attempt, oom, Context(hw), tried)
        actions.append(remedy.action)
        attempt = remedy.attempt
        assert attempt.plan.effective_batch_size == 64
    return actions, attempt


def test_oom_ladder_keeps_the_effective_batch():
    actions, attempt = _ladder(load_profile("a100-80g"), 6)
    assert actions == [
        "fragmentation",
        "halve_micro_batch",
        "gradient_checkpointing",
        "liger",
        "halve_micro_batch",
        "halve_micro_batch",
    ]
    assert attempt.plan.micro_batch_size == 1 and attempt.plan.grad_accum == 64
    # below sm80 (a V100) Triton does not run: the ladder never turns liger on
    actions, attempt = _ladder(load_profile("v100-32g"), 5)
    assert "liger" not in actions and not attempt.plan.liger


def test_learning_rate_only_moves_with_permission():
    hw = load_profile("v100-32g")
    nan = classify(["lfa: non-finite loss or grad_norm"], 1)
    attempt = Attempt(Plan("fp16", 8, 8, attention="eager"))
    assert next_remedy(attempt, nan, Context(hw, learning_rate=3e-6), set()) is None
    allowed = next_remedy(attempt, nan, Context(hw, allow_hparam_change=True, learning_rate=3e-6), set())
    assert allowed.action == "lower_lr" and allowed.attempt.keys["learning_rate"] == 1.5e-6


def test_nan_on_bf16_capable_card_goes_back_to_bf16():
    nan = classify(["lfa: non-finite loss or grad_norm"], 1)
    remedy = next_remedy(Attempt(Plan("fp16", 8, 8)), nan, Context(load_profile("a100-80g")), set())
    assert remedy.action == "bf16_if_supported" and remedy.attempt.plan.precision == "bf16"


def test_nan_under_fp16_master_weights_goes_back_to_autocast_where_bf16_is_missing():
    nan = classify(["lfa: non-finite loss or grad_norm"], 1)
    attempt = Attempt(Plan("fp16", 8, 8, master_weights=True))
    remedy = next_remedy(attempt, nan, Context(load_profile("v100-32g")), set())
    assert remedy.action == "no_master_weights" and not remedy.attempt.plan.master_weights
    assert remedy.attempt.plan.precision == "fp16"
    # a bf16 card goes back to bf16 first (the range is the problem), keeping master weights
    remedy = next_remedy(attempt, nan, Context(load_profile("a100-80g")), set())
    assert remedy.action == "bf16_if_supported" and remedy.attempt.plan.master_weights


def test_line_reader_handles_carriage_returns_bad_bytes_and_huge_lines():
    reader = LineReader()
    lines = reader.feed(b"  5%|#  | 1/20\r 10%|## | 2/20\rok \xff\xfe\n" + b"x" * 100000 + b"\n")
    assert lines[0].strip().startswith("5%") and lines[2].startswith("ok \ufffd")
    assert len(lines[3]) == 4000


def test_offload_without_optimizer_retries_on_lfas_config_without_touching_the_users(tmp_path):
    from lf_adapter.run.resolved import write_deepspeed_config

    failure = classify((FIXTURES / "deepspeed_offload_client_optimizer.log").read_text().splitlines(), 1)
    attempt = Attempt(Plan("bf16", 4, 16, sharding="zero2", offload="optimizer"), env={"FORCE_TORCHRUN": "1"})
    remedy = next_remedy(attempt, failure, Context(load_profile("a100-80g")), set())
    assert remedy.action == "lfa_deepspeed_config" and remedy.attempt.own_deepspeed_config
    assert remedy.attempt.env == {"FORCE_TORCHRUN": "1"} and remedy.attempt.plan == attempt.plan
    users = tmp_path / "ds_zero2_offload_optimizer.json"
    users.write_text('{"zero_optimization": {"stage": 2}}')
    name = write_deepspeed_config(tmp_path, remedy.attempt.plan)
    assert name == "ds_zero2_offload_optimizer.lfa.json" and users.read_text() == '{"zero_optimization": {"stage": 2}}'
    assert '"optimizer"' in (tmp_path / name).read_text()


def test_zero3_min_lr_retries_with_the_same_schedule_as_a_rate(tmp_path):
    import yaml

    from lf_adapter.recipe.read import load_recipe
    from lf_adapter.run.resolved import resolved_text

    failure = classify((FIXTURES / "zero3_min_lr_scheduler_h200.log").read_text().splitlines(), 1)
    context = Context(load_profile("h200"), learning_rate=3e-6, scheduler_kwargs={"min_lr": 3e-7})
    remedy = next_remedy(Attempt(Plan("bf16", 16, 4, sharding="zero3")), failure, context, set())
    assert remedy.action == "min_lr_rate" and remedy.attempt.keys["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    recipe_file = tmp_path / "train.yaml"
    recipe_file.write_text("learning_rate: 3.0e-6\nlr_scheduler_kwargs:\n  min_lr: 3.0e-7\nwarmup_ratio: 0.02\n")
    resolved = yaml.safe_load(resolved_text(load_recipe(recipe_file), remedy.attempt.keys, [remedy.why]))
    assert resolved == {"learning_rate": 3e-6, "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "warmup_ratio": 0.02}


SIX_7B = "LLM4Binary/llm4decompile-6.7b-v2"


def _seed_failure():
    return classify((FIXTURES / "cuda_oom_seed_v100.log").read_text().splitlines(), 1)


def _context(hardware, **kw):
    from lf_adapter.model_spec import load_model_spec

    return Context(hardware=hardware, model=load_model_spec(SIX_7B), seq_len=2048, **kw)


def test_seed_oom_is_replanned_by_the_memory_model_to_a_plan_that_fits_gpu_and_host():
    from lf_adapter.memory import estimate, host_memory

    failure = _seed_failure()
    assert failure.details["allocated_gib"] == 27.81 and failure.details["capacity_gib"] == 31.73
    import dataclasses

    # the seed's host RAM is unknown; with 256 GiB an offload plan fits (with 128 it does not: next test)
    hardware = dataclasses.replace(load_profile("v100-32g"), ram_gib=256.0)
    context = _context(hardware, learning_rate=3e-6, scheduler_kwargs={"min_lr": 3e-7})
    paper = Plan.from_label("fp16/mbs8xga8x1/gc/auto/zero2")
    remedy = next_remedy(Attempt(paper), failure, context, set())
    new = remedy.attempt.plan
    assert remedy.action == "replan" and new.offload != "none" and new.precision == "fp16"
    assert new.effective_batch_size == 64
    assert estimate(context.model, new, 2048, 31.73).fits and host_memory(context.model, new, hardware).fits
    if new.deepspeed == "zero3":  # the schedule moves to min_lr_rate with it
        assert remedy.attempt.keys["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}


def test_oom_with_no_plan_for_gpu_and_host_stops_at_once_with_what_would_fit():
    """The v100-32g profile's 128 GiB host: DeepSpeed's offloaded states of a 6.7B model need about 170 GiB (measured
    26.3 bytes per parameter on the H200; the 6.7B run was killed at 128 GiB), so nothing fits and lfa says why."""
    import dataclasses

    no_disk = dataclasses.replace(load_profile("v100-32g"), disk=None)
    remedy = next_remedy(
        Attempt(Plan.from_label("fp16/mbs8xga8x1/gc/sdpa/zero2")), _seed_failure(), _context(no_disk), set()
    )
    assert remedy.attempt is None and remedy.action == "no_plan_fits"
    assert "declare it in the profile as disk" in remedy.why
    assert "128 GiB of RAM" in remedy.why and "GiB of host RAM" in remedy.why
    assert "GPUs of this kind" in remedy.why and "smaller model" in remedy.why


def test_fragmentation_alone_only_when_the_model_says_the_plan_fits():
    """1.3B on the capped H200: the plan fits, and 1.63 GiB cached-but-free cannot serve 1.97 GiB asked -> replan;
    with 2.5 GiB cached-but-free it can -> expandable segments only."""
    from lf_adapter.model_spec import load_model_spec
    from lf_adapter.run.monitor import Failure

    context = Context(
        hardware=load_profile("h200-capped-32g"), model=load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    )
    plan = Plan.from_label("fp16/mbs8xga8x1/gc/liger/sdpa")
    details = {
        "asked_gib": 1.0,
        "capacity_gib": 139.8,
        "allowed_gib": 31.73,
        "allocated_gib": 20.0,
        "reserved_unallocated_gib": 2.5,
    }
    remedy = next_remedy(Attempt(plan), Failure("cuda_oom", True, ["x"], details), context, set())
    assert remedy.action == "fragmentation" and remedy.attempt.plan == plan.replace(
        alloc_conf="expandable_segments:True"
    )
    details.update(reserved_unallocated_gib=0.5, allocated_gib=29.0, asked_gib=1.97)
    remedy = next_remedy(Attempt(plan), Failure("cuda_oom", True, ["x"], details), context, set())
    assert remedy.action == "replan" and remedy.attempt.plan.effective_batch_size == 64


def test_doctor_writes_the_next_recipe_for_a_nohup_log(tmp_path):
    import json
    import shutil

    from conftest import run_lfa

    recipe = tmp_path / "train.yaml"
    recipe.write_text(
        "model_name_or_path: LLM4Binary/llm4decompile-6.7b-v2\nstage: sft\ndo_train: true\n"
        "finetuning_type: full\ndeepspeed: ds_z2_config.json\ndataset: pseudo2norm\n"
        "template: sk2decompile\ncutoff_len: 2048\noutput_dir: saves/p2n\n"
        "per_device_train_batch_size: 8\ngradient_accumulation_steps: 8\nlearning_rate: 3.0e-6\n"
        "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr: 3.0e-7}\nfp16: true\n"
    )
    (tmp_path / "ds_z2_config.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    shutil.copy(FIXTURES / "cuda_oom_seed_v100.log", tmp_path / "nohup.out")
    profile = tmp_path / "v100-256g.yaml"
    profile.write_text(
        (Path(__file__).parents[1] / "catalog" / "hardware" / "v100-32g.yaml")
        .read_text()
        .replace("ram_gib: 128", "ram_gib: 256")
    )
    # a hand-written recipe: its relative paths resolve against where llamafactory-cli runs (here: its folder)
    result = run_lfa(
        "doctor", tmp_path / "nohup.out", "--recipe", recipe, "--hardware", profile, "--json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failure"]["kind"] == "cuda_oom" and "offload" in report["remedy"]["plan"]
    from lf_adapter.recipe.read import load_recipe, plan_from_recipe

    written = load_recipe(tmp_path / "train.next.yaml")
    plan = plan_from_recipe(written, load_profile(str(profile)))
    assert plan.offload != "none" and plan.effective_batch_size == 64 and plan.label() == report["remedy"]["plan"]
    assert report["env"]["FORCE_TORCHRUN"] == "1"
    # exit codes: not retriable -> 1, no failure -> 1, missing file -> 2
    assert run_lfa("doctor", FIXTURES / "config_unknown_key.log").returncode == 1
    # the seed's own 128 GiB host without a disk for NVMe offload: nothing fits, exit 1 and no recipe written
    (tmp_path / "train.next.yaml").unlink()
    no_disk = tmp_path / "v100-no-disk.yaml"
    no_disk.write_text(
        "\n".join(
            line
            for line in (Path(__file__).parents[1] / "catalog" / "hardware" / "v100-32g.yaml").read_text().splitlines()
            if not line.startswith("disk:")
        )
    )
    stop = run_lfa("doctor", tmp_path / "nohup.out", "--recipe", recipe, "--hardware", no_disk, cwd=tmp_path)
    assert stop.returncode == 1 and "no plan fits" in stop.stdout and not (tmp_path / "train.next.yaml").exists()
    (tmp_path / "fine.log").write_text("{'loss': 1.0}\ntraining finished\n")
    assert run_lfa("doctor", tmp_path / "fine.log").returncode == 1
    missing = run_lfa("doctor", tmp_path / "nope.log")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_divergence_without_nan_is_seen_flat_at_uniform_or_rising(tmp_path):
    import json
    import math

    from lf_adapter.run.monitor import TrainerLogWatcher

    def watch(losses):
        log = tmp_path / "trainer_log.jsonl"
        log.write_text(
            "".join(
                json.dumps({"current_steps": i, "loss": x, "grad_norm": 1.0}) + "\n" for i, x in enumerate(losses, 1)
            )
        )
        watcher = TrainerLogWatcher(log)
        watcher.poll()
        return watcher.stalled(600)

    assert "ln(vocab)" in watch([math.log(600) + 0.01 * (-1) ** i for i in range(12)])
    assert "rose" in watch([1.0 + 0.1 * i for i in range(12)])
    assert watch([3.0 - 0.1 * i for i in range(12)]) is None
    assert watch([math.log(600)] * 5) is None  # too few logs to say
