import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_lfa(*args, cwd=None, env=None, timeout=600):
    full_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lf_adapter.cli", *map(str, args)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """A tiny DeepSeek-Coder-shaped model and 96 pseudo2norm rows, built once per test session."""
    from lf_adapter.demo import build_demo_assets

    root = tmp_path_factory.mktemp("assets")
    model, data = build_demo_assets(root, rows=96)
    return model, data


@pytest.fixture
def cpu_recipe(tmp_path, demo_assets):
    """Generate a CPU recipe for the tiny model; returns a function so tests can add --set overrides."""
    model, data = demo_assets

    def make(*sets, name="recipe", extra=()):
        out = tmp_path / name
        result = run_lfa("generate", "--task", "pseudo2norm", "--model", model, "--dataset", data, "--hardware", "cpu",
                         "--set", "effective_batch_size=8", "--set", "learning_rate=1.0e-3", "--set", "cutoff_len=512",
                         *[x for s in sets for x in ("--set", s)], *extra, "-o", out)
        assert result.returncode == 0, result.stderr
        return out / "train.yaml"
    return make
