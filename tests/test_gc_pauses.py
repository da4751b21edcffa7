"""The plugin's garbage-collector clock and freeze (lf_adapter/plugin/gc_pauses.py)."""

import gc

from lf_adapter.plan import Plan
from lf_adapter.plugin import contract
from lf_adapter.plugin.gc_pauses import CollectionClock, freeze_if_asked
from lf_adapter.recipe.keys import launch_env


def test_collections_are_timed_until_taken():
    clock = CollectionClock()
    clock.install()
    clock.install()  # once only
    try:
        assert gc.callbacks.count(clock) == 1
        gc.collect(0)
        gc.collect(2)
        taken = clock.take()
        assert taken["gc_full_collections"] >= 1 and taken["gc_pause_s"] > 0
        assert clock.take() == {"gc_pause_s": 0.0, "gc_full_collections": 0}
    finally:
        gc.callbacks.remove(clock)


def test_freeze_only_where_the_run_asks(monkeypatch):
    monkeypatch.delenv(contract.GC_FREEZE, raising=False)
    assert freeze_if_asked() is None and gc.get_freeze_count() == 0
    monkeypatch.setenv(contract.GC_FREEZE, "0")
    assert freeze_if_asked() is None
    monkeypatch.setenv(contract.GC_FREEZE, "1")
    try:
        frozen = freeze_if_asked()
        assert frozen == gc.get_freeze_count() and frozen > 1000
    finally:
        gc.unfreeze()


def test_lfa_launches_ask_for_the_freeze_and_a_set_value_wins():
    [entry] = [e for e in launch_env(Plan("bf16", 8, 8), offline=True) if e.name == contract.GC_FREEZE]
    assert entry.value == "1" and entry.keep_existing
