"""The model's shape as lfa reads it: parameter counts derived from the architecture match what the family's
modeling code builds (transformers, on the meta device: no weights)."""

import pytest

from lf_adapter.model_spec import _from_config_dict, catalog

CONFIG_KEYS = {"arch": "model_type"}  # catalog key -> config.json key, where they differ


def _meta_param_count(config: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {CONFIG_KEYS.get(k, k): v for k, v in config.items() if k != "torch_dtype"}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(catalog()))
def test_catalog_parameter_counts_match_the_modeling_code(name):
    shape = catalog()[name]
    assert _from_config_dict(name, shape).num_params == _meta_param_count(shape)


def test_config_json_fields_that_change_the_count_are_read():
    # StarCoder2: ungated MLP, LayerNorm with biases, biased projections; Gemma-2: head_dim apart from hidden/heads
    starcoder = catalog()["bigcode/starcoder2-3b"]
    spec = _from_config_dict("s", {**starcoder, "model_type": starcoder["arch"]})
    assert not spec.gated_mlp and spec.output_bias and spec.attention_bias
    gemma = _from_config_dict("g", catalog()["google/gemma-2-2b"])
    assert gemma.head_dim == 256 != gemma.hidden_size // gemma.num_heads
    # the same shape without those fields is priced as a gated, bias-free decoder: a different (wrong) count
    plain = _from_config_dict("p", {k: v for k, v in starcoder.items() if k not in ("use_bias", "arch")})
    assert plain.num_params > spec.num_params * 1.3


def test_attention_dropout_rules_out_padding_free(tmp_path):
    """torch's varlen kernel has no dropout: a model that drops attention weights trains padded, planned and run."""
    import json

    from conftest import run_lfa

    llama = catalog()["meta-llama/Llama-3.2-3B"]
    assert _from_config_dict("l", llama).padding_free_problem(2048) is None
    dropping = _from_config_dict("d", {**llama, "attention_dropout": 0.1})
    assert "attention_dropout 0.1" in dropping.padding_free_problem(2048)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**llama, "model_type": "llama", "attention_dropout": 0.1}))
    result = run_lfa("generate", "--task", "pseudo2norm", "--model", str(folder), "--hardware", "h100", "-o",
                     str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    recipe = (tmp_path / "out" / "train.yaml").read_text()
    meta = json.loads(next(line[12:] for line in recipe.splitlines() if line.startswith("# lfa-meta: ")))
    assert "/padfree" not in meta["plan"] and "padding-free: off: llama drops attention weights" in recipe


def test_the_plugin_trains_a_model_with_attention_dropout_padded():
    pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lf_adapter.plugin.hooks import _padding_free_usable

    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    assert _padding_free_usable(LlamaForCausalLM(LlamaConfig(**shape))) is None
    reason = _padding_free_usable(LlamaForCausalLM(LlamaConfig(**shape, attention_dropout=0.1)))
    assert reason and "attention_dropout 0.1" in reason
