"""End to end on the CPU with the real llamafactory-cli: the template, a training run, detached runs, the data report
(faults: tests/test_faults.py)."""

import json
import os

from conftest import _events, _ledger, _losses, _wait_for, run_lfa
from lf_adapter.plugin import contract


def test_sk2decompile_template_is_registered_and_ends_with_one_eos(demo_assets):
    from lf_adapter.plugin import hooks

    hooks.install()
    from llamafactory.data import template as lf_template
    from transformers import AutoTokenizer

    assert "sk2decompile" in lf_template.TEMPLATES
    tokenizer = AutoTokenizer.from_pretrained(str(demo_assets[0]))
    prompt_ids, answer_ids = lf_template.TEMPLATES["sk2decompile"].encode_oneturn(
        tokenizer,
        [{"role": "user", "content": "# This is the pseudo code:\nx\n"}, {"role": "assistant", "content": "int func1"}],
    )
    assert tokenizer.decode(prompt_ids) == "# This is the pseudo code:\nx\n"
    assert answer_ids[-1] == tokenizer.eos_token_id and answer_ids.count(tokenizer.eos_token_id) == 1


def test_generate_and_train_tiny_model_loss_goes_down(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=30", extra=("--logging-steps", "2", "--pin", "micro_batch_size=4"))
    (tmp_path / "triton").mkdir()
    result = run_lfa("train", recipe, "--run-dir", tmp_path / "run", env={"TRITON_CACHE_DIR": str(tmp_path / "triton")})
    assert result.returncode == 0, result.stdout + result.stderr
    events = _events(tmp_path / "run")
    begin = next(e for e in events if e["event"] == "train_begin")
    assert begin["sampler"] == "sorted_steps(block=8)" and begin["micro_batch_size"] == 4
    steps = [e for e in events if e["event"] == "step"]
    # non-pad tokens per step, counted inside the trainer with the padding mask dropped: 8 rows of at most 512
    assert len(steps) == 30 and all(8 <= e["step_tokens"] <= 8 * 512 for e in steps)
    # lfa's launch freezes what is alive at train begin out of garbage collections; every step says what collections
    # and fetching its batch took on the host
    assert begin["gc_frozen_objects"] > 100_000
    assert all(e["gc_pause_s"] >= 0 and e["gc_full_collections"] >= 0 and e["batch_collect_s"] > 0 for e in steps)
    assert all(e["jit_compiles"] == 0 for e in steps)  # Triton's cache is there; the CPU compiles nothing into it
    output = recipe.parent / "saves" / "pseudo2norm"
    logs = [r for r in _losses(output) if "loss" in r]
    assert logs[-1]["current_steps"] == 30 and logs[-1]["loss"] < logs[0]["loss"] * 0.8
    assert (output / "model.safetensors").is_file()
    ledger = _ledger(tmp_path / "run")
    assert ledger["status"] == "succeeded" and len(ledger["attempts"]) == 1
    assert (tmp_path / "run" / "attempt-1.log").read_text().count("llamafactory") > 0


def test_detached_run_survives_its_launcher_then_status_logs_and_stop(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=400", extra=("--logging-steps", "1"))
    run_dir = tmp_path / "run"
    started = run_lfa("train", recipe, "--run-dir", run_dir, "--detach", env={contract.STEP_DELAY_S: "0.2"})
    assert started.returncode == 0 and "lfa stop" in started.stdout, started.stderr
    recorded = json.loads((run_dir / "supervisor.pid").read_text())  # pid, start time, command line
    supervisor = recorded["pid"]
    assert os.getsid(supervisor) == supervisor  # its own session: a logout's SIGHUP does not reach it
    assert recorded["start"] and "lf_adapter.cli train" in recorded["cmdline"]
    assert _wait_for(lambda: any(e["event"] == "step" and e["global_step"] >= 2 for e in _events(run_dir)))
    status = run_lfa("status", run_dir, "--json")
    [state] = json.loads(status.stdout)
    assert state["state"] == "running" and state["step"] >= 2 and state["total_steps"] == 400
    logs = run_lfa("logs", run_dir, "-n", "5")
    assert logs.returncode == 0 and 0 < len(logs.stdout.splitlines()) <= 5
    assert run_lfa("logs", run_dir, "-n", "0").stdout == "" and run_lfa("logs", run_dir, "-n", "-1").returncode == 2
    trainer = _ledger(run_dir)["attempts"][0]["trainer_pid"]
    stopped = run_lfa("stop", run_dir, "--timeout", "60")
    assert stopped.returncode == 0 and "stopped (graceful)" in stopped.stdout, stopped.stdout + stopped.stderr
    assert _ledger(run_dir)["status"] == "stopped"
    assert (
        not os.path.exists(f"/proc/{trainer}")
        or "Z" in open(f"/proc/{trainer}/stat").read().rsplit(")", 1)[1].split()[0]
    )
    followed = run_lfa("logs", run_dir, "-f", timeout=60)  # a finished run: prints and returns
    assert followed.returncode == 0 and "==> run stopped <==" in followed.stdout
    again = run_lfa("stop", run_dir)
    assert again.returncode == 0 and "not running" in again.stdout


def test_progress_line_carries_step_loss_speed_eta_and_gpu_memory():
    from lf_adapter.run.progress import _progress_text

    text = _progress_text(
        2,
        {
            "step": 5,
            "total": 10,
            "loss": 1.23456,
            "lr": 3e-6,
            "tokens_per_s": 23511.4,
            "eta": "0:01:02",
            "gpu_used_gib": 26.7,
        },
    )
    assert text.startswith("[attempt 2] step 5/10 [##########..........]")
    assert "loss 1.2346" in text and "23,511 tok/s" in text and "ETA 0:01:02" in text and "GPU 26.7 GiB (NVML)" in text


def test_data_report_counts_tokens_as_llamafactory_encodes_the_sk2decompile_template(demo_assets):
    """lfa data / generate --dataset count each row with the model's tokenizer; for sk2decompile that equals what
    LLaMA-Factory's template encodes (prompt, response, one EOS)."""
    import json as _json

    from transformers import AutoTokenizer

    from lf_adapter.data import profile_dataset
    from lf_adapter.plugin import hooks
    from lf_adapter.tasks import load_task

    hooks.install()
    from llamafactory.data import template as lf_template

    model, data = demo_assets
    task = load_task("pseudo2norm")
    profile = profile_dataset(str(data), task.dataset.columns, 2048, str(model))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    lengths = []
    for line in data.read_text().splitlines():
        row = _json.loads(line)
        prompt, answer = lf_template.TEMPLATES["sk2decompile"].encode_oneturn(
            tokenizer,
            [
                {"role": "user", "content": row["instruction"] + row["input"]},
                {"role": "assistant", "content": row["output"]},
            ],
        )
        lengths.append(len(prompt) + len(answer))
    assert "tokenizer" in profile.counted_with and profile.max_tokens == max(lengths)
    assert profile.total_tokens == sum(lengths) and profile.p50_tokens == sorted(lengths)[len(lengths) // 2]
    estimate = profile_dataset(str(data), task.dataset.columns, 2048, None)
    assert "estimate" in estimate.counted_with
