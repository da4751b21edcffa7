"""The second fault matrix (issue 23): lfa never touches what the user owns, never resumes the wrong thing
silently, and the figures it prints come from the data. Real `lfa train` -> `llamafactory-cli` where a trainer is
involved."""

import hashlib
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _events, _ledger, _start_train, _wait_for, run_lfa
from lf_adapter.plugin import contract


def _tree_digest(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _set_output_dir(recipe: Path, value) -> None:
    recipe.write_text(re.sub(r"(?m)^output_dir: .*$", f"output_dir: {value}", recipe.read_text()))


def test_output_dirs_lfa_did_not_create_are_refused_and_left_untouched(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    user = tmp_path / "my-model"
    (user / "checkpoint-99").mkdir(parents=True)
    (user / "README.md").write_text("my notes\n")
    (user / "config.json").write_text("{}\n")
    (user / "checkpoint-99" / "trainer_state.json").write_text("{}\n")
    before = _tree_digest(user)
    _set_output_dir(recipe, user)
    result = run_lfa("train", recipe, "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and str(user) in result.stderr and "README.md" in result.stderr, result.stderr
    assert _tree_digest(user) == before and sorted(p.name for p in user.iterdir()) == [
        "README.md",
        "checkpoint-99",
        "config.json",
    ]
    review = run_lfa("review", recipe, "--format", "json")
    assert "output_dir_not_empty" in review.stdout
    # the root, the recipe's parent folders: refused before anything is written there
    for forbidden in ("/", "../.."):
        _set_output_dir(recipe, forbidden)
        refused = run_lfa("train", recipe, "--run-dir", tmp_path / "run2")
        assert refused.returncode == 2 and "output_dir" in refused.stderr and "Traceback" not in refused.stderr
        review = run_lfa("review", recipe, "--format", "json")
        assert "output_dir_forbidden" in review.stdout
    assert not Path("/.lfa-train.lock").exists() and not (recipe.parents[1] / ".lfa-output.json").exists()
    # a run folder blocked by a file: one message
    (tmp_path / "runs").write_text("not a folder")
    _set_output_dir(recipe, "saves/pseudo2norm")
    blocked = run_lfa("train", recipe, cwd=tmp_path)
    assert blocked.returncode == 2 and "is a file" in blocked.stderr and "Traceback" not in blocked.stderr


def test_recipes_with_yaml_aliases_or_megabytes_are_refused_at_once(tmp_path):
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
        + "output_dir: out\n"
    )
    started = time.time()
    result = run_lfa("train", laughs, "--run-dir", tmp_path / "run", timeout=60)
    assert result.returncode == 2 and "alias" in result.stderr and time.time() - started < 30
    huge = tmp_path / "huge.yaml"
    huge.write_text("output_dir: out\n" + "# padding\n" * 200_000)
    result = run_lfa("review", huge, laughs)  # each refused as its recipe's finding, both reported
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{huge}:1: error: [unreadable_recipe]" in result.stdout and "MiB" in result.stdout
    assert f"{laughs}:1: error: [unreadable_recipe]" in result.stdout and "alias" in result.stdout


def test_bad_dataset_lines_are_named_before_anything_starts_in_train_and_detach(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=2")
    info = json.loads((recipe.parent / "dataset_info.json").read_text())
    data = recipe.parent / info["pseudo2norm"]["file_name"]
    rows = data.read_bytes().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(
        b"\n".join(rows[:9] + [b"{not json", b'{"instruction": "", "input": "x"}', b"\xff\xfe{}"] + rows[9:20]) + b"\n"
    )
    info["pseudo2norm"]["file_name"] = str(broken)
    (recipe.parent / "dataset_info.json").write_text(json.dumps(info))
    for extra in ((), ("--detach",)):
        result = run_lfa("train", recipe, "--run-dir", tmp_path / "run", *extra)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"{broken}:10: not a JSON object" in result.stderr and f"{broken}:11: no 'output'" in result.stderr
        assert f"{broken}:12: bytes that are not UTF-8" in result.stderr and "started run" not in result.stdout
    assert not (tmp_path / "run" / "supervisor.pid").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    info["pseudo2norm"]["file_name"] = str(empty)
    (recipe.parent / "dataset_info.json").write_text(json.dumps(info))
    result = run_lfa("train", recipe, "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and "no rows" in result.stderr


def test_a_held_run_refuses_detach_and_an_edited_recipe_is_not_resumed_silently(cpu_recipe, tmp_path):
    recipe = cpu_recipe("max_steps=200", extra=("--save-steps", "3", "--logging-steps", "1"))
    run_dir = tmp_path / "run"
    supervisor = _start_train(recipe, run_dir, {contract.STEP_DELAY_S: "0.2"})
    assert _wait_for(lambda: any(e["event"] == "save" for e in _events(run_dir))), supervisor.communicate()[0]
    detached = run_lfa("train", recipe, "--run-dir", run_dir, "--detach")
    assert detached.returncode == 2 and "in use by" in detached.stderr and "started run" not in detached.stdout
    supervisor.send_signal(signal.SIGINT)
    supervisor.communicate(timeout=120)
    assert _ledger(run_dir)["status"] == "stopped"
    # the learning rate edited in the file: refused with the change, nothing started
    attempts = len(_ledger(run_dir)["attempts"])
    recipe.write_text(re.sub(r"(?m)^learning_rate: .*$", "learning_rate: 5.0e-4", recipe.read_text()))
    edited = run_lfa("train", recipe, "--run-dir", run_dir)
    assert edited.returncode == 2 and "learning_rate" in edited.stderr and "--resume-anyway" in edited.stderr
    assert len(_ledger(run_dir)["attempts"]) == attempts
    # said explicitly: resumed from its checkpoint
    resumed = run_lfa("train", recipe, "--run-dir", run_dir, "--resume-anyway", "--set", "max_steps=8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _ledger(run_dir)["attempts"][-1]["resumed_from"]


def test_torn_checkpoints_are_set_aside_and_the_one_before_is_resumed(tmp_path):
    from lf_adapter.run.checkpoints import is_complete_checkpoint, newest_complete_checkpoint

    for step in (4, 8):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
        (folder / "optimizer.pt").write_bytes(b"\0" * 64)
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text('{"global_st')  # truncated by a crash
    assert not is_complete_checkpoint(tmp_path / "checkpoint-8")
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert not (tmp_path / "checkpoint-8").exists() and any(
        p.name.startswith("incomplete-checkpoint-8") for p in tmp_path.iterdir()
    )
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(b"")
    assert not is_complete_checkpoint(tmp_path / "checkpoint-4")


def test_a_full_disk_under_the_events_file_loses_events_not_the_training(capsys):
    from types import SimpleNamespace

    from lf_adapter.plugin.callbacks import EventsCallback

    callback = EventsCallback("/dev/full")  # every write fails with ENOSPC
    state = SimpleNamespace(is_world_process_zero=True)
    callback.emit(state, event="step", global_step=1)
    callback.emit(state, event="step", global_step=2)
    assert capsys.readouterr().out.count("cannot write /dev/full") == 1


def test_printed_step_counts_follow_the_trainer_and_unexplained_kills_are_not_host_ooms():
    from lf_adapter.data import DatasetProfile
    from lf_adapter.run.monitor import host_oom_evidence

    assert DatasetProfile("x", 20, 0.0, 0.0, 0.5).steps(64, 2.0) == 2  # one partial step per epoch
    assert DatasetProfile("x", 130, 0.0, 0.0, 0.5).steps(64, 1.0) == 3
    assert host_oom_evidence(0, 0, 1.03, 23.5) is None
    assert "rose" in host_oom_evidence(0, 1, 1.0, 23.5) and "RSS" in host_oom_evidence(None, None, 22.0, 23.5)


def _mount_tmpfs(folder, size_kib: int) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)], capture_output=True
            ).returncode
            == 0
        )
    except OSError:
        return False


def _fill(folder) -> None:
    """Write until the disk under folder is full."""
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


def test_a_full_disk_under_the_run_folder_loses_log_lines_not_the_training_and_the_ledger_is_kept(cpu_recipe, tmp_path):
    """Case 6: the run folder's disk fills mid-run (a real tmpfs, filled by this test). The trainer's log output and
    events are dropped instead of killing it, training reaches its end and saves (output_dir is on another disk),
    and the ledger is still written (lfa holds some room for it from the start)."""
    run_dir = tmp_path / "small_disk"
    if not _mount_tmpfs(run_dir, 4096):
        pytest.skip("cannot mount a tmpfs here (needs root); the full-disk case runs where it can")
    try:
        recipe = cpu_recipe("max_steps=30", extra=("--logging-steps", "1"))
        supervisor = _start_train(recipe, run_dir, {contract.STEP_DELAY_S: "0.2"})
        assert _wait_for(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 2), supervisor.communicate()[0]
        _fill(run_dir)
        out, _ = supervisor.communicate(timeout=300)
        assert supervisor.returncode == 0 and "training finished" in out and "disk is full" in out, out
        assert "Traceback" not in out and "unknown" not in out
        ledger = _ledger(run_dir)
        assert ledger["status"] == "succeeded" and ledger["attempts"][0]["returncode"] == 0
        assert (
            json.loads((recipe.parent / "saves" / "pseudo2norm" / "trainer_log.jsonl").read_text().splitlines()[-1])[
                "current_steps"
            ]
            == 30
        )
        # the events after the fill were dropped (the last line written may be cut off)
        assert (run_dir / "events.jsonl").read_text().count('"event": "step"') < 30
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)
