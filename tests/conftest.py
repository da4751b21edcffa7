import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lf_adapter import measured

REPO = Path(__file__).resolve().parents[1]


def run_lfa(*args, cwd=None, env=None, timeout=600):
    full_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lf_adapter.cli", *map(str, args)],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True, scope="session")
def _measured_peaks_in_a_test_folder(tmp_path_factory):
    """What lfa train measures goes to lfa's cache folder: in tests a fresh one, never the user's."""
    os.environ[measured.CACHE_DIR] = str(tmp_path_factory.mktemp("lfa-cache"))


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """A tiny DeepSeek-Coder-shaped model and 96 pseudo2norm rows, built once per test session."""
    from lf_adapter.demo import build_demo_assets

    root = tmp_path_factory.mktemp("assets")
    model, data = build_demo_assets(root, rows=96)
    return model, data


def generate_demo_recipe(demo_assets, out, hardware, *args) -> Path:
    """`lfa generate` for the demo's tiny model and data, 8 rows per step, on `hardware`, plus args; its train.yaml."""
    model, data = demo_assets
    result = run_lfa("generate", "--task", "pseudo2norm", "--model", model, "--dataset", data, "--hardware", hardware,
                     "--set", "effective_batch_size=8", *args, "-o", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out / "train.yaml"


@pytest.fixture
def cpu_recipe(tmp_path, demo_assets):
    """Generate a CPU recipe for the tiny model; returns a function so tests can add --set overrides."""

    def make(*sets, name="recipe", extra=()):
        sets = ("learning_rate=1.0e-3", "cutoff_len=512", *sets)
        return generate_demo_recipe(
            demo_assets, tmp_path / name, "cpu", *[x for s in sets for x in ("--set", s)], *extra
        )

    return make


# run folders: what the ledger, the trainer log and lfa's events say
def _ledger(run_dir):
    return json.loads((run_dir / "ledger.json").read_text())


def _losses(output_dir):
    return [json.loads(line) for line in (output_dir / "trainer_log.jsonl").read_text().splitlines()]


def _start_train(recipe, run_dir, env):
    full_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "lf_adapter.cli", "train", str(recipe), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(predicate, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _events(run_dir):
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
