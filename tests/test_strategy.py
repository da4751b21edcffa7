"""The strategy axis (sharding x offload), its constraints table, and strict loading of lfa's data files."""

import pytest
import yaml

from conftest import run_lfa
from lf_adapter import UserError
from lf_adapter.plan import Plan
from lf_adapter.strategy import CONSTRAINTS, violations


def test_sharding_and_offload_are_closed_vocabularies_and_none_means_ddp_on_several_gpus():
    assert Plan("bf16", 4, 4, world_size=1, sharding="ddp").sharding == "none"
    assert Plan("bf16", 4, 4, world_size=8).sharding == "ddp"
    assert Plan("bf16", 4, 4, world_size=8, sharding="zero2").deepspeed == "zero2"
    assert Plan("bf16", 4, 4, world_size=8, sharding="fsdp2").deepspeed is None
    for bad in ({"sharding": "zero9"}, {"offload": "disk"}, {"precision": "bf17"}, {"attention": "flash"}):
        with pytest.raises(ValueError, match="use one of"):
            Plan(**{"precision": "bf16", "micro_batch_size": 1, "grad_accum": 1, **bad})
    fsdp = Plan("bf16", 2, 4, world_size=8, sharding="fsdp2")
    assert fsdp.shards_parameters and fsdp.shards_gradients and fsdp.shards_optimizer
    assert Plan.from_label(fsdp.label(), nodes=1) == fsdp and "fsdp2" in fsdp.label()


def test_the_constraints_table_is_the_one_rule_for_planner_remedies_and_review(tmp_path):
    assert [c.rule for c in violations(Plan("bf16", 1, 8, world_size=2, liger=True, sharding="zero3"))] == [
        "liger_with_zero3"
    ]
    assert {c.rule for c in violations(Plan("bf16", 1, 8, world_size=2, sharding="zero2", offload="all"))} == {
        "parameter_offload_needs_zero3"
    }
    assert {c.rule for c in violations(Plan("bf16", 1, 8, world_size=2, sharding="fsdp2", offload="optimizer"))} >= {
        "offload_needs_deepspeed"
    }
    assert {c.rule for c in violations(Plan("bf16", 1, 8, sharding="fsdp2"))} == {"fsdp2_on_one_process"}
    assert {c.rule for c in violations(Plan("bf16", 2, 4, packing=True, padding_free=True))} == {
        "padding_free_with_packing"
    }
    assert Plan.from_label(Plan("bf16", 2, 4, padding_free=True).label()).padding_free
    # the planner never proposes a plan the table forbids
    from lf_adapter.hardware import load_profile
    from lf_adapter.model_spec import load_model_spec
    from lf_adapter.planner import PlanOptions, candidate_plans

    plans = list(
        candidate_plans(
            load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"), load_profile("dgx-h100-80g"), 64, PlanOptions()
        )
    )
    assert plans and not any(violations(p) for p in plans)
    assert any(p.liger for p in plans) and any(p.sharding == "zero3" for p in plans)
    assert all(c.key and c.fix and c.why for c in CONSTRAINTS)


def test_fsdp2_is_planned_only_when_pinned_and_its_memory_is_sharded(tmp_path):
    pinned = run_lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--hardware",
        "dgx-h100-80g",
        "--pin",
        "sharding=fsdp2",
        "-o",
        tmp_path / "f",
        "--json",
    )
    assert pinned.returncode == 0, pinned.stderr
    import json

    out = json.loads(pinned.stdout)
    assert "/fsdp2" in out["plan"] and "accelerate_fsdp2.yaml" in " ".join(out["files"])
    items = out["memory"]["items_gib"]
    # 6.7B over 8 GPUs: fp32 weights, grads and Adam sharded 8 ways (16 bytes/param / 8), not 16 bytes/param
    assert 12.0 < sum(v for k, v in items.items() if "sharded" in k) < 13.0
    default = run_lfa("generate", "--task", "pseudo2norm", "--hardware", "dgx-h100-80g", "-o", tmp_path / "d", "--json")
    assert "fsdp2" not in json.loads(default.stdout)["plan"]
    one_gpu = run_lfa(
        "generate", "--task", "pseudo2norm", "--hardware", "h200", "--pin", "sharding=fsdp2", "-o", tmp_path / "one"
    )
    assert one_gpu.returncode == 2 and "Traceback" not in one_gpu.stderr
    assert "fsdp2_on_one_process: FSDP2 on one process has nothing to shard it over" in one_gpu.stderr  # says why
    bad = run_lfa(
        "generate", "--task", "pseudo2norm", "--hardware", "h200", "--pin", "sharding=fsdp9", "-o", tmp_path / "b"
    )
    assert bad.returncode == 2 and "use one of none, ddp, zero1, zero2, zero3, fsdp2" in bad.stderr


def test_a_misspelled_profile_key_is_an_error_naming_the_nearest_key_at_every_level(tmp_path):
    profile = tmp_path / "box.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "name": "box",
                "gpus_per_node": 1,
                "ram_gb": 64,
                "gpu": {"name": "V100", "vram_gib": 31.7, "compute_capability": "7.0", "hbm_tpbs": 0.9},
            }
        )
    )
    result = run_lfa("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", tmp_path / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'ram_gb' (did you mean 'ram_gib'?)" in result.stderr
    assert "'gpu.hbm_tpbs' (did you mean 'gpu.hbm_tbps'?)" in result.stderr


def test_a_misspelled_ladder_step_or_catalog_key_is_found(monkeypatch, tmp_path):
    from lf_adapter import model_spec
    from lf_adapter.run import remedies
    from lf_adapter.run.monitor import FailureClass

    assert remedies.ladder_problems() == []
    typo = FailureClass("cuda_oom", True, (), ("fragmentation", "halve_micro_bach"))
    monkeypatch.setattr(remedies, "failure_classes", lambda: (typo,))
    assert remedies.ladder_problems() == [
        "class cuda_oom: ladder step 'halve_micro_bach' is no action (did you mean 'halve_micro_batch'?)"
    ]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "catalog.yaml").write_text("org/m: {arch: llama, hiden_size: 64}\n")
    monkeypatch.setattr(model_spec, "catalog_dir", lambda: tmp_path)
    with pytest.raises(UserError, match="'org/m: hiden_size' \\(did you mean 'org/m: hidden_size'\\?\\)"):
        model_spec.catalog()


def test_a_pin_the_planner_never_proposes_is_refused_with_the_reason():
    from lf_adapter import UserError
    from lf_adapter.hardware import load_profile
    from lf_adapter.model_spec import load_model_spec
    from lf_adapter.planner import PlanOptions, plan

    spec, a100 = load_model_spec("LLM4Binary/llm4decompile-6.7b-v2"), load_profile("a100-80g")
    with pytest.raises(UserError, match="does not plan ZeRO-1.*pin sharding=zero2"):
        plan(spec, a100, 64, 2048, PlanOptions(fixed={"sharding": "zero1"}))
    from lf_adapter.recipe.generate import parse_pins

    with pytest.raises(UserError, match="deepspeed=zero1: lfa does not plan ZeRO-1.*use zero2, zero3 or none"):
        parse_pins(("deepspeed=zero1",))
    with pytest.raises(UserError, match="deepspeed=zero9: use zero2, zero3 or none"):
        parse_pins(("deepspeed=zero9",))
    budget_under_zero3 = PlanOptions(fixed={"sharding": "zero3", "token_budget": 8192})
    with pytest.raises(UserError, match="token_budget under DeepSpeed or FSDP"):
        plan(spec, a100, 64, 2048, budget_under_zero3)
    small = load_model_spec("LLM4Binary/llm4decompile-1.3b-v2")
    dgx = plan(small, load_profile("dgx-a100-80g"), 64, 2048, PlanOptions(fixed={"token_budget": 8192}))
    assert all(not c.plan.deepspeed for c in [dgx.chosen, *dgx.runners_up])  # never priced under an engine


def test_behaviour_reads_the_strategy_records_never_a_strategys_identity():
    """One record per strategy (strategy.STRATEGIES): its template exists, its stage matches its engine, and no
    module outside strategy.py compares a sharding with a Sharding member."""
    import re
    from pathlib import Path

    from lf_adapter.strategy import STRATEGIES, Sharding

    repo = Path(__file__).resolve().parents[1]
    assert set(STRATEGIES) == {s.value for s in Sharding}
    for name, record in STRATEGIES.items():
        assert record.sharding == name
        assert (record.deepspeed_stage is not None) == (record.engine == "deepspeed"), name
        if record.config_template:
            assert (repo / "templates" / record.config_template).is_file(), record.config_template
        assert (record.proposed == "never") == bool(record.not_proposed_why), name
        assert record.offloads >= {"none"} and record.one_process_offloads <= record.offloads, name
        assert (record.config_file is not None) == (record.started_by == "accelerate"), name
    identity = re.compile(r"(==|!=|\bin\b)\s*\(?\s*Sharding\.[A-Z0-9]+")
    for path in (repo / "lf_adapter").rglob("*.py"):
        if path.name == "strategy.py":
            continue
        hits = [line.strip() for line in path.read_text().splitlines() if identity.search(line)]
        assert not hits, f"{path.relative_to(repo)}: {hits}"
    # what the records say is what plans do
    zero3 = Plan("bf16", 1, 8, world_size=2, sharding="zero3")
    assert zero3.sixteen_bit_model and zero3.shards_parameters and zero3.deepspeed_stage == 3
    assert not Plan("bf16", 1, 8).sixteen_bit_model and not Plan("bf16", 1, 8).distributed
    assert Plan("bf16", 1, 8, sharding="zero2").distributed  # DeepSpeed relaunches through torchrun on one GPU


def test_the_planners_search_space_is_what_the_records_propose():
    """planner._engines reads the records: the engines proposed always, with the offloads each runs (on one GPU the
    ones worth it there, none added when pinned); NVMe only with an SSD; a pinned-only strategy alone when pinned."""
    import dataclasses

    from lf_adapter.hardware import DiskSpec, load_profile
    from lf_adapter.planner import PlanOptions, _engines
    from lf_adapter.strategy import STRATEGIES

    one = load_profile("a100-80g")
    no_disk = dataclasses.replace(one, disk=None)
    assert _engines(no_disk, PlanOptions()) == [(None, "none"), ("zero2", "optimizer"), ("zero3", "all")]
    ssd = dataclasses.replace(one, disk=DiskSpec("/tmp/swap", 500.0))
    assert _engines(ssd, PlanOptions())[-2:] == [("zero3", "nvme-optimizer"), ("zero3", "nvme-all")]
    spinning = dataclasses.replace(one, disk=DiskSpec("/tmp/swap", 500.0, rotational=True))
    assert _engines(spinning, PlanOptions()) == _engines(no_disk, PlanOptions())
    pinned = _engines(no_disk, PlanOptions(fixed={"sharding": "zero3"}))
    assert ("zero3", "none") in pinned and ("zero3", "optimizer") not in pinned
    several = _engines(dataclasses.replace(load_profile("a40x4"), disk=None), PlanOptions())
    proposed = {n for n, s in STRATEGIES.items() if s.proposed == "always" and s.engine != "none"}
    expected = {(n, o) for n in proposed for o in STRATEGIES[n].offloads if not o.startswith("nvme")}
    assert set(several) == {(None, "none"), *expected}
    assert _engines(load_profile("a40x4"), PlanOptions(fixed={"sharding": "fsdp2"})) == [("fsdp2", "none")]
    assert _engines(load_profile("cpu"), PlanOptions()) == [(None, "none")]
