"""`lfa generate` and the planner's defaults on the built-in profiles: precision, batch, recompute, packing,
padding-free, token budgets, the rendered recipe, goldens, bad input, lfa detect, lfa diff of the plugin's settings."""

import json
import re

import pytest
import yaml

from conftest import REPO, run_lfa
from lf_adapter.hardware import load_profile
from lf_adapter.model_spec import count_params_meta, load_model_spec
from lf_adapter.planner import PlanOptions, plan
from lf_adapter.recipe.goldens import check_goldens


def test_precision_follows_compute_capability():
    spec = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    v100 = plan(spec, load_profile("v100-32g"), 64, 2048).chosen.plan
    a100 = plan(spec, load_profile("a100-80g"), 64, 2048).chosen.plan
    cpu = plan(load_model_spec("Qwen/Qwen2.5-Coder-0.5B"), load_profile("cpu"), 64, 2048).chosen.plan
    assert (v100.precision, a100.precision, cpu.precision) == ("fp16", "bf16", "fp32")


@pytest.mark.parametrize("profile", ["v100-32g", "a100-80g", "dgx-a100-80g", "dgx-h100-80g", "a40x4", "h200"])
def test_every_plan_keeps_the_effective_batch_and_fits(profile):
    hw = load_profile(profile)
    result = plan(load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"), hw, 64, 2048)
    for candidate in [result.chosen] + result.runners_up:
        assert candidate.plan.micro_batch_size * candidate.plan.grad_accum * hw.world_size == 64
        assert candidate.memory.reserved_gib <= hw.gpu.vram_gib * 0.88
    assert all(not c.fits for c in result.rejected)


def test_one_gpu_avoids_deepspeed_unless_states_need_offload():
    chosen = plan(load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"), load_profile("h200"), 64, 2048).chosen.plan
    assert chosen.deepspeed is None
    big = plan(load_model_spec("LLM4Binary/llm4decompile-6.7b-v2"), load_profile("a100-80g"), 64, 2048).chosen.plan
    assert big.deepspeed is not None and big.offload != "none"  # 16 bytes x 6.7 B params > 80 GB


def test_packing_only_when_allowed():
    spec, hw = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"), load_profile("v100-32g")
    assert not plan(spec, hw, 64, 2048).chosen.plan.packing
    assert plan(spec, hw, 64, 2048, PlanOptions(allow_packing=True)).chosen.plan.packing


def test_padding_free_is_the_default_where_its_kernel_exists_and_says_why_not_elsewhere():
    spec = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    h200 = plan(spec, load_profile("h200"), 64, 2048).chosen.plan
    v100 = plan(spec, load_profile("v100-32g"), 64, 2048).chosen.plan
    opted_out = plan(spec, load_profile("h200"), 64, 2048, PlanOptions(padding_free=False)).chosen.plan
    assert h200.padding_free and h200.reasons["padding_free"].startswith("on:")
    assert not v100.padding_free and "sm70" in v100.reasons["padding_free"] and "sm80+" in v100.reasons["padding_free"]
    assert not opted_out.padding_free and opted_out.reasons["padding_free"] == "off: --no-padding-free"


def test_recompute_is_sized_to_memory_the_fewest_checkpointed_layers_that_fit():
    from lf_adapter.memory import estimate

    spec, hw = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"), load_profile("v100-32g")
    chosen = plan(spec, hw, 64, 2048).chosen
    k = chosen.plan.checkpoint_layers
    assert k is not None and 0 < k < spec.num_layers
    assert chosen.memory.fits
    fewer = estimate(spec, chosen.plan.replace(checkpoint_layers=k - 1), 2048, hw.gpu.vram_gib)
    assert not fewer.fits  # one layer fewer does not fit: k is what the memory needs
    every = estimate(spec, chosen.plan.replace(checkpoint_layers=None), 2048, hw.gpu.vram_gib)
    assert every.reserved_gib < chosen.memory.reserved_gib  # what runs without the plugin needs less


def test_a_token_budget_plan_falls_back_to_a_fixed_plan_that_needs_no_more_memory():
    from lf_adapter.memory import estimate

    spec, hw = load_model_spec("LLM4Binary/llm4decompile-6.7b-v2"), load_profile("h200")
    result = plan(spec, hw, 64, 2048)
    budgets = [c for c in [result.chosen, *result.runners_up] if c.plan.token_budget]
    assert budgets
    for c in budgets:
        assert c.plan.deepspeed is None and c.plan.micro_batch_size * 2048 <= c.plan.token_budget
        fixed = c.plan.replace(token_budget=0, checkpoint_layers=None)  # LLaMA-Factory without the plugin
        assert estimate(spec, fixed, 2048, hw.gpu.vram_gib).reserved_gib <= c.memory.reserved_gib
    off = plan(spec, hw, 64, 2048, PlanOptions(token_budget=False))
    assert not any(c.plan.token_budget for c in [off.chosen, *off.runners_up])


def test_halving_the_micro_batch_after_an_oom_halves_its_token_budget_too():
    from types import SimpleNamespace

    from lf_adapter.plan import Plan
    from lf_adapter.run.remedies import PLAN_ACTIONS

    attempt = SimpleNamespace(plan=Plan("bf16", 8, 8, token_budget=16384, checkpoint_layers=20))
    halved, why = PLAN_ACTIONS["halve_micro_batch"](attempt, None, None)
    assert (halved.micro_batch_size, halved.grad_accum, halved.token_budget) == (4, 16, 8192)
    assert "token budget 16384 -> 8192" in why and "effective batch stays 64" in why
    every, _ = PLAN_ACTIONS["gradient_checkpointing"](attempt, None, None)
    assert every.gradient_checkpointing and every.checkpoint_layers is None


def test_analytic_parameter_count_matches_meta_device(demo_assets):
    model, _ = demo_assets
    assert load_model_spec(str(model)).num_params == count_params_meta(str(model))


def test_catalog_shape_matches_published_size():
    assert abs(load_model_spec("LLM4Binary/llm4decompile-6.7b-v2").num_params / 1e9 - 6.74) < 0.01
    assert abs(load_model_spec("Qwen/Qwen2.5-Coder-7B").num_params / 1e9 - 7.62) < 0.01


def test_generated_recipe_is_valid_yaml_with_real_floats_and_comments(tmp_path):
    result = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--model",
        "LLM4Binary/llm4decompile-1.3b-v2",
        "--hardware",
        "dgx-a100-80g",
        "-o",
        tmp_path / "r",
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "r" / "train.yaml").read_text()
    data = yaml.safe_load(text)
    assert isinstance(data["learning_rate"], float) and data["learning_rate"] == 3.0e-6
    assert data["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}  # the paper's min_lr 3.0e-7 over lr 3.0e-6
    assert data["template"] == "sk2decompile" and data["bf16"] is True
    assert data["per_device_train_batch_size"] * data["gradient_accumulation_steps"] * 8 == 64
    assert "# precision:" in text and "# batch:" in text
    launch = (tmp_path / "r" / "launch.sh").read_text()
    assert (
        "FORCE_TORCHRUN=1" in launch and "NPROC_PER_NODE=8" in launch and "MASTER_PORT=${MASTER_PORT:-29500}" in launch
    )
    info = json.loads((tmp_path / "r" / "dataset_info.json").read_text())
    assert info["pseudo2norm"]["columns"] == {"prompt": "instruction", "query": "input", "response": "output"}


def test_golden_recipes_match_the_generator():
    assert check_goldens(REPO / "recipes") == []


def test_golden_check_reports_drift(tmp_path):
    import shutil

    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    path = tmp_path / "recipes" / "pseudo2norm" / "h200" / "train.yaml"
    path.write_text(path.read_text().replace("learning_rate: 3.0e-6", "learning_rate: 1.0e-5"))
    drift = check_goldens(tmp_path / "recipes")
    assert any("learning_rate" in line for line in drift)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope", "--hardware", "cpu"], "unknown task 'nope'"),
        (["--task", "pseudo2norm", "--hardware", "cpu", "--model", "/no/such/model"], "does not exist"),
        (["--task", "pseudo2norm", "--hardware", "cpu", "--dataset", "/no/such.jsonl"], "does not exist"),
        (["--task", "pseudo2norm", "--hardware", "no-such-profile"], "no hardware profile"),
        (["--task", "pseudo2norm", "--hardware", "h200", "--pin", "checkpoint_layers=0"], "must be an integer >= 1"),
        (["--task", "pseudo2norm", "--hardware", "h200", "--pin", "token_budget=-4"], "must be an integer >= 0"),
        (["--task", "pseudo2norm", "--hardware", "h200", "--pin", "checkpoint_layers=99"], "has 32 decoder layers"),
        (["--task", "pseudo2norm", "--hardware", "h200", "--pin", "token_budget=abc"], "takes an integer"),
        (
            ["--task", "pseudo2norm", "--hardware", "h200", "--pin", "checkpoint_layers=4"]
            + ["--pin", "gradient_checkpointing=false"],
            "needs gradient checkpointing",
        ),
    ],
)
def test_bad_input_is_one_clear_error_exit_2(tmp_path, args, message):
    result = run_lfa("generate", *args, "-o", tmp_path / "out")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unreadable_dataset_and_bad_profile_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "", "input": "x", "output": "y"}\nnot json\n[1]\n{"input": "x"}\n')
    for args in (
        ("generate", "--task", "pseudo2norm", "--hardware", "cpu", "--dataset", bad, "-o", tmp_path / "o"),
        ("data", bad),
    ):
        result = run_lfa(*args)  # every bad line named, not only the first
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert all(f"bad.jsonl:{n}: " in result.stderr for n in (2, 3, 4)), result.stderr
    assert not (tmp_path / "o").exists()
    # LLaMA-Factory's alpaca converter reads example["input"]: a column in no row stops it with a KeyError
    no_input = tmp_path / "no_input.jsonl"
    no_input.write_text('{"instruction": "int a1;", "output": "int var1;"}\n' * 3)
    result = run_lfa("data", no_input)
    assert result.returncode == 2 and "no row has the column 'input'" in result.stderr
    no_input.write_text(no_input.read_text() + '{"instruction": "int a1;", "input": "", "output": "int var1;"}\n')
    assert run_lfa("data", no_input).returncode == 0
    profile = tmp_path / "box.yaml"
    profile.write_text("gpu: {name: X, vram_gib: 10, compute_capability: seven}\n")
    result = run_lfa("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", tmp_path / "o2")
    assert result.returncode == 2 and "not valid" in result.stderr and "Traceback" not in result.stderr


def test_a_profile_figure_out_of_range_is_named_and_an_unknown_card_peak_is_asked_for(tmp_path):
    """Every figure a profile file gives is checked (all named at once); a card lfa has no TFLOP/s for is one
    message saying which figure to declare, never a division by zero."""
    profile = tmp_path / "box.yaml"
    profile.write_text(
        'gpu: {name: X, vram_gib: 1e9, compute_capability: "8.0", peak_tflops_16bit: .nan, hbm_tbps: -1}\n'
        "cpu_cores: 0\nram_gib: 64\n"
    )
    result = run_lfa("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", tmp_path / "o")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    for named in (
        "gpu.vram_gib is the text '1e9'",
        "gpu.peak_tflops_16bit is nan",
        "gpu.hbm_tbps is -1",
        "cpu_cores is 0",
    ):
        assert named in result.stderr, (named, result.stderr)
    assert " ram_gib is" not in result.stderr and not (tmp_path / "o").exists()
    profile.write_text('gpu: {name: RTX 6000 Ada Generation, vram_gib: 47.5, compute_capability: "8.9"}\nram_gib: 64\n')
    for args in (("generate", "--task", "pseudo2norm", "-o", tmp_path / "o"), ("estimate", "--task", "pseudo2norm")):
        result = run_lfa(*args, "--hardware", profile)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "gpu.peak_tflops_16bit" in result.stderr and "RTX 6000 Ada" in result.stderr
    profile.write_text(
        'gpu: {name: RTX 6000 Ada Generation, vram_gib: 47.5, compute_capability: "8.9", '
        "peak_tflops_16bit: 364.2, hbm_tbps: 0.96}\nram_gib: 64\n"
    )
    result = run_lfa(
        "estimate", "--task", "pseudo2norm", "--model", "LLM4Binary/llm4decompile-1.3b-v2", "--hardware", profile
    )
    assert result.returncode == 0, result.stderr


def test_existing_recipe_is_not_overwritten_without_force(tmp_path):
    args = [
        "generate",
        "--task",
        "pseudo2norm",
        "--model",
        "LLM4Binary/llm4decompile-1.3b-v2",
        "--hardware",
        "h200",
        "-o",
        tmp_path / "r",
    ]
    assert run_lfa(*args).returncode == 0
    again = run_lfa(*args)
    assert again.returncode == 2 and "--force" in again.stderr


def test_detect_reports_cpu_and_saves_a_loadable_profile(tmp_path):
    result = run_lfa("detect", "--json", "--no-network", "--save", tmp_path / "me.yaml")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["software"]) >= {
        "llamafactory",
        "transformers",
        "torch",
        "deepspeed",
        "liger-kernel",
        "flash-attn",
    }
    loaded = load_profile(str(tmp_path / "me.yaml"))
    assert loaded.gpus_per_node == report["profile"]["gpus_per_node"]
    # an existing file (here a recipe) is never replaced without --force
    recipe = tmp_path / "train.yaml"
    recipe.write_text("model_name_or_path: m\n")
    refused = run_lfa("detect", "--no-network", "--save", recipe)
    assert refused.returncode == 2 and "--force" in refused.stderr and recipe.read_text() == "model_name_or_path: m\n"
    assert run_lfa("detect", "--no-network", "--save", recipe, "--force").returncode == 0
    assert load_profile(str(recipe)).gpus_per_node == report["profile"]["gpus_per_node"]


def test_a_model_far_below_the_checked_sizes_gets_no_speed_to_be_held_to(demo_assets, tmp_path):
    """The demo's tiny model on the H200 was predicted at 232,821 tok/s and ran at 7,807 (kernel launches bound
    it): lfa ranks plans with the figure but says so, and the run is not held to it."""
    from lf_adapter.plan import Plan
    from lf_adapter.recipe.read import load_recipe
    from lf_adapter.run.preflight import attempt_prediction

    model, data = demo_assets
    result = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--model",
        model,
        "--dataset",
        data,
        "--hardware",
        "h200",
        "--set",
        "effective_batch_size=8",
        "-o",
        tmp_path / "r",
    )
    assert result.returncode == 0, result.stderr
    assert "only to rank plans" in result.stdout
    recipe, plan = load_recipe(tmp_path / "r" / "train.yaml"), Plan.from_label("bf16/mbs8xga1x1/nogc/liger/sdpa")
    tiny, big = load_model_spec(str(model)), load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    assert attempt_prediction(recipe, load_profile("h200"), plan, tiny)["tokens_per_s"] is None
    assert attempt_prediction(recipe, load_profile("h200"), plan, big)["tokens_per_s"] > 0


def test_lfa_diff_names_the_plugins_speed_settings(tmp_path):
    autocast = ("--no-master-weights",)
    for name, flags in (("a", autocast), ("b", (*autocast, "--no-token-budget", "--no-padding-free")), ("c", ())):
        result = run_lfa("generate", "--task", "pseudo2norm", "--hardware", "h200", *flags, "-o", tmp_path / name)
        assert result.returncode == 0, result.stderr
    diff = run_lfa("diff", tmp_path / "a" / "train.yaml", tmp_path / "b" / "train.yaml")
    speed = diff.stdout.split("changes speed or memory only:")[1]
    assert re.search(r"lfa_token_budget: \d+ -> 0\n", speed) and "lfa_padding_free: True -> False" in speed
    assert "changes training results" not in diff.stdout
    # master weights compute the residual stream in 16 bits: filed with what changes the results
    diff = run_lfa("diff", tmp_path / "a" / "train.yaml", tmp_path / "c" / "train.yaml")
    results = diff.stdout.split("changes training results:")[1].split("changes speed or memory only:")[0]
    assert "lfa_master_weights: False -> True" in results


def test_a_token_budget_below_cutoff_len_is_priced_as_a_row_of_cutoff_len():
    from lf_adapter.memory import estimate
    from lf_adapter.plan import Plan

    spec = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    small = estimate(spec, Plan("bf16", 1, 64, token_budget=1024), 2048, 80.0)
    row = estimate(spec, Plan("bf16", 1, 64, token_budget=2048), 2048, 80.0)
    assert small.reserved_gib == row.reserved_gib  # a 2,048-token row goes alone, whatever the budget


def test_a_soft_capped_family_is_never_planned_with_sdpa_which_drops_the_capping():
    from lf_adapter import UserError

    gemma2 = load_model_spec("google/gemma-2-2b")
    result = plan(gemma2, load_profile("h200"), 64, 2048)
    assert all(c.plan.attention != "sdpa" for c in [result.chosen, *result.runners_up])
    assert "soft-caps its attention scores" in result.chosen.plan.reasons["attention"]
    with pytest.raises(UserError, match="attention=sdpa: gemma2 soft-caps"):
        plan(gemma2, load_profile("h200"), 64, 2048, PlanOptions(fixed={"attention": "sdpa"}))
    llama = plan(load_model_spec("meta-llama/Llama-3.2-3B"), load_profile("h200"), 64, 2048)
    assert llama.chosen.plan.attention == "sdpa"


def test_the_recorded_generate_command_reads_back_as_the_same_request():
    """The recipe header's `lfa generate ...` comes from GenerateRequest.argv: parsed by the CLI's own options it
    gives back every field that changes the plan."""
    from pathlib import Path

    from lf_adapter.cli.plans import generate as generate_command
    from lf_adapter.recipe.generate import GenerateRequest

    request = GenerateRequest(
        task="pseudo2norm",
        out_dir=Path("/out"),
        model="/models/two words",
        dataset="/data/rows.jsonl",
        template="sk2decompile",
        hardware="a100-80g",
        gpus=2,
        allow_packing=True,
        precision="fp16",
        sort_steps=False,
        padding_free=False,
        token_budget=False,
        pins=("micro_batch_size=4", "liger=false"),
        launcher="ray",
        llamafactory_version="0.9.4",
        sets=("learning_rate=1.0e-5", "run_name=a b"),
        report_to="wandb",
        allow_optimizer_change=True,
        nvme_path="/nvme",
    )
    params = generate_command.make_context("generate", request.argv()).params
    assert params["out_dir"] is None  # the folder does not change the plan; the CLI's -o sets it
    expected = {
        "task": "pseudo2norm", "model": "/models/two words", "dataset": "/data/rows.jsonl", "template": "sk2decompile",
        "hardware": "a100-80g", "gpus": 2, "precision": "fp16", "allow_packing": True, "no_sorted_steps": True,
        "no_padding_free": True, "no_token_budget": True, "pins": ("micro_batch_size=4", "liger=false"),
        "launcher": "ray", "llamafactory_version": "0.9.4", "sets": ("learning_rate=1.0e-5", "run_name=a b"),
        "report_to": "wandb", "allow_optimizer_change": True, "nvme_path": "/nvme",
    }  # fmt: skip
    assert {k: params[k] for k in expected} == expected
    plain = GenerateRequest(task="pseudo2norm", out_dir=Path("/out"), hardware="cpu").argv()
    assert plain == ["--task", "pseudo2norm", "--hardware", "cpu"]
