"""Hostile inputs: values from profile files and flags are data. Each one is pushed through every field of a
hardware profile, the path and name flags of `lfa generate` and `lfa train`, and `--set`; the generated scripts
run with stub programs on PATH. Nothing but the intended launcher may run, and the recipe must read back with
exactly the intended keys."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from omegaconf import OmegaConf

from conftest import REPO, _ledger, run_lfa
from lf_adapter.cli import main as lfa_cli
from lf_adapter.run.process import process_record

STUBBED = ("touch", "llamafactory-cli", "accelerate", "torchrun", "ray", "srun", "scontrol", "lfa", "python3")


def payloads(canary: Path) -> dict[str, str]:
    """Each a value a file or flag could carry; every command in them would create the canary."""
    c = str(canary)
    return {
        "command substitution": f"x$(touch {c})",
        "backticks": f"x`touch {c}`",
        "semicolon": f"x; touch {c}",
        "single quote": f"x'; touch {c}; '",
        "double quote": f'x"; touch {c}; "',
        "newline": f"x\ntouch {c} #",
        "carriage return": f"x\rtouch {c}",
        "YAML keys": "x\npush_to_hub: true\nhub_model_id: attacker/stolen\n#",
        "line separator": "x\u2028push_to_hub: true",
        "ANSI escape": "\x1b[2J\x1b[31mred",
        "very long": "x" * 10000,
        "colon and hash": "a: b # c",
        "not UTF-8": os.fsdecode(b"x\xff\xfe"),  # what Python makes of such bytes in argv
    }


def file_payloads(canary: Path) -> dict[str, str]:
    """What a file can carry besides: a NUL (no command-line argument can)."""
    return {**payloads(canary), "NUL": "x\x00y"}


@pytest.fixture
def stubs(tmp_path):
    """A PATH folder whose programs only record that they ran (argv, and the allocator setting they were given)."""
    folder = tmp_path / "stubs"
    folder.mkdir()
    log = tmp_path / "stub-calls.jsonl"
    for name in STUBBED:
        script = folder / name
        # srun runs its command (the batch script's inner shell); python3 answers the plugin-path question
        body = {
            "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
            "python3": "echo /nonexistent/boot",
            "scontrol": "echo node0",
        }.get(name, "")
        script.write_text(
            "#!/bin/bash\n"
            f'{sys.executable} -c "import json, os, sys; print(json.dumps({{\\"prog\\": \\"{name}\\", '
            f'\\"argv\\": sys.argv[1:], \\"alloc\\": os.environ.get(\\"PYTORCH_CUDA_ALLOC_CONF\\")}}))" '
            f'"$@" >> {log}\n{body}\n'
        )
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder, log


def run_scripts(recipe_dir: Path, stubs) -> list[dict]:
    """Run every generated script of recipe_dir with the stubs first on PATH; the calls the stubs recorded."""
    folder, log = stubs
    log.unlink(missing_ok=True)
    env = {"PATH": f"{folder}:/usr/bin:/bin", "HOME": str(recipe_dir), "SLURM_JOB_NODELIST": "node0"}
    for script in sorted(recipe_dir.glob("*.sh")):
        args = ["head"] if script.name == "ray-cluster.sh" else []
        subprocess.run(["bash", str(script), *args], cwd=recipe_dir, env=env, capture_output=True, timeout=30)
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def assert_only_launchers(calls: list[dict], canary: Path) -> None:
    assert not canary.exists(), "a hostile value ran a command"
    assert {c["prog"] for c in calls} <= {"llamafactory-cli", "accelerate", "ray", "srun", "scontrol", "lfa", "python3"}
    launched = [c for c in calls if c["prog"] == "llamafactory-cli"]
    assert launched and all(c["argv"] == ["train", "train.yaml"] for c in launched), calls


def recipe_keys(recipe_dir: Path) -> dict:
    return yaml.safe_load((recipe_dir / "train.yaml").read_text(encoding="utf-8"))


def invoke(*args) -> tuple[int, str]:
    """lfa in-process: (exit code, output); fails the test on a traceback."""
    result = CliRunner().invoke(lfa_cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def cluster_profile(tmp_path: Path) -> dict:
    data = yaml.safe_load((REPO / "catalog" / "hardware" / "cluster-2x8-h100.yaml").read_text())
    data["disk"] = {"path": str(tmp_path / "swap"), "free_gib": 500.0, "source": "datasheet"}
    return data


PROFILE_FIELDS = {  # field -> where it lives in the profile; names are refused, text is kept as data
    "name": ("name",),
    "description": ("description",),
    "gpu.name": ("gpu", "name"),
    "disk.path": ("disk", "path"),
    "disk.source": ("disk", "source"),
    "master_addr": ("master_addr",),
    "hosts[1]": ("hosts", 1),
    "interconnect": ("interconnect",),
    "master_port": ("master_port",),
}
NAME_FIELDS = {"master_addr", "hosts[1]", "interconnect", "master_port"}


@pytest.mark.parametrize("field", PROFILE_FIELDS)
def test_a_hostile_profile_field_is_refused_or_stays_data(field, tmp_path, stubs):
    canary = tmp_path / "PWNED"
    base = tmp_path / "base"
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(cluster_profile(tmp_path)))
    assert invoke("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", base)[0] == 0
    intended = recipe_keys(base)
    for label, value in file_payloads(canary).items():
        data = cluster_profile(tmp_path)
        *parents, last = PROFILE_FIELDS[field]
        holder = data
        for part in parents:
            holder = holder[part]
        if label == "not UTF-8":  # the bytes themselves in the file
            holder[last] = "@@VALUE@@"
            text = yaml.safe_dump(data).encode("utf-8")
            profile.write_bytes(text.replace(b"@@VALUE@@", value.encode("utf-8", "surrogateescape")))
        else:
            holder[last] = value
            profile.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        out = tmp_path / "out" / label.replace(" ", "-")
        code, output = invoke("generate", "--task", "pseudo2norm", "--hardware", profile, "-o", out)
        if field in NAME_FIELDS or label == "not UTF-8":
            assert code == 2 and "lfa: error:" in output and str(profile) in output, (label, output)
            assert field.split("[")[0] in output or label == "not UTF-8", (label, output)
            assert not out.exists()
            continue
        assert code == 0, (label, output)
        assert recipe_keys(out) == intended, label
        assert_only_launchers(run_scripts(out, stubs), canary)
        if field == "disk.path":  # the swap folder reaches the DeepSpeed JSON as a JSON string, exactly
            for ds in out.glob("ds_*.json"):
                json.loads(ds.read_text())


def test_hostile_flag_values_are_refused_or_written_exactly(tmp_path, stubs):
    canary = tmp_path / "PWNED"
    base = tmp_path / "base"
    assert invoke("generate", "--task", "pseudo2norm", "--hardware", "cluster-2x8-h100", "-o", base)[0] == 0
    intended = recipe_keys(base)
    for n, (label, value) in enumerate(payloads(canary).items()):
        # --template and --set: the exact string as the key's value; nothing else added
        for flag, key in (("--template", "template"), ("--set", "report_name")):
            out = tmp_path / f"{key}-{n}"
            arg = value if flag == "--template" else f"report_name={value}"
            code, output = invoke("generate", "--task", "pseudo2norm", "--hardware", "cluster-2x8-h100", flag, arg,
                                  "-o", out)  # fmt: skip
            if label == "not UTF-8":
                assert code == 2 and output.count("lfa: error:") == 1, output
                continue
            assert code == 0, (label, flag, output)
            data = recipe_keys(out)
            assert data.pop(key) == value and set(data) == set(intended) - {key}, (label, flag)
            assert_only_launchers(run_scripts(out, stubs), canary)
        # a pinned allocator setting reaches launch.sh's environment exactly (Ray's cluster script too)
        for launcher in ("torchrun", "ray"):
            out = tmp_path / f"alloc-{launcher}-{n}"
            code, output = invoke("generate", "--task", "pseudo2norm", "--hardware", "cluster-2x8-h100",
                                  "--launcher", launcher, "--pin", f"alloc_conf={value}", "-o", out)  # fmt: skip
            if label == "not UTF-8":
                assert code == 2 and "not valid UTF-8" in output, output
                continue
            assert code == 0, (label, output)
            assert set(recipe_keys(out)) >= {"output_dir", "template"}
            calls = run_scripts(out, stubs)
            assert_only_launchers(calls, canary)
            assert {c["alloc"] for c in calls if c["prog"] in ("llamafactory-cli", "ray")} == {value}, (label, launcher)
        # names and paths: refused with one message, or used as data (the recipe folder itself)
        for i, args in enumerate(
            (
                ("--llamafactory-version", value),
                ("--model", value),
                ("--dataset", value),
                ("--nvme-path", value),
                ("--set", f"{value}=1"),
            )
        ):
            code, output = invoke("generate", "--task", "pseudo2norm", "--hardware", "cluster-2x8-h100", *args,
                                  "-o", tmp_path / f"flag-{n}-{i}")  # fmt: skip
            assert code in (0, 2) and output.count("lfa: error:") == code // 2, (label, args, output)
            assert "\x1b" not in output
        if "\n" not in value and "\r" not in value and len(value) < 200 and label != "not UTF-8":
            out = tmp_path / "named" / value
            assert invoke("generate", "--task", "pseudo2norm", "--hardware", "cluster-2x8-h100", "-o", out)[0] == 0
            assert recipe_keys(out) == intended
            assert_only_launchers(run_scripts(out, stubs), canary)


def test_hostile_train_flags_are_refused_or_reach_the_trainer_exactly(cpu_recipe, tmp_path, monkeypatch):
    from lf_adapter import UserError
    from lf_adapter.run.preflight import preflight, prepare
    from lf_adapter.run.request import TrainRequest
    from lf_adapter.run.supervisor import LoopState, prepare_launch

    recipe = cpu_recipe("max_steps=2")
    monkeypatch.chdir(tmp_path)
    for label, value in payloads(tmp_path / "PWNED").items():
        code, output = invoke("train", recipe, "--master-addr", value)
        assert code == 2 and output.count("lfa: error:") == 1 and "\x1b" not in output, (label, output)
        code, output = invoke("train", recipe, "--set", f"{value}=1")
        assert code == 2 and output.count("lfa: error:") == 1, (label, output)
        try:  # a run name is a folder under runs/, or refused
            request = TrainRequest(recipe, name=value, overrides=(f"output_dir={tmp_path / 'unclaimed'}",))
            assert preflight(request).run_dir.parent == (tmp_path / "runs").resolve()
        except UserError as exc:
            assert "run name" in str(exc), label
        if label == "not UTF-8":
            assert invoke("train", recipe, "--set", f"run_name={value}")[0] == 2
            continue
        # a --set value reaches llamafactory-cli's command line as exactly that value (OmegaConf reads it back)
        setup = prepare(TrainRequest(recipe, run_dir=tmp_path / "run", overrides=(f"run_name={value}",)))
        try:
            launch = prepare_launch(setup, LoopState(attempt=setup.attempt))
            override = next(a for a in launch.command if a.startswith("run_name="))
            assert OmegaConf.to_container(OmegaConf.from_cli([override]))["run_name"] == value, label
        finally:
            for lock in setup.locks:
                lock.close()


def test_checks_before_launch_read_the_recipe_as_the_run_uses_it(cpu_recipe, demo_assets, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    # output-dir guard: --set output_dir at a folder lfa did not create, holding files; nothing is touched
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine\n")
    (foreign / "config.json").write_text("{}\n")
    refused = run_lfa("train", recipe, "--run-dir", tmp_path / "r0", "--set", f"output_dir={foreign}")
    assert refused.returncode == 2 and "already holds files lfa did not write" in refused.stderr, refused.stderr
    assert (foreign / "README.md").read_text() == "mine\n" and sorted(p.name for p in foreign.iterdir()) == [
        "README.md",
        "config.json",
    ]
    assert not (tmp_path / "r0").exists()
    # dataset pre-check: --set dataset_dir at a folder whose dataset file is broken
    broken = tmp_path / "broken-data"
    broken.mkdir()
    (broken / "dataset_info.json").write_text((recipe.parent / "dataset_info.json").read_text())
    entry = json.loads((broken / "dataset_info.json").read_text())
    data_file = broken / Path(next(iter(entry.values()))["file_name"]).name
    data_file.write_text('{"instruction": "x", "output": \n')
    for value in entry.values():
        value["file_name"] = data_file.name
    (broken / "dataset_info.json").write_text(json.dumps(entry))
    refused = run_lfa("train", recipe, "--run-dir", tmp_path / "r1", "--set", f"dataset_dir={broken}")
    assert refused.returncode == 2 and "dataset would fail" in refused.stderr, refused.stderr
    # the run itself: --set output_dir is where the model goes, in the ledger, the summary and the report
    mine = tmp_path / "mine"
    trained = run_lfa("train", recipe, "--run-dir", tmp_path / "run", "--set", f"output_dir={mine}")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert f"model        {mine}" in trained.stdout
    assert _ledger(tmp_path / "run")["output_dir"] == str(mine)
    assert (mine / "model.safetensors").is_file() and not (recipe.parent / "saves").exists()
    assert str(mine) in (tmp_path / "run" / "report.html").read_text()
    # resume check: the same checkpoints under another --set learning rate need --resume-anyway
    changed = run_lfa("train", recipe, "--run-dir", tmp_path / "run", "--set", f"output_dir={mine}",
                      "--set", "learning_rate=0.5")  # fmt: skip
    assert changed.returncode == 2 and "learning_rate" in changed.stderr, changed.stderr
    # lock: a supervisor holding the overridden output_dir keeps a second one out
    import fcntl

    with open(mine / ".lfa-train.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("lfa train (pid 1, test)\n")
        held.flush()
        busy = run_lfa("train", recipe, "--run-dir", tmp_path / "other", "--set", f"output_dir={mine}")
    assert busy.returncode == 2 and "in use by" in busy.stderr, busy.stderr


def test_paths_that_point_elsewhere_are_refused(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep\n")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "linked").symlink_to(theirs)
    refused = run_lfa("train", recipe, "--name", "linked", cwd=tmp_path)
    assert refused.returncode == 2 and "run folder" in refused.stderr, refused.stderr
    linked_out = tmp_path / "out-link"
    linked_out.symlink_to(theirs)
    refused = run_lfa("train", recipe, "--run-dir", tmp_path / "r", "--set", f"output_dir={linked_out}")
    assert refused.returncode == 2 and "already holds files lfa did not write" in refused.stderr
    for name in ("../escape", "a/b", "..", "x\ny"):
        refused = run_lfa("train", recipe, "--name", name, cwd=tmp_path)
        assert refused.returncode == 2 and "run name" in refused.stderr, (name, refused.stderr)
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"] and not (tmp_path / "escape").exists()
    # lfa report --out: an existing file, a folder of someone else's files, a link to one; an earlier report is fine
    run_dir = tmp_path / "run"
    assert run_lfa("train", recipe, "--run-dir", run_dir).returncode == 0
    a_file = tmp_path / "a-file"
    a_file.write_text("keep\n")
    for target in (a_file, theirs, linked_out):
        refused = run_lfa("report", run_dir, "--out", target)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert a_file.read_text() == "keep\n" and sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
    fresh = tmp_path / "report"
    assert run_lfa("report", run_dir, "--out", fresh).returncode == 0
    (fresh / "loss.png").unlink()
    (fresh / "loss.png").symlink_to(a_file)  # a link planted where a figure goes is replaced, not written through
    again = run_lfa("report", run_dir, "--out", fresh)
    assert again.returncode == 0, again.stderr
    assert a_file.read_text() == "keep\n" and not (fresh / "loss.png").is_symlink()


def _ledger_with(run_dir: Path, supervisor: dict | None, trainer: dict | None) -> None:
    run_dir.mkdir(parents=True)
    attempt = {
        "n": 1,
        "started": "",
        "plan": "p",
        "trainer_pid": trainer and trainer["pid"],
        "trainer_process": trainer,
    }
    ledger = {
        "recipe": "",
        "status": "running",
        "supervisor_pid": supervisor and supervisor["pid"],
        "supervisor_process": supervisor,
        "attempts": [attempt],
    }
    (run_dir / "ledger.json").write_text(json.dumps(ledger))


def test_a_reused_pid_is_reported_gone_and_never_signalled(tmp_path):
    from lf_adapter.run.control import run_status
    from lf_adapter.run.locks import end_orphaned_trainer

    # an unrelated program now holds the pids the ledger recorded (its own session: a group of its own too)
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        real = process_record(unrelated.pid)
        recorded = {"pid": unrelated.pid, "start": real.start - 1, "cmdline": "lfa train recipe.yaml"}
        run_dir = tmp_path / "run"
        _ledger_with(run_dir, recorded, recorded)
        stopped = run_lfa("stop", run_dir, "--timeout", "1")
        assert stopped.returncode == 0 and "not running" in stopped.stdout and "another process" in stopped.stdout
        assert run_status(run_dir).state == "dead"
        assert end_orphaned_trainer(run_dir) is None
        time.sleep(0.2)
        assert unrelated.poll() is None, "lfa signalled a process it did not start"
    finally:
        unrelated.kill()
        unrelated.wait()
    # the process lfa did record is stopped (its group killed when nothing stops it gracefully)
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run_dir = tmp_path / "ours"
        _ledger_with(run_dir, None, process_record(ours.pid).to_dict())
        stopped = run_lfa("stop", run_dir, "--timeout", "1")
        assert stopped.returncode == 0 and "stopped (forced)" in stopped.stdout, stopped.stdout + stopped.stderr
        assert ours.wait(timeout=10) == -signal.SIGKILL
    finally:
        if ours.poll() is None:
            ours.kill()


def test_review_flags_keys_that_send_data_off_the_machine(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    text = recipe.read_text().replace("report_to: none\n", "")
    leaky = recipe.with_name("leaky.yaml")
    leaky.write_text(
        text + "push_to_hub: true\nhub_model_id: someone/else\nreport_to: wandb\n"
        "hf_hub_token: hf_abcdefghijklmnopqrstuvwxyz0123456789\n"
    )
    lines = leaky.read_text().splitlines()
    review = run_lfa("review", leaky)
    assert review.returncode == 1
    out = review.stdout
    for key, severity, rule in (
        ("push_to_hub", "warning", "data_leaves_machine"),
        ("report_to", "warning", "data_leaves_machine"),
        ("hf_hub_token", "error", "secret_in_recipe"),
    ):
        line = next(i + 1 for i, text in enumerate(lines) if text.startswith(f"{key}:"))
        assert f"{leaky}:{line}: {severity}: [{rule}]" in out, (key, out)
    assert "hf_abcdefghij" not in out  # the secret is never echoed
    clean = run_lfa("review", recipe)
    assert "data_leaves_machine" not in clean.stdout and "secret_in_recipe" not in clean.stdout


def test_doctor_export_lines_are_shell_quoted(cpu_recipe, tmp_path, stubs):
    canary = tmp_path / "PWNED"
    recipe = cpu_recipe("max_steps=2")
    hostile = f"expandable_segments:True$(touch {canary})"
    meta_line = next(line for line in recipe.read_text().splitlines() if line.startswith("# lfa-meta: "))
    meta = json.loads(meta_line[len("# lfa-meta: ") :])
    meta.update(alloc_conf=hostile, hardware={**meta["hardware"], "gpu": None})
    recipe.write_text(recipe.read_text().replace(meta_line, "# lfa-meta: " + json.dumps(meta)))
    log = REPO / "tests" / "fixtures" / "failures" / "hub_network.log"
    doctor = run_lfa("doctor", log, "--recipe", recipe, "--json")
    assert doctor.returncode in (0, 1), doctor.stderr
    exports = [
        line for line in run_lfa("doctor", log, "--recipe", recipe).stdout.splitlines() if line.startswith("export ")
    ]
    script = tmp_path / "env.sh"
    script.write_text("\n".join(exports) + '\nprintf %s "$PYTORCH_CUDA_ALLOC_CONF"\n')
    shown = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert not canary.exists()
    assert any(line.startswith("export PYTORCH_CUDA_ALLOC_CONF=") for line in exports), exports
    assert shown.stdout == hostile


def test_scripts_quote_rendezvous_values_even_past_validation(tmp_path, stubs, monkeypatch):
    """Host names are validated where profiles load; the scripts quote them all the same (a profile object built
    in code skips that check)."""
    import dataclasses

    from lf_adapter.hardware import load_profile
    from lf_adapter.recipe import generate as generate_module

    canary = tmp_path / "PWNED"
    hostile = f"x$(touch {canary})"
    profile = dataclasses.replace(load_profile("cluster-2x8-h100"), master_addr=hostile, hosts=(hostile, "b\nc"))
    monkeypatch.setattr(generate_module, "load_profile", lambda name: profile)
    for launcher in ("torchrun", "ray"):
        out = tmp_path / launcher
        assert invoke("generate", "--task", "pseudo2norm", "--hardware", "x", "--launcher", launcher, "-o", out)[0] == 0
        calls = run_scripts(out, stubs)
        assert_only_launchers(calls, canary)
        if launcher == "torchrun":
            for script in ("launch.sh", "launch-node-1.sh"):
                assert "export MASTER_ADDR=${MASTER_ADDR:-'x$(touch" in (out / script).read_text(), script


@pytest.mark.parametrize(
    "field, value",
    [
        ("mean_seq_fraction", "abc"),
        ("mean_seq_fraction", -3),
        ("dataset_rows", "many"),
        ("token_budget", "4096; touch x"),
        ("checkpoint_layers", [1]),
        ("launcher", "bash"),
        ("hardware", [1]),
    ],
)
def test_a_hostile_header_value_is_one_message_in_every_command(field, value, cpu_recipe, tmp_path):
    """The lfa-meta header is data from a file (a hand edit, a PR): each command that reads it names the bad value
    once and exits non-zero; review reports it as the recipe's finding and still reviews the next recipe."""
    clean = cpu_recipe("max_steps=2")
    meta_line = next(line for line in clean.read_text().splitlines() if line.startswith("# lfa-meta: "))
    meta = json.loads(meta_line[len("# lfa-meta: ") :])
    meta[field] = value
    tampered = clean.with_name("tampered.yaml")
    tampered.write_text(clean.read_text().replace(meta_line, "# lfa-meta: " + json.dumps(meta)))
    for args in (
        ("estimate", tampered),
        ("diff", clean, tampered),
        ("train", tampered, "--run-dir", tmp_path / "run"),
        ("doctor", REPO / "tests" / "fixtures" / "failures" / "hub_network.log", "--recipe", tampered),
    ):
        code, out = invoke(*args)
        assert code == 2 and f"header {field} is" in out and out.count("lfa: error") == 1, (args, out)
    assert not (tmp_path / "run").exists()
    code, out = invoke("review", tampered, clean, "--format", "json")
    reviews = json.loads(out)
    assert code == 1 and [r["path"] for r in reviews] == [str(tampered), str(clean)]
    assert [(f["rule"], f"header {field} is" in f["message"]) for f in reviews[0]["findings"]] == [
        ("unreadable_recipe", True)
    ]
    assert reviews[1]["summary"] and not any(f["severity"] == "error" for f in reviews[1]["findings"])


def test_counts_that_are_no_counts_are_one_message_where_a_recipe_is_priced(cpu_recipe):
    """cutoff_len, the micro-batch and the accumulation are read in one place: estimate, train and diff say which
    value is wrong instead of pricing a negative cutoff or tracing back on text."""
    clean = cpu_recipe("max_steps=2")
    for key, value in (("cutoff_len", "abc"), ("cutoff_len", "0"), ("per_device_train_batch_size", "-2")):
        edited = clean.with_name(f"{key}.yaml")
        text = clean.read_text()
        assert f"\n{key}: " in text
        edited.write_text(
            "\n".join(f"{key}: {value}" if line.startswith(f"{key}: ") else line for line in text.splitlines())
        )
        code, out = invoke("estimate", edited)
        assert code == 2 and f"{key}: " in out and "is not a positive integer" in out, out
        code, out = invoke("train", clean, "--set", f"{key}={value}", "--run-dir", clean.parent / "run")
        assert code == 2 and f"{key}: " in out and "is not a positive integer" in out, out
        assert not (clean.parent / "run").exists() and not (clean.parent / "saves").exists()  # nothing made
