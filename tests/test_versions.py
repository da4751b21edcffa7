"""lfa on the LLaMA-Factory the user already has: goldens independent of the install, review severities from the
installed versions, known-bad stacks named by detect, a fork's own sk2decompile template left alone."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from lf_adapter.plugin import contract


def test_goldens_are_written_for_their_manifest_version_whatever_is_installed(monkeypatch):
    from lf_adapter.recipe import generate as recipe
    from lf_adapter.recipe import goldens

    real = recipe.installed_versions()
    for pretend in ("0.9.3", "0.9.4", "0.9.5.dev0", None):
        monkeypatch.setattr(recipe, "installed_versions", lambda pretend=pretend: {**real, "llamafactory": pretend})
        assert goldens.check_goldens(REPO / "recipes") == [], pretend
    manifest = yaml.safe_load((REPO / "recipes" / "manifest.yaml").read_text())
    ray = next(e for e in manifest if e["dir"].endswith("-ray"))
    files = goldens.golden_files(REPO / "recipes", {**ray, "llamafactory": "0.9.4"})
    assert "ray_run_name" in files["train.yaml"]  # an entry may name another version and gets its keys


def test_a_dev_build_counts_as_its_release_line():
    from lf_adapter.review.lf_checks import version_matches

    assert version_matches("0.9.5.dev0", ">=0.9.5") and not version_matches("0.9.5.dev0", "<=0.9.4")
    assert version_matches("0.9.4.dev0", "<=0.9.4") and not version_matches("0.9.4.dev0", ">=0.9.5")
    assert version_matches("5.0.0rc1", ">=5") and not version_matches("5.0.0rc1", "<5")
    assert version_matches("4.56.1", "<5")


def test_known_bad_stacks_are_named_with_their_fix():
    from lf_adapter.hardware import stack_problems

    fork_reqs = ["transformers>=4.49.0,<=4.56.2,!=4.52.0", "trl>=0.8.6,<=0.9.6", "gradio>=4.38; extra == 'webui'"]
    assert (
        stack_problems(
            {
                "numpy": "1.26.4",
                "pyarrow": "20.0.0",
                "llamafactory": "0.9.4.dev0",
                "transformers": "4.56.1",
                "trl": "0.9.6",
            },
            fork_reqs,
        )
        == []
    )
    problems = stack_problems(
        {
            "numpy": "1.26.4",
            "pyarrow": "26.0.0",
            "llamafactory": "0.9.4.dev0",
            "transformers": "4.57.1",
            "trl": "0.9.6",
            "gradio": "3.0",
        },
        fork_reqs,
    )
    assert len(problems) == 2
    assert "numpy 1.26.4 with pyarrow 26.0.0" in problems[0] and "pip install 'pyarrow<21'" in problems[0]
    assert "transformers 4.57.1 is outside LLaMA-Factory 0.9.4.dev0's range" in problems[1]
    assert "pip install 'transformers" in problems[1] and "<=4.56.2" in problems[1]
    # numpy 2 with a new pyarrow, and a package LLaMA-Factory does not range, are fine
    assert stack_problems({"numpy": "2.4.6", "pyarrow": "26.0.0", "llamafactory": "0.9.5"}, []) == []


def test_ranges_come_from_llamafactorys_import_time_check_and_broken_pairs_are_named():
    from lf_adapter.hardware import llamafactory_runtime_ranges, stack_problems

    lf095 = ["accelerate<=1.11.0,>=1.3.0", "peft<=0.18.1,>=0.18.0", "trl<=0.24.0,>=0.18.0"]
    runtime = {"accelerate": ">=1.3.0,<=1.15.0", "peft": ">=0.18.0,<=0.20.0", "trl": ">=0.18.0,<=0.24.0"}
    stack = {"llamafactory": "0.9.5", "accelerate": "1.12.0", "peft": "0.19.0", "trl": "0.24.0"}
    assert len(stack_problems(stack, lf095)) == 2  # the wheel's metadata alone: both outside
    assert stack_problems(stack, lf095, runtime) == []  # what LLaMA-Factory accepts when it runs
    [outside, removed] = stack_problems({**stack, "trl": "0.29.0"}, lf095, runtime)
    assert "trl 0.29.0 is outside LLaMA-Factory 0.9.5's import-time check" in outside
    assert "removed AutoModelForCausalLMWithValueHead" in removed and "pip install 'trl<0.29'" in removed
    assert stack_problems({**stack, "llamafactory": "0.9.6", "trl": "0.29.0"}, [], {}) == []  # a later LF: not known
    ranges = llamafactory_runtime_ranges()  # the installed LLaMA-Factory's own check_dependencies()
    assert set(ranges) <= {"transformers", "trl", "accelerate", "peft", "datasets"} and "transformers" in ranges


def test_detect_reports_the_installed_stack_and_its_problems_as_notes():
    from conftest import run_lfa

    result = run_lfa("detect", "--json", "--no-network")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    from lf_adapter.hardware import installed_stack_problems

    assert [n for n in report["notes"] if n.startswith("known-bad pair")] == [
        f"known-bad pair: {p}" for p in installed_stack_problems()
    ]
    assert report["software"]["llamafactory"]


def test_a_forks_own_sk2decompile_template_is_left_alone_and_encodes_like_lfas(demo_assets, tmp_path, monkeypatch):
    """The SK2Decompile fork defines `sk2decompile` in LLaMA-Factory itself: lfa must not replace it, and lfa's
    definition must produce the same tokens, so recipes behave the same on the fork and on stock LLaMA-Factory."""
    from llamafactory.data import template as lf_template
    from llamafactory.data.formatter import StringFormatter
    from transformers import AutoTokenizer

    from lf_adapter import catalog_dir
    from lf_adapter.plugin import hooks

    saved = dict(lf_template.TEMPLATES)
    try:
        lf_template.TEMPLATES.pop("sk2decompile", None)
        lf_template.register_template(  # the fork's definition (LLaMA-Factory's own register_template call)
            name="sk2decompile",
            format_user=StringFormatter(slots=["{{content}}"]),
            format_assistant=StringFormatter(slots=["{{content}}<｜end▁of▁sentence｜>"]),
        )
        forks = lf_template.TEMPLATES["sk2decompile"]
        assert "sk2decompile" not in hooks.register_chat_templates(lf_template)
        assert lf_template.TEMPLATES["sk2decompile"] is forks
        # lfa's own definition, registered under another name for the comparison
        spec = yaml.safe_load((catalog_dir() / "chat" / "sk2decompile.yaml").read_text())
        (tmp_path / "chat").mkdir()
        (tmp_path / "chat" / "check.yaml").write_text(yaml.safe_dump({**spec, "name": "sk2decompile_lfa_check"}))
        monkeypatch.setenv(contract.CHAT_TEMPLATE_DIRS, str(tmp_path / "chat"))
        assert "sk2decompile_lfa_check" in hooks.register_chat_templates(lf_template)
        tokenizer = AutoTokenizer.from_pretrained(str(demo_assets[0]))
        rows = [json.loads(line) for line in Path(demo_assets[1]).read_text().splitlines()[:8]]
        for row in rows:
            messages = [
                {"role": "user", "content": row["instruction"] + row.get("input", "")},
                {"role": "assistant", "content": row["output"]},
            ]
            assert forks.encode_oneturn(tokenizer, messages) == lf_template.TEMPLATES[
                "sk2decompile_lfa_check"
            ].encode_oneturn(tokenizer, messages)
    finally:
        lf_template.TEMPLATES.clear()
        lf_template.TEMPLATES.update(saved)


def test_the_software_pairs_catalog_loads_strictly(tmp_path, monkeypatch):
    import lf_adapter.hardware as hardware
    from lf_adapter import UserError

    assert all(pair["fix"].startswith("pip install") for pair in hardware.software_pairs())
    (tmp_path / "software_pairs.yaml").write_text("- {pakage: trl, versions: '>=0.29', why: x, fix: y}\n")
    monkeypatch.setattr(hardware, "catalog_dir", lambda: tmp_path)
    with pytest.raises(UserError, match="pakage.*package|llamafactory` is missing"):
        hardware.software_pairs()
