"""A plan for every card (issue 25): the disk as a memory tier (NVMe offload, ZeRO-3), memory-light optimizers as
opt-in plans, one-GPU DeepSpeed only for offload, and what each sharding strategy divides."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_lfa
from lf_adapter import UserError
from lf_adapter.hardware import DiskSpec, load_profile, measure_disk, profile_from_dict
from lf_adapter.memory import GIB, coefficients, disk_gib, estimate, host_memory, nvme_settings
from lf_adapter.model_spec import load_model_spec
from lf_adapter.plan import Plan
from lf_adapter.plan_reasons import machine_options, ruled_out_optimizers
from lf_adapter.planner import PlanOptions, candidate_plans, plan
from lf_adapter.throughput import predict_tokens_per_s

SIX_7B = "LLM4Binary/llm4decompile-6.7b-v2"
FIXTURES = Path(__file__).parent / "fixtures" / "failures"


def _profile_without_disk(tmp_path: Path, ram_gib: int = 128) -> Path:
    text = (REPO / "catalog" / "hardware" / "v100-32g.yaml").read_text().replace("ram_gib: 128", f"ram_gib: {ram_gib}")
    path = tmp_path / f"v100-{ram_gib}g-no-disk.yaml"
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("disk:")))
    return path


@pytest.mark.parametrize("ram_gib", [128, 64])
def test_the_seed_card_gets_an_exact_fp16_nvme_plan_with_batch_64_and_its_wall_time(tmp_path, ram_gib):
    profile = tmp_path / "v100.yaml"
    profile.write_text(
        (REPO / "catalog" / "hardware" / "v100-32g.yaml").read_text().replace("ram_gib: 128", f"ram_gib: {ram_gib}")
    )
    result = run_lfa("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", tmp_path / "r", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    chosen = Plan.from_label(out["plan"])
    assert chosen.precision == "fp16" and chosen.effective_batch_size == 64 and not chosen.changes_optimizer
    assert chosen.offloads_to_nvme and chosen.sharding == "zero3"
    assert out["host"]["fits"] and out["memory"]["fits"] and out["disk_gib"] > 90
    listing = "\n".join(out["machine_options"])
    assert "[exact]" in listing and "days" in listing and "per step" in listing and "PREDICTED" in listing
    # the 8-bit optimizer's states alone do not fit a 31.73 GiB card: listed with why, never chosen
    assert "adamw_8bit" in listing and "does not fit: GPU" in listing
    ds = json.loads((tmp_path / "r" / "ds_zero3_offload_nvme_optimizer.json").read_text())
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "nvme" and zero["offload_optimizer"]["nvme_path"] == "/local_nvme"
    assert zero["sub_group_size"] == int(coefficients()["nvme"]["sub_group_size"]) and ds["aio"]["block_size"] > 0
    assert "optimizer" in ds  # CPU Adam steps the swapped states
    recipe = (tmp_path / "r" / "train.yaml").read_text()
    assert (
        "fp16: true" in recipe and "bf16: true" not in recipe and "use_badam" not in recipe and "optim:" not in recipe
    )


def test_without_a_disk_or_room_on_it_nothing_exact_fits_and_the_message_says_how_to_declare_one(tmp_path):
    result = run_lfa(
        "generate", "--task", "pseudo2norm", "--hardware", _profile_without_disk(tmp_path), "-o", tmp_path / "r"
    )
    assert result.returncode == 2 and not (tmp_path / "r" / "train.yaml").exists()
    assert "declare it in the profile as disk" in result.stderr and "lfa detect --measure-disk" in result.stderr
    assert "what runs on this machine" in result.stderr and "badam" in result.stderr  # opt-in shown, not chosen
    assert "Traceback" not in result.stderr
    small = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--hardware",
        "v100-32g",
        "--nvme-path",
        tmp_path / "swap",
        "-o",
        tmp_path / "s",
    )
    free = shutil.disk_usage(tmp_path).free / GIB
    if free * 0.9 < 100:  # this machine's disk cannot hold the 6.7B's 100 GiB of swapped states
        assert small.returncode == 2 and "free at the swap folder" in small.stderr


def test_nvme_offload_is_priced_for_gpu_host_and_disk_and_its_step_streams_at_the_disk_rate():
    model = load_model_spec(SIX_7B)
    hardware = load_profile("v100-32g")
    nvme = Plan("fp16", 8, 8, sharding="zero3", offload="nvme-optimizer")
    cpu = nvme.replace(offload="optimizer")
    # the same GPU states as CPU offload; the host keeps buffers, not the 16 B/param of fp32 master + Adam + grads
    assert estimate(model, nvme, 2048, 31.73).items == estimate(model, cpu, 2048, 31.73).items
    assert host_memory(model, nvme, hardware).total_gib < host_memory(model, cpu, hardware).total_gib / 3
    assert disk_gib(model, nvme) == pytest.approx(16 * model.num_params / GIB)
    assert disk_gib(model, nvme.replace(offload="nvme-all")) == pytest.approx(18 * model.num_params / GIB)
    assert disk_gib(model, cpu) == 0
    # pinned swap buffers follow the rendered sub-group size
    settings = nvme_settings(model)
    host = host_memory(model, nvme, hardware).items
    assert host["pinned fp32 NVMe swap buffers (optimizer) x ranks"] == pytest.approx(
        settings.optimizer_buffer_count * settings.sub_group_size * 4 / GIB
    )
    assert settings.param_buffer_size >= model.embedding_params  # DeepSpeed needs the largest tensor to fit
    # a disk half as fast makes the step slower by its share of 32 B/param
    slow = dataclasses.replace(hardware, disk=dataclasses.replace(hardware.disk, read_gbs=0.95, write_gbs=1.1))
    fast_s = 1 / predict_tokens_per_s(model, nvme, hardware, 2048, 0.75)
    slow_s = 1 / predict_tokens_per_s(model, nvme, slow, 2048, 0.75)
    assert slow_s > fast_s * 1.2


def test_one_gpu_gets_deepspeed_only_for_offload_unless_pinned():
    """A pinned mbs2 6.7B plan on one H200 was given zero2 without offload, predicted 116 GiB, and died allocating
    a 25 GiB fp32 copy: on one GPU ZeRO shards nothing."""
    model, hardware = load_model_spec(SIX_7B), load_profile("h200")
    plans = list(candidate_plans(model, hardware, 64, PlanOptions()))
    assert not any(p.deepspeed and p.offload == "none" for p in plans)
    assert any(p.offloads_to_nvme for p in plans) and any(p.offload == "optimizer" for p in plans)
    pinned = list(candidate_plans(model, hardware, 64, PlanOptions(fixed={"sharding": "zero2"})))
    assert pinned and all(p.sharding == "zero2" for p in pinned) and any(p.offload == "none" for p in pinned)


def test_each_sharding_divides_what_its_strategy_record_says():
    from lf_adapter.strategy import STRATEGIES, Sharding

    model = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")

    def state(sharding, word):
        items = estimate(model, Plan("bf16", 4, 2, world_size=8, sharding=sharding), 2048, None).items
        return sum(v for k, v in items.items() if k.startswith(word))

    for sharding in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
        one, shards = 2.0 * model.num_params / GIB, STRATEGIES[sharding].shards
        assert state(sharding, "gradients") == pytest.approx(one / 8 if "gradients" in shards else one)
        assert state(sharding, "weights") == pytest.approx(one / 8 if "parameters" in shards else one)
        assert "optimizer" in shards
        assert state(sharding, "optimizer") == pytest.approx(12.0 * model.num_params / GIB / 8)


def test_memory_light_optimizers_are_priced_rendered_flagged_and_never_chosen_without_the_opt_in(tmp_path):
    model, hardware = load_model_spec(SIX_7B), load_profile("v100-32g")
    exact = plan(model, hardware, 64, 2048, PlanOptions(fixed={"precision": "fp16"}, liger_available=False))
    assert not exact.chosen.plan.changes_optimizer
    opted = plan(
        model,
        hardware,
        64,
        2048,
        PlanOptions(fixed={"precision": "fp16"}, liger_available=False, allow_optimizer_change=True),
    )
    assert opted.chosen.tokens_per_s >= exact.chosen.tokens_per_s
    listed = machine_options(exact.priced)
    rows = {o.candidate.plan.optimizer: o for o in listed if o.kind != "exact"}
    # 8-bit moments leave fp32 weights and grads: no fit on the seed's card; BAdam cannot run in fp16 at all
    assert not rows["adamw_8bit"].fits and "badam" not in rows
    assert "loss scaler" in ruled_out_optimizers([o.candidate for o in listed])["badam"]
    # on a bf16 card with room BAdam is the opt-in choice; under it LLaMA-Factory checkpoints only the trainable
    # layer, so the 31 others keep their activations (5.4 GiB of the 21.1 priced): no fit on a 20 GiB card
    a100 = load_profile("a100-80g")
    assert plan(model, a100, 64, 2048, PlanOptions(allow_optimizer_change=True)).chosen.plan.optimizer == "badam"
    small = dataclasses.replace(a100, gpu=dataclasses.replace(a100.gpu, vram_gib=20.0))
    assert plan(model, small, 64, 2048, PlanOptions(allow_optimizer_change=True)).chosen.plan.optimizer != "badam"
    eight = estimate(model, Plan("fp16", 1, 64, optimizer="adamw_8bit"), 2048, None).items
    assert eight["optimizer (8-bit Adam m, v + fp32 block scales, bitsandbytes)"] == pytest.approx(
        (2 + 8 / 256) * model.num_params / GIB
    )
    assert eight["weights (fp32)"] == eight["gradients (fp32)"]  # 8-bit moments alone leave fp32 weights and grads
    badam = estimate(model, Plan("fp16", 1, 64, optimizer="badam"), 2048, None).items
    assert badam["weights (bfloat16 as loaded, BAdam: no fp32 upcast)"] == pytest.approx(2 * model.num_params / GIB)
    copies = next(v for k, v in badam.items() if k.startswith("autocast fp16 weight copies"))
    assert copies == pytest.approx(2 * 31 * model.params_per_layer / GIB)
    assert any(k.startswith("activations (31 of 32 layers not checkpointed") for k in badam)
    # a checkpoint already in the compute dtype is not cast: no copies, and the same plan needs less
    fp16_model = dataclasses.replace(model, torch_dtype="float16")
    same_dtype = estimate(fp16_model, Plan("fp16", 1, 64, optimizer="badam"), 2048, None)
    assert not any(k.startswith("autocast") for k in same_dtype.items)
    assert same_dtype.allocated_gib == pytest.approx(sum(badam.values()) - copies)
    # rendered with LLaMA-Factory's keys and read back to the same plan; review flags the change
    result = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--hardware",
        "v100-32g",
        "--pin",
        "optimizer=adamw_8bit",
        "--model",
        "LLM4Binary/llm4decompile-1.3b-v2",
        "-o",
        tmp_path / "e",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "e" / "train.yaml").read_text()
    assert "optim: adamw_bnb_8bit" in text and "CHANGES WHAT IS TRAINED" in text
    from lf_adapter.recipe.read import load_recipe, plan_from_recipe

    assert plan_from_recipe(load_recipe(tmp_path / "e" / "train.yaml"), hardware).optimizer == "adamw_8bit"
    review = run_lfa("review", tmp_path / "e" / "train.yaml", "--format", "json")
    assert "optimizer_changed" in review.stdout
    refused = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--hardware",
        "v100-32g",
        "--pin",
        "optimizer=badam",
        "--model",
        "LLM4Binary/llm4decompile-1.3b-v2",
        "-o",
        tmp_path / "r",
    )
    assert refused.returncode == 2 and "badam_needs_bf16" in refused.stderr and not (tmp_path / "r").exists()
    badam_recipe = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--hardware",
        "a100-80g",
        "--pin",
        "optimizer=badam",
        "--model",
        "LLM4Binary/llm4decompile-1.3b-v2",
        "-o",
        tmp_path / "b",
    )
    assert badam_recipe.returncode == 0 and "use_badam: true" in (tmp_path / "b" / "train.yaml").read_text()
    bad = run_lfa(
        "generate", "--task", "pseudo2norm", "--hardware", "v100-32g", "--pin", "optimizer=lion", "-o", tmp_path / "x"
    )
    assert bad.returncode == 2 and "adamw_8bit" in bad.stderr and "Traceback" not in bad.stderr


def test_profiles_load_their_disk_strictly_and_detect_measures_one(tmp_path):
    base = {"name": "x", "gpus_per_node": 1, "gpu": {"name": "g", "vram_gib": 30, "compute_capability": "8.0"}}
    disk = profile_from_dict(
        {**base, "disk": {"path": "/nvme", "free_gib": 500, "read_gbs": 3.0, "write_gbs": 2.0}}
    ).disk
    assert disk == DiskSpec("/nvme", 500.0, 3.0, 2.0)
    with pytest.raises(UserError, match="did you mean 'disk.read_gbs'"):
        profile_from_dict({**base, "disk": {"path": "/nvme", "free_gib": 500, "read_gb": 3.0}})
    with pytest.raises(UserError, match="not valid"):
        profile_from_dict({**base, "disk": {"path": "/nvme"}})
    try:
        write, read = measure_disk(str(tmp_path), size_mib=16)
    except UserError as exc:  # a file system without O_DIRECT (tmpfs) says so in one line
        assert "O_DIRECT" in str(exc) or "cannot measure" in str(exc)
    else:
        assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []  # its scratch folder is gone


def test_doctor_replans_the_papers_bf16_recipe_for_the_v100_as_an_fp16_nvme_plan_that_review_passes(tmp_path):
    (tmp_path / "train.yaml").write_text(
        "model_name_or_path: LLM4Binary/llm4decompile-6.7b-v2\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
        "deepspeed: examples/ds_z2_config.json\ndataset: pseudo2norm\ndataset_dir: data\ntemplate: sk2decompile\n"
        "cutoff_len: 2048\noutput_dir: saves/p2n\nper_device_train_batch_size: 8\ngradient_accumulation_steps: 8\n"
        "learning_rate: 3.0e-6\nlr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr: 3.0e-7}\n"
        "bf16: true\n"
    )
    # a fork's layout: paths relative to where llamafactory-cli runs (the fork's root), not to the recipe
    fork = tmp_path / "fork"
    (fork / "examples").mkdir(parents=True)
    (fork / "data").mkdir()
    (fork / "examples" / "ds_z2_config.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    (fork / "data" / "pseudo2norm.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n' * 128)
    (fork / "data" / "dataset_info.json").write_text(json.dumps({"pseudo2norm": {"file_name": "pseudo2norm.jsonl"}}))
    recipe = fork / "train" / "p2n.yaml"
    recipe.parent.mkdir()
    recipe.write_text((tmp_path / "train.yaml").read_text())
    shutil.copy(FIXTURES / "cuda_oom_seed_v100.log", tmp_path / "nohup.out")
    result = run_lfa("doctor", tmp_path / "nohup.out", "--recipe", "train/p2n.yaml", "--hardware", "v100-32g", cwd=fork)
    assert result.returncode == 0, result.stdout + result.stderr
    written = (fork / "train" / "p2n.next.yaml").read_text()
    assert "fp16: true" in written and "bf16: true" not in written and "no native bf16" in result.stdout
    # the same recipe beside its files (an lfa-style folder): the next recipe passes review for the V100
    flat = tmp_path / "flat"
    shutil.copytree(fork / "data", flat / "data")
    shutil.copy(fork / "examples" / "ds_z2_config.json", flat / "ds_z2_config.json")
    (flat / "train.yaml").write_text((tmp_path / "train.yaml").read_text().replace("examples/", ""))
    again = run_lfa(
        "doctor", tmp_path / "nohup.out", "--recipe", flat / "train.yaml", "--hardware", "v100-32g", cwd=flat
    )
    assert again.returncode == 0, again.stdout + again.stderr
    from lf_adapter.recipe.read import load_recipe, plan_from_recipe

    nxt = plan_from_recipe(load_recipe(flat / "train.next.yaml"), load_profile("v100-32g"))
    assert nxt.effective_batch_size == 64 and nxt.offloads_to_nvme and nxt.precision == "fp16"
    review = run_lfa("review", flat / "train.next.yaml", "--hardware", "v100-32g", cwd=flat)
    assert review.returncode == 0 and " 0 error(s)" in review.stdout, review.stdout + review.stderr
    missing = run_lfa("doctor", tmp_path / "nohup.out", "--recipe", "nope.yaml", "--json", cwd=fork)
    assert missing.returncode == 2 and "error" in json.loads(missing.stdout)
