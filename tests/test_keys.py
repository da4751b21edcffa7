"""recipe/keys.py: the plugin settings' table is the one place their header key, environment variable and `lfa diff`
key come from."""

from lf_adapter.plan import Plan
from lf_adapter.recipe.diff import RESULT_KEYS, SPEED_KEYS
from lf_adapter.recipe.keys import PLUGIN_SETTINGS, launch_env


def test_each_plugin_setting_round_trips_through_the_header_and_reaches_the_plugin_and_the_diff():
    on = Plan(
        "bf16", 8, 8, padding_free=True, token_budget=16384, checkpoint_layers=5, sorted_steps=True, master_weights=True
    )
    off = Plan("bf16", 8, 8)
    exported = {e.name: e.value for e in launch_env(on, offline=True)}
    exported_off = {e.name for e in launch_env(off, offline=True)}
    assert {s.field for s in PLUGIN_SETTINGS} == {
        "padding_free",
        "token_budget",
        "checkpoint_layers",
        "sorted_steps",
        "master_weights",
    }
    for setting in PLUGIN_SETTINGS:
        header = {setting.field: setting.header_value(on)}
        assert setting.read(header) == getattr(on, setting.field)
        assert exported[setting.variable] == ("1" if getattr(on, setting.field) is True else str(header[setting.field]))
        assert setting.variable not in exported_off
        assert setting.read({}) == getattr(off, setting.field)  # an absent key reads back as the plan's default
        # master weights compute in a bf16 residual stream: a change of numerics, filed with the results
        assert setting.diff_key in (RESULT_KEYS if setting.field == "master_weights" else SPEED_KEYS)
