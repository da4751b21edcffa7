"""`lfa review` and `lfa diff`: a clean recipe has no findings; each broken recipe is a real mistake (from the seed
author's four crashes or from LLaMA-Factory's issue tracker) with the finding it must produce."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO, run_lfa
from lf_adapter.plan import Plan
from lf_adapter.recipe.render import render_deepspeed
from lf_adapter.review.lf_checks import installed_version, version_matches

LF_STOCK_Z2_OFFLOAD = {  # LLaMA-Factory's examples/deepspeed/ds_z2_offload_config.json (no optimizer section)
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


@pytest.fixture
def clean_recipe(tmp_path):
    """The v100-32g golden recipe, as lfa generates it for the installed stack (the warmup key follows the installed
    transformers), with its data file present: what a reviewer should see with no findings."""
    folder = tmp_path / "v100-32g"
    args = ("--task", "pseudo2norm", "--model", "LLM4Binary/llm4decompile-1.3b-v2", "--hardware", "v100-32g")
    assert run_lfa("generate", *args, "-o", folder).returncode == 0
    (folder / "data").mkdir()
    row = {
        "instruction": "",
        "input": "# This is the pseudo code:\nint a1;\n# What is the source code?\n",
        "output": "int var1;",
    }
    (folder / "data" / "pseudo2norm.jsonl").write_text((json.dumps(row) + "\n") * 640)
    return folder / "train.yaml"


def _review(*args):
    result = run_lfa("review", *args, "--format", "json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else None


def _edit(recipe, pattern, replacement):
    text = recipe.read_text()
    new = re.sub(pattern, replacement, text, count=1, flags=re.M)
    assert new != text, pattern
    recipe.write_text(new)


def _line_of(recipe, key):
    return next(i for i, line in enumerate(recipe.read_text().splitlines(), 1) if line.startswith(f"{key}:"))


def test_clean_recipe_has_no_findings(clean_recipe):
    code, [review] = _review(clean_recipe)
    assert code == 0 and review["findings"] == []
    s = review["summary"]
    assert s["effective_batch"] == 64 and s["fits"] and s["dataset_rows"] == 640 and s["predicted_wall_time_s"] > 0


def _seed_bf16(recipe):  # the seed's first crash: the paper's bf16 on a V100
    _edit(recipe, r"^fp16: true", "bf16: true")
    return "bf16", "error", "bf16_unsupported"


def _deepspeed_without_torchrun(recipe):  # the seed's second crash
    (recipe.parent / "ds.json").write_text((REPO / "recipes/pseudo2norm/dgx-a100-80g/ds_zero2.json").read_text())
    _edit(recipe, r"^finetuning_type: full", "finetuning_type: full\ndeepspeed: ds.json")
    (recipe.parent / "launch.sh").write_text("#!/bin/bash\nexec llamafactory-cli train train.yaml\n")
    return "deepspeed", "error", "deepspeed_without_torchrun"


def _stock_offload_config(recipe):  # LLaMA-Factory issues: "ZeRO-Offload with a client provided optimizer"
    (recipe.parent / "ds_z2_offload_config.json").write_text(json.dumps(LF_STOCK_Z2_OFFLOAD))
    _edit(recipe, r"^finetuning_type: full", "finetuning_type: full\ndeepspeed: ds_z2_offload_config.json")
    return "deepspeed", "error", "offload_without_optimizer"


def _exponent_float(recipe):  # a float written like JSON: a string to plain PyYAML
    _edit(recipe, r"^learning_rate: .*", "learning_rate: 3e-6")
    return "learning_rate", "warning", "exponent_float"


def _save_strategy_no(recipe):  # YAML 1.1 reads `no` as false
    _edit(recipe, r"^save_steps: .*", "save_strategy: no")
    return "save_strategy", "error", "yaml_boolean"


def _typo(recipe):
    _edit(recipe, r"^warmup_(ratio|steps):", "warmup_stepz:")
    return "warmup_stepz", "error", "unknown_key"


def _severity_here(package, accepted):
    """What review must say of a version-dependent key on this install: error where the installed version rejects
    it, info where it accepts it (a dev build counts as its release)."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return "info" if Version(Version(version(package)).base_version) in SpecifierSet(accepted) else "error"


def _ray_key_from_094(recipe):  # Ray keys changed between LLaMA-Factory 0.9.4 and 0.9.5
    _edit(recipe, r"^report_to: none", "report_to: none\nray_run_name: pseudo2norm")
    return "ray_run_name", _severity_here("llamafactory", "<=0.9.4"), "version_dependent_key"


def _transformers4_key(recipe):  # group_by_length became train_sampling_strategy in transformers 5
    _edit(recipe, r"^report_to: none", "report_to: none\ngroup_by_length: true")
    return "group_by_length", _severity_here("transformers", "<5"), "version_dependent_key"


def _seed_fix_batch(recipe):  # the seed's manual fix: bs1 x ga16, an effective batch of 16 instead of 64
    _edit(recipe, r"^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 16")
    return "per_device_train_batch_size", "warning", "effective_batch_changed"


def _original_on_32g(recipe):  # the paper's bs8 x ga8 without checkpointing on a 32 GB card
    _edit(recipe, r"^per_device_train_batch_size: \d+", "per_device_train_batch_size: 8")
    _edit(recipe, r"^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 8")
    return "per_device_train_batch_size", "error", "memory_over_budget"


def _liger_with_zero3(recipe):  # trl#3368 / #5891: liger's fused loss + ZeRO-3 -> size mismatch
    (recipe.parent / "ds_zero3.json").write_text(render_deepspeed(Plan("bf16", 1, 64, sharding="zero3"))[1])
    _edit(recipe, r"^finetuning_type: full", "finetuning_type: full\ndeepspeed: ds_zero3.json")
    if "enable_liger_kernel: true" not in recipe.read_text():  # lfa plans no liger below sm80 (Triton's floor)
        _edit(recipe, r"^flash_attn: (\w+)", "flash_attn: \\1\nenable_liger_kernel: true")
    return "enable_liger_kernel", "error", "liger_with_zero3"


def _zero3_with_min_lr(recipe):  # seen on the H200: optimizer.defaults is missing under ZeRO-3
    (recipe.parent / "ds_zero3.json").write_text(render_deepspeed(Plan("bf16", 1, 64, sharding="zero3"))[1])
    _edit(recipe, r"^finetuning_type: full", "finetuning_type: full\ndeepspeed: ds_zero3.json")
    _edit(recipe, r"^  min_lr_rate: .*", "  min_lr: 3.0e-7")
    return "lr_scheduler_kwargs", "error", "zero3_min_lr"


def _space_in_path_with_deepspeed(recipe):  # torchrun's relaunch splits the path
    _deepspeed_without_torchrun(recipe)
    (recipe.parent / "launch.sh").write_text(
        "#!/bin/bash\nexport FORCE_TORCHRUN=1\nexec llamafactory-cli train train.yaml\n"
    )
    _edit(recipe, r"^output_dir: .*", "output_dir: saves/my run")
    return "output_dir", "error", "path_with_spaces"


def _template_typo(recipe):
    _edit(recipe, r"^template: .*", "template: sk2decompil")
    return "template", "error", "unknown_template"


def _dataset_typo(recipe):
    _edit(recipe, r"^dataset: .*", "dataset: pseudo2nrom")
    return "dataset", "error", "dataset_undefined"


def _zero_micro_batch(recipe):  # a batch of 0 rows: LLaMA-Factory's parser takes it (an int), training cannot
    _edit(recipe, r"^per_device_train_batch_size: \d+", "per_device_train_batch_size: 0")
    return "per_device_train_batch_size", "error", "not_a_count"


def _negative_cutoff(recipe):
    _edit(recipe, r"^cutoff_len: \d+", "cutoff_len: -5")
    return "cutoff_len", "error", "not_a_count"


def _cutoff_not_a_number(recipe):  # lfa's summary goes on at LLaMA-Factory's default; the parser names the type
    _edit(recipe, r"^cutoff_len: \d+", "cutoff_len: abc")
    return "cutoff_len", "error", "wrong_type"


@pytest.mark.parametrize(
    "mistake",
    [
        _zero_micro_batch,
        _negative_cutoff,
        _cutoff_not_a_number,
        _seed_bf16,
        _deepspeed_without_torchrun,
        _stock_offload_config,
        _exponent_float,
        _save_strategy_no,
        _typo,
        _ray_key_from_094,
        _transformers4_key,
        _seed_fix_batch,
        _original_on_32g,
        _space_in_path_with_deepspeed,
        _template_typo,
        _dataset_typo,
        _liger_with_zero3,
        _zero3_with_min_lr,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_each_real_mistake_gets_its_finding_at_its_line(clean_recipe, mistake):
    key, severity, rule = mistake(clean_recipe)
    code, [review] = _review(clean_recipe)
    found = [f for f in review["findings"] if f["rule"] == rule]
    assert found, review["findings"]
    assert found[0]["severity"] == severity and found[0]["line"] == _line_of(clean_recipe, key)
    assert code == (1 if any(f["severity"] == "error" for f in review["findings"]) else 0)
    assert code == 1 or severity != "error"


def test_unknown_key_suggests_the_nearest_valid_key(clean_recipe):
    _typo(clean_recipe)
    _, [review] = _review(clean_recipe)
    assert "did you mean `warmup_steps`" in next(f["message"] for f in review["findings"] if f["rule"] == "unknown_key")


def test_markdown_for_a_pr_comment_and_text_with_file_line(clean_recipe, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(clean_recipe.parent, broken)
    _seed_bf16(broken / "train.yaml")
    result = run_lfa("review", clean_recipe, broken / "train.yaml", "--format", "markdown")
    assert result.returncode == 1
    md = result.stdout
    assert md.startswith("## lfa review: 2 recipe(s), **1 error(s)**")
    assert f"### `{clean_recipe}`" in md and "No findings." in md
    assert "| ❌ error | " in md and "`bf16_unsupported`" in md
    meta = next(x for x in clean_recipe.read_text().splitlines() if x.startswith("# lfa-meta: "))
    plan = json.loads(meta[len("# lfa-meta: ") :])["plan"]
    assert plan.startswith("fp16/mbs1xga64x1/") and f"| `{plan}` on v100-32g | 64 = 1 x 64 x 1 |" in md
    text = run_lfa("review", broken / "train.yaml")
    assert (
        f"{broken / 'train.yaml'}:{_line_of(broken / 'train.yaml', 'bf16')}: error: [bf16_unsupported]" in text.stdout
    )
    github = run_lfa("review", broken / "train.yaml", "--format", "github")
    assert github.stdout.startswith(f"::error file={broken / 'train.yaml'},line=")


def test_review_against_the_base_branch_and_lfa_diff(clean_recipe):
    folder = clean_recipe.parent
    git = lambda *a: subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=folder, check=True, capture_output=True
    )
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "base")
    base_copy = folder.parent / "base.yaml"
    shutil.copy(clean_recipe, base_copy)
    _edit(clean_recipe, r"^learning_rate: .*", "learning_rate: 1.0e-5")
    _edit(clean_recipe, r"^logging_steps: .*", "logging_steps: 1")
    code, [review] = _review(clean_recipe, "--base", "HEAD")
    assert code == 0 and review["base"] == "HEAD"
    assert [(d["group"], d["key"]) for d in review["diff"]] == [
        ("results", "learning_rate"),
        ("other", "logging_steps"),
    ]
    diff = run_lfa("diff", base_copy, clean_recipe)
    assert diff.returncode == 0
    assert diff.stdout.index("changes training results") < diff.stdout.index("bookkeeping")
    assert "learning_rate: 3e-06 -> 1e-05" in diff.stdout
    same = run_lfa("diff", base_copy, base_copy)
    assert "no semantic change" in same.stdout


def test_a_missing_recipe_is_one_error_and_the_others_are_still_reviewed(clean_recipe, tmp_path):
    code, reviews = _review(tmp_path / "nope.yaml", clean_recipe, tmp_path / "gone.yaml")
    assert code == 1 and [r["path"] for r in reviews] == [
        str(tmp_path / "nope.yaml"),
        str(clean_recipe),
        str(tmp_path / "gone.yaml"),
    ]
    for missing in (reviews[0], reviews[2]):
        assert [(f["rule"], f["severity"]) for f in missing["findings"]] == [("unreadable_recipe", "error")]
        assert "does not exist" in missing["findings"][0]["message"]
    assert reviews[1]["summary"] and not reviews[1]["findings"]
    wrong_flag = run_lfa("review", clean_recipe, "--hardware", "nope")
    assert wrong_flag.returncode == 2 and wrong_flag.stderr.count("no hardware profile 'nope'") == 1


def test_missing_deepspeed_file_is_one_finding_and_every_other_rule_still_runs(clean_recipe):
    """The seed's paper recipe copied without its DeepSpeed JSON: bf16 on a V100, the missing file and the memory
    verdict all come out, in every format."""
    _edit(clean_recipe, r"^fp16: true", "bf16: true")
    _edit(clean_recipe, r"^per_device_train_batch_size: \d+", "per_device_train_batch_size: 8")
    _edit(clean_recipe, r"^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 8")
    with clean_recipe.open("a") as fh:
        fh.write("deepspeed: ds_z2_config.json\nmax_samples: 100\n")
    code, [review] = _review(clean_recipe)
    rules = {f["rule"]: f for f in review["findings"]}
    assert code == 1
    assert {"deepspeed_config", "bf16_unsupported", "memory_over_budget", "max_samples", "few_steps_per_epoch"} <= set(
        rules
    ), rules
    assert rules["deepspeed_config"]["line"] == _line_of(clean_recipe, "deepspeed")
    assert "ds_z2_config.json" in rules["deepspeed_config"]["message"]
    for fmt in ("text", "markdown", "github"):
        result = run_lfa("review", clean_recipe, "--format", fmt)
        assert result.returncode == 1 and "Traceback" not in result.stderr and "ds_z2_config.json" in result.stdout


def test_relative_paths_resolve_where_llamafactory_runs(clean_recipe, tmp_path):
    """LLaMA-Factory resolves dataset_dir against its working directory: reviewed for another --workdir, the
    dataset_info.json beside the recipe is not found, and the finding says where it is."""
    code, [review] = _review(clean_recipe, "--workdir", tmp_path)
    [finding] = [f for f in review["findings"] if f["rule"] == "dataset_info_missing"]
    assert finding["message"].startswith(str(tmp_path)) and "dataset_info.json does not exist" in finding["message"]
    assert "exists relative to the recipe" in finding["message"]


def test_offload_over_host_ram_is_an_error(clean_recipe, tmp_path):
    """ZeRO-2 offload of the 6.7B model on a 64 GiB host: the optimizer states alone are larger than the RAM."""
    profile = tmp_path / "v100-64g-ram.yaml"
    text = (REPO / "catalog" / "hardware" / "v100-32g.yaml").read_text().replace("ram_gib: 128", "ram_gib: 64")
    profile.write_text(text)
    (clean_recipe.parent / "ds_z2_offload.json").write_text(
        render_deepspeed(Plan.from_label("fp16/mbs1xga64x1/gc/sdpa/zero2-offload-optimizer"))[1]
    )
    with clean_recipe.open("a") as fh:
        fh.write("deepspeed: ds_z2_offload.json\n")
    code, [review] = _review(clean_recipe, "--hardware", profile, "--model", "LLM4Binary/llm4decompile-6.7b-v2")
    [finding] = [f for f in review["findings"] if f["rule"] == "host_memory_over"]
    assert finding["severity"] == "error" and "64 GiB" in finding["message"]
    assert review["summary"]["host_gib"] > 64


def test_a_warmup_ratio_written_as_warmup_steps_is_an_error_where_transformers_reads_it_as_steps(clean_recipe):
    clean_recipe.write_text(
        re.sub(r"^warmup_(ratio|steps): .*", "warmup_steps: 0.02", clean_recipe.read_text(), flags=re.M)
    )
    _, [review] = _review(clean_recipe)
    found = [f for f in review["findings"] if f["rule"] == "warmup_steps_ratio"]
    installed = installed_version("transformers")
    if version_matches(installed, ">=5"):
        assert not found  # transformers 5 reads it as a ratio of the total steps
    else:
        assert found[0]["severity"] == "error" and "`warmup_ratio: 0.02`" in found[0]["message"]


def test_generate_writes_the_warmup_key_the_target_transformers_reads(tmp_path):
    from lf_adapter.recipe.generate import GenerateRequest, generate
    from lf_adapter.recipe.keys import warmup_key

    assert (warmup_key("4.57.1"), warmup_key("5.6.0"), warmup_key("5.17.0")) == ("warmup_ratio", *["warmup_steps"] * 2)
    for version, key in (("4.57.1", "warmup_ratio"), ("5.17.0", "warmup_steps")):
        request = GenerateRequest(task="pseudo2norm", out_dir=tmp_path / version, hardware="v100-32g",
                                  transformers_version=version, use_measured=False)  # fmt: skip
        recipe = yaml.safe_load(generate(request).files["train.yaml"])
        assert recipe[key] == 0.02 and not ({"warmup_ratio", "warmup_steps"} - {key}) & recipe.keys()


@pytest.mark.parametrize("optimizer, key", [("badam", "use_badam"), ("adamw_8bit", "optim")])
def test_lfa_diff_files_an_optimizer_change_under_training_results(tmp_path, optimizer, key):
    base = ("generate", "--task", "pseudo2norm", "--model", "LLM4Binary/llm4decompile-1.3b-v2", "--hardware", "h200")
    assert run_lfa(*base, "-o", tmp_path / "adamw").returncode == 0
    changed = run_lfa(*base, "--allow-optimizer-change", "--pin", f"optimizer={optimizer}", "-o", tmp_path / "new")
    assert changed.returncode == 0, changed.stderr
    old_recipe, new_recipe = tmp_path / "adamw" / "train.yaml", tmp_path / "new" / "train.yaml"
    diff = json.loads(run_lfa("diff", old_recipe, new_recipe, "--format", "json").stdout)
    groups = {c["key"]: c["group"] for c in diff["changes"]}
    assert groups["optimizer"] == "results" and groups[key] == "results"
    assert "other" not in groups.values()  # nothing that changes what is trained is filed as bookkeeping
    # the same warmup ratio under transformers 4's key and 5's is no change
    new_recipe.write_text(re.sub(r"^warmup_steps:", "warmup_ratio:", new_recipe.read_text(), flags=re.M))
    renamed = json.loads(run_lfa("diff", old_recipe, new_recipe, "--format", "json").stdout)
    assert not any(c["key"].startswith("warmup") for c in renamed["changes"])


def test_warmup_ratio_is_an_error_only_where_transformers_removed_it(clean_recipe, monkeypatch):
    from lf_adapter.review import rules
    from lf_adapter.review.core import review_recipe

    clean_recipe.write_text(
        re.sub(r"^warmup_(ratio|steps): .*", "warmup_ratio: 0.02", clean_recipe.read_text(), flags=re.M)
    )
    for version, expected in (("4.56.1", []), ("5.6.0", []), ("5.17.0", ["error"])):
        monkeypatch.setattr(rules, "installed_version", lambda package, v=version: v)
        found = [f for f in review_recipe(clean_recipe).findings if f.rule.startswith("warmup")]
        assert [f.severity for f in found] == expected, version
    assert "`warmup_steps: 0.02`" in found[0].message
