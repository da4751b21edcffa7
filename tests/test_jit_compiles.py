"""The plugin's count of Triton compiles per step (lf_adapter/plugin/jit_compiles.py)."""

from lf_adapter.plugin.jit_compiles import CompileCounter, triton_cache_dir


def test_new_kernel_folders_are_counted_until_taken(tmp_path):
    cache = tmp_path / "triton"
    (cache / "old-kernel").mkdir(parents=True)
    counter = CompileCounter(cache)
    assert counter.take() == {"jit_compiles": 0}  # what was cached before the run is not this run's work
    for name in ("a", "b"):
        (cache / name).mkdir()
    (cache / "a-group.json").write_text("{}")  # files beside the folders are not kernels
    assert counter.take() == {"jit_compiles": 2}
    assert counter.take() == {"jit_compiles": 0}


def test_no_cache_no_figure(tmp_path):
    counter = CompileCounter(tmp_path / "missing")
    assert counter.take() == {}
    (tmp_path / "missing" / "k").mkdir(parents=True)  # created during the run: its kernels count
    assert counter.take() == {"jit_compiles": 1}


def test_cache_dir_follows_tritons_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_dir() == tmp_path
    monkeypatch.setenv("TRITON_CACHE_DIR", " ")
    assert triton_cache_dir().parts[-2:] == (".triton", "cache")
