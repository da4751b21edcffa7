"""The fault matrix (README): each fault through the real lfa train -> llamafactory-cli subprocess on the CPU, with
injection only where a CPU cannot produce the fault (CUDA OOM, NaN weights); each test asserts what the user sees,
what the ledger says and that no step or checkpoint is lost or trained twice."""

import json
import os
import signal
import subprocess

import pytest

from conftest import REPO, _events, _ledger, _losses, _start_train, _wait_for, run_lfa
from lf_adapter.plugin import contract


def test_injected_oom_flows_through_the_real_trainer_and_is_retried(cpu_recipe, tmp_path):
    import re

    recipe = cpu_recipe("max_steps=3")
    text = re.sub(r"(?m)^per_device_train_batch_size: \d+", "per_device_train_batch_size: 8", recipe.read_text())
    recipe.write_text(re.sub(r"(?m)^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 1", text))
    result = run_lfa(
        "train", recipe, "--run-dir", tmp_path / "run", "--max-attempts", "5", env={contract.INJECT_OOM_ABOVE_MBS: "2"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    attempts = _ledger(tmp_path / "run")["attempts"]
    kinds = [(a.get("failure") or {}).get("kind") for a in attempts]
    assert kinds[:-1] == ["cuda_oom"] * (len(attempts) - 1) and kinds[-1] is None
    # no allocator remedy on a CPU (PYTORCH_CUDA_ALLOC_CONF would change nothing): straight to a smaller micro-batch
    assert [a["remedy"]["action"] for a in attempts[:-1]][0] == "halve_micro_batch"
    assert "torch.OutOfMemoryError: CUDA out of memory" in (tmp_path / "run" / "attempt-1.log").read_text()
    final = attempts[-1]["overrides"]
    assert final["per_device_train_batch_size"] == 2 and final["gradient_accumulation_steps"] == 4
    resolved = recipe.with_name("train.resolved.yaml").read_text()
    assert resolved.startswith("# lfa train resolved this recipe") and "per_device_train_batch_size: 2" in resolved
    # the summary block and the report mark the OOM and show what the retry changed
    assert re.search(r"attempts     1: failed \(OOM\), .*: succeeded", result.stdout), result.stdout
    page = (tmp_path / "run" / "report.html").read_text()
    assert "cuda_oom" in page and "CUDA out of memory" in page and "halve_micro_batch" in page
    diff = page.split("first attempt against last")[1]
    assert "per_device_train_batch_size: 8 -&gt; 2" in diff


def test_kill_9_mid_run_resumes_from_the_checkpoint_without_repeating_steps(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=14", extra=("--save-steps", "4", "--logging-steps", "1"))
    run_dir = tmp_path / "run"
    supervisor = _start_train(recipe, run_dir, {contract.STEP_DELAY_S: "0.4"})
    saved = lambda: (
        any(e["event"] == "save" and e["global_step"] >= 4 for e in _events(run_dir))
        and any(e["event"] == "step" and e["global_step"] >= 6 for e in _events(run_dir))
    )
    assert _wait_for(saved), supervisor.communicate()[0]
    os.kill(_ledger(run_dir)["attempts"][0]["trainer_pid"], signal.SIGKILL)
    out, _ = supervisor.communicate(timeout=300)
    assert supervisor.returncode == 0, out
    first, second = _ledger(run_dir)["attempts"][:2]
    # a kill -9 with no sign of a host OOM (cgroup oom_kill count unchanged, RSS far below the RAM) is not called one
    assert first["failure"]["kind"] == "killed" and first["returncode"] == -9
    assert any("no sign of a host OOM" in line for line in first["failure"]["evidence"])
    assert first["remedy"]["action"] == "resume_as_is"
    checkpoint_step = int(second["resumed_from"].rsplit("-", 1)[1])
    assert checkpoint_step >= 4 and second["first_step"] == checkpoint_step + 1
    assert second["last_step"] == 14


@pytest.mark.parametrize("sent, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_stops_cleanly_and_leaves_no_trainer(cpu_recipe, tmp_path, sent, code):
    recipe = cpu_recipe("max_steps=200", extra=("--logging-steps", "1"))
    run_dir = tmp_path / "run"
    supervisor = _start_train(recipe, run_dir, {contract.STEP_DELAY_S: "0.2"})
    assert _wait_for(lambda: any(e["event"] == "step" for e in _events(run_dir))), supervisor.communicate()[0]
    supervisor.send_signal(sent)
    supervisor.communicate(timeout=120)
    assert supervisor.returncode == code  # 128 + the signal, as shells report it
    ledger = _ledger(run_dir)
    assert ledger["status"] == "stopped"
    stopped = ledger["attempts"][0]
    assert stopped["status"] == "stopped" and stopped["returncode"] is not None and stopped["last_step"] >= 1
    assert stopped["duration_s"] > 0  # the stopped attempt's wall time counts
    pid = ledger["attempts"][0]["trainer_pid"]
    assert _wait_for(
        lambda: not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], 30
    )
    # the plugin saved the work since the last save (save_steps is 500) before stopping
    steps = [e["global_step"] for e in _events(run_dir) if e["event"] == "step"]
    saves = [e["global_step"] for e in _events(run_dir) if e["event"] == "save"]
    assert saves == [steps[-1]] and (recipe.parent / "saves" / "pseudo2norm" / f"checkpoint-{steps[-1]}").is_dir()


SEED_OOM = next(
    line.split(": ", 1)[1]
    for line in (REPO / "tests" / "fixtures" / "failures" / "cuda_oom_seed_v100.log").read_text().splitlines()
    if line.startswith("torch.OutOfMemoryError")
)


def test_seed_oom_of_the_6_7b_paper_recipe_is_replanned_to_offload_on_attempt_2(cpu_recipe, tmp_path):
    """The seed's case: the paper's fp16 mbs8 x ga8 recipe on the 31.73 GiB card dies with the seed's own OOM line
    (injected: a CPU cannot run out of GPU memory, but the line flows through the real trainer, log and
    classifier); the planner, told the card and the 6.7B shape, runs an offload plan next with batch 64."""
    import re

    recipe = cpu_recipe("max_steps=3")
    text = re.sub(r"(?m)^per_device_train_batch_size: \d+", "per_device_train_batch_size: 8", recipe.read_text())
    text = re.sub(r"(?m)^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 8", text)
    recipe.write_text(re.sub(r"(?m)^fp16: false", "fp16: true", text))
    profile = tmp_path / "v100-256g.yaml"  # the seed's RAM is unknown: 128 GiB fits no 6.7B plan (test_remedies)
    profile.write_text(
        (REPO / "catalog" / "hardware" / "v100-32g.yaml").read_text().replace("ram_gib: 128", "ram_gib: 256")
    )
    result = run_lfa(
        "train",
        recipe,
        "--run-dir",
        tmp_path / "run",
        "--max-attempts",
        "2",
        "--hardware",
        profile,
        "--json",
        env={
            contract.INJECT_OOM_ABOVE_MBS: "4",
            contract.INJECT_OOM_MESSAGE: SEED_OOM,
            contract.EMULATE_MODEL: "LLM4Binary/llm4decompile-6.7b-v2",
        },
    )
    first, second = _ledger(tmp_path / "run")["attempts"][:2]
    assert first["failure"]["kind"] == "cuda_oom", result.stdout + result.stderr
    assert first["failure"]["details"]["allocated_gib"] == 27.81
    assert "27.81 GiB is allocated by PyTorch" in (tmp_path / "run" / "attempt-1.log").read_text()
    assert first["remedy"]["action"] == "replan"
    from lf_adapter.plan import Plan

    plan = Plan.from_label(second["plan"])
    assert plan.offload != "none" and plan.effective_batch_size == 64 and plan.precision == "fp16", second["plan"]
    ds_file = recipe.parent / second["overrides"]["deepspeed"]
    zero = json.loads(ds_file.read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"


def test_nan_divergence_retries_from_a_checkpoint_before_it_with_an_attention_value_lf_accepts(cpu_recipe, tmp_path):
    """Weights poisoned at step 6 (a real NaN loss follows): the checkpoint saved after it is set aside, the retry
    runs eager attention as LLaMA-Factory spells it (flash_attn: disabled) from checkpoint-5 and finishes."""
    recipe = cpu_recipe("max_steps=16", extra=("--save-steps", "5", "--logging-steps", "1"))
    run_dir = tmp_path / "run"
    result = run_lfa(
        "train",
        recipe,
        "--run-dir",
        run_dir,
        "--max-attempts",
        "3",
        env={contract.INJECT_NAN_AT_STEP: "6", contract.STEP_DELAY_S: "0.3"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = _ledger(run_dir)["attempts"]
    assert first["failure"]["kind"] == "nan_loss" and first["remedy"]["action"] == "eager_attention"
    assert first["last_finite_step"] == 6 and first["first_nonfinite_step"] == 7
    assert all(name.startswith("diverged-checkpoint-") for name in first["diverged_checkpoints_set_aside"])
    assert second["overrides"]["flash_attn"] == "disabled" and second["resumed_from"].endswith("checkpoint-5")
    output = recipe.parent / "saves" / "pseudo2norm"
    logs = [r for r in _losses(output) if "loss" in r and r["current_steps"] > 5]
    finite = [r for r in logs if r["loss"] == r["loss"]]
    assert finite[-1]["current_steps"] == 16 and second["last_step"] == 16


def test_one_supervisor_per_run_and_no_orphan_after_kill_9_of_the_supervisor(cpu_recipe, tmp_path):
    # 60 steps of >= 0.5 s: time for the refusals below before it could end; the resumed run then trains the rest
    recipe = cpu_recipe("max_steps=60", extra=("--logging-steps", "1"))
    run_dir = tmp_path / "run"
    supervisor = _start_train(recipe, run_dir, {contract.STEP_DELAY_S: "0.5"})
    assert _wait_for(lambda: any(e["event"] == "step" for e in _events(run_dir))), supervisor.communicate()[0]
    # a second lfa train of the same run, and of the same recipe under another name: refused, nothing started
    for extra in ((), ("--name", "other")):
        second = run_lfa("train", recipe, *(("--run-dir", run_dir) if not extra else extra), cwd=tmp_path)
        assert second.returncode == 2 and "in use by lfa train" in second.stderr, second.stdout + second.stderr
    assert len(_ledger(run_dir)["attempts"]) == 1
    trainer = _ledger(run_dir)["attempts"][0]["trainer_pid"]
    supervisor.kill()
    supervisor.communicate()
    # the trainer notices that its supervisor is gone, saves a checkpoint and stops by itself
    gone = lambda: not os.path.exists(f"/proc/{trainer}") or "Z" in open(f"/proc/{trainer}/stat").read().split()[2]
    assert _wait_for(gone, 60)
    saves = [e["global_step"] for e in _events(run_dir) if e["event"] == "save"]
    assert len(saves) == 1
    status = json.loads(run_lfa("status", run_dir, "--json").stdout)[0]
    assert status["state"] == "dead"
    # what the killed run left can be looked at: the steps it made, and that nobody recorded its end
    report = run_lfa("report", run_dir, "--out", tmp_path / "report")
    assert report.returncode == 0 and "run recipe: dead" in report.stdout, report.stdout + report.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "killed?" in page and page.count("data:image/png;base64,") == 5
    # lfa train again resumes from that checkpoint; no step is trained twice
    resumed = run_lfa("train", recipe, "--run-dir", run_dir, "--set", "max_steps=60", env={contract.STEP_DELAY_S: "0"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    first, second = _ledger(run_dir)["attempts"][:2]
    assert first["status"] == "supervisor died"
    assert second["resumed_from"].endswith(f"checkpoint-{saves[0]}") and second["first_step"] == saves[0] + 1


def test_seed_oom_on_a_128_gib_host_stops_at_once_with_what_would_fit(cpu_recipe, tmp_path):
    import re

    recipe = cpu_recipe("max_steps=3")
    text = re.sub(r"(?m)^per_device_train_batch_size: \d+", "per_device_train_batch_size: 8", recipe.read_text())
    recipe.write_text(re.sub(r"(?m)^gradient_accumulation_steps: \d+", "gradient_accumulation_steps: 8", text))
    # the seed's card and 128 GiB host without a local disk for NVMe offload
    no_disk = tmp_path / "v100-no-disk.yaml"
    no_disk.write_text(
        "\n".join(
            line
            for line in (REPO / "catalog" / "hardware" / "v100-32g.yaml").read_text().splitlines()
            if not line.startswith("disk:")
        )
    )
    result = run_lfa(
        "train",
        recipe,
        "--run-dir",
        tmp_path / "run",
        "--max-attempts",
        "4",
        "--hardware",
        no_disk,
        env={
            contract.INJECT_OOM_ABOVE_MBS: "4",
            contract.INJECT_OOM_MESSAGE: SEED_OOM,
            contract.EMULATE_MODEL: "LLM4Binary/llm4decompile-6.7b-v2",
        },
    )
    attempts = _ledger(tmp_path / "run")["attempts"]
    assert result.returncode == 1 and len(attempts) == 1, result.stdout + result.stderr
    assert attempts[0]["remedy"]["action"] == "no_plan_fits"
    assert "no plan fits" in result.stderr and "GiB of host RAM" in result.stderr and "Traceback" not in result.stderr


def test_set_on_plan_keys_feeds_the_plan_that_remedies_start_from(cpu_recipe, tmp_path):
    """--set per_device_train_batch_size=4 with an OOM above 2: the remedy halves the micro-batch that ran (4 -> 2),
    and its change wins over the --set on the retry (no identical attempts)."""
    recipe = cpu_recipe("max_steps=2")
    result = run_lfa(
        "train",
        recipe,
        "--run-dir",
        tmp_path / "run",
        "--max-attempts",
        "4",
        "--set",
        "per_device_train_batch_size=4",
        "--set",
        "gradient_accumulation_steps=2",
        env={contract.INJECT_OOM_ABOVE_MBS: "2"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    attempts = _ledger(tmp_path / "run")["attempts"]
    assert attempts[0]["plan"].split("/")[1] == "mbs4xga2x1"
    assert attempts[-1]["overrides"]["per_device_train_batch_size"] == 2
    assert attempts[-1]["overrides"]["gradient_accumulation_steps"] == 4
    assert len({a["plan"] for a in attempts}) == len(attempts) == 2


def test_bad_input_gets_one_message_and_no_background_run(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    text = recipe.read_text()
    recipe.write_text(text.replace("\nlearning_rate:", "\nlearing_rate:"))
    detached = run_lfa("train", recipe, "--run-dir", tmp_path / "run", "--detach")
    assert (
        detached.returncode == 2
        and "learing_rate" in detached.stderr
        and "did you mean `learning_rate`" in detached.stderr
    )
    assert not (tmp_path / "run" / "supervisor.pid").exists()
    import re

    recipe.write_text(re.sub(r"(?m)^per_device_train_batch_size: \d+", "per_device_train_batch_size: abc", text))
    for args in (
        ("train", recipe, "--run-dir", tmp_path / "run2"),
        ("estimate", recipe),
        ("generate", "--task", "pseudo2norm", "--hardware", "h200", "--set", "cutoff_len=abc", "-o", tmp_path / "g"),
        ("train", recipe, "--max-attempts", "0"),
    ):
        result = run_lfa(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
    # a damaged ledger is reported, the other runs are still listed, and JSON never holds a bare NaN
    good, bad = tmp_path / "runs" / "good", tmp_path / "runs" / "bad"
    good.mkdir(parents=True)
    bad.mkdir()
    (good / "ledger.json").write_text(json.dumps({"status": "succeeded", "attempts": []}))
    (good / "events.jsonl").write_text(json.dumps({"event": "log", "loss": float("nan")}) + "\n")
    (bad / "ledger.json").write_text("{not json")
    status = run_lfa("status", "--json", cwd=tmp_path)
    rows = json.loads(status.stdout)
    assert status.returncode == 1 and {r["state"] for r in rows} == {"succeeded", "unreadable"}
    assert "NaN" not in status.stdout


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: a real full disk on the CPU (needs root, as CI runs; skipped where mount is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_full_disks_give_one_message_and_a_ledger_that_says_so(cpu_recipe, tmp_path, small_disk):
    import re

    from lf_adapter.memory import checkpoint_gib
    from lf_adapter.plan import Plan
    from lf_adapter.recipe.read import load_recipe, recipe_model_spec

    recipe = cpu_recipe("max_steps=2")
    need_mib = checkpoint_gib(recipe_model_spec(load_recipe(recipe)), Plan("fp32", 1, 8)) * 1024
    assert need_mib < 3
    (small_disk / "filler").write_bytes(b"\0" * int((3 - need_mib / 2) * 2**20))  # leaves half a checkpoint
    recipe.write_text(re.sub(r"(?m)^output_dir: .*$", f"output_dir: {small_disk / 'out'}", recipe.read_text()))
    result = run_lfa("train", recipe, "--run-dir", tmp_path / "run")
    ledger = _ledger(tmp_path / "run")
    assert result.returncode == 1 and "one checkpoint" in result.stderr and "GiB free" in result.stderr, result.stderr
    assert ledger["status"] == "failed" and ledger["attempts"] == [] and "Traceback" not in result.stderr
    # the run folder itself on a disk with no space left: one message, no traceback
    with open(small_disk / "filler2", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
    # (its own output_dir: the first one belongs to the first run)
    recipe.write_text(re.sub(r"(?m)^output_dir: .*$", f"output_dir: {tmp_path / 'out2'}", recipe.read_text()))
    full = run_lfa("train", recipe, "--run-dir", small_disk / "run")
    assert full.returncode == 1 and "disk is full" in full.stderr and "Traceback" not in full.stderr, full.stderr


def test_loss_stuck_at_ln_vocab_is_stopped_with_stop_on_divergence(cpu_recipe, tmp_path):
    """A real divergence without NaN (learning rate 1e4 on the tiny model): the loss sits at ln(vocab)."""
    recipe = cpu_recipe("max_steps=40", "learning_rate=1.0e+4", extra=("--logging-steps", "1"))
    result = run_lfa(
        "train", recipe, "--run-dir", tmp_path / "run", "--max-attempts", "1", "--stop-on-divergence", "--json"
    )
    [attempt] = _ledger(tmp_path / "run")["attempts"]
    assert attempt["failure"]["kind"] == "loss_diverged", result.stdout[-2000:]
    assert attempt["last_step"] < 40 and "ln(vocab)" in attempt["divergence_warning"]
