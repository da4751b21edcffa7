"""Stage 3: the model's shape without its weights: from a local config.json or the built-in catalog."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import UserError, catalog_dir
from .schema import raise_problems, unknown_keys

# decoder families whose MLP is up -> activation -> down (no gate); the rest gate it (SwiGLU/GeGLU: three matrices)
UNGATED_MLP = frozenset({"starcoder2", "gpt_bigcode", "gpt_neox", "gpt2", "phi", "opt", "falcon", "bloom"})
# families whose norms are LayerNorm (weight and bias) rather than RMSNorm (weight only)
LAYER_NORM = frozenset({"starcoder2", "gpt_bigcode", "gpt_neox", "gpt2", "phi", "opt", "falcon", "bloom"})
# families with a norm before and after both the attention and the MLP (four per layer instead of two)
SANDWICH_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text", "olmo2"})
# families whose q/k/v are one projection, and whose MLP's gate and up are one (a single input each)
FUSED_QKV = frozenset({"phi3", "gpt_bigcode", "gpt_neox", "falcon", "bloom"})
FUSED_GATE_UP = frozenset({"phi3"})
# families that normalize each head's queries and keys (a weight of head_dim each)
QK_NORM = frozenset({"qwen3", "olmo2", "gemma3", "gemma3_text"})


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    attention_bias: bool = False  # biases on q, k and v
    torch_dtype: str | None = None  # the checkpoint's dtype (config.json); what LLaMA-Factory loads it in
    explicit_head_dim: int | None = None  # config.json's head_dim where heads x head_dim is not the hidden size
    output_bias: bool = False  # biases on the attention output and the MLP (StarCoder2's use_bias)
    attention_softcap: float | None = None  # Gemma-2's attn_logit_softcapping: scores squashed before the softmax
    final_softcap: float | None = None  # Gemma-2's final_logit_softcapping: the logits squashed before the loss
    sliding_window: int | None = None  # attention sees at most this many earlier tokens (where the family uses one)
    attention_dropout: float = 0.0  # dropout on the attention weights while training (config.json)

    def padding_free_problem(self, seq_len: int) -> str | None:
        """Why torch's varlen flash attention (lfa's padding-free) would not compute this family's attention."""
        if self.attention_softcap:
            return (
                f"{self._soft_caps}, which the varlen flash kernel does not: padding-free would train a different "
                "attention"
            )
        if self.attention_dropout > 0:
            return (
                f"{self.arch} drops attention weights while training (attention_dropout {self.attention_dropout:g}), "
                "which torch's varlen kernel cannot: padding-free would train without that dropout"
            )
        return None

    @property
    def sdpa_problem(self) -> str | None:
        """Why torch's SDPA (and its varlen kernel) would not compute this family's attention."""
        if self.attention_softcap:
            return (
                f"{self._soft_caps}, which transformers computes only in eager attention and flash-attn 2: SDPA would "
                "train a different attention"
            )
        return None

    @property
    def _soft_caps(self) -> str:
        return f"{self.arch} soft-caps its attention scores (attn_logit_softcapping {self.attention_softcap:g})"

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def gated_mlp(self) -> bool:
        return self.arch not in UNGATED_MLP

    @property
    def q_width(self) -> int:
        """Query heads x head dim: the width of q and of the attention's output."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key-value heads x head dim: the width of k and of v."""
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Weights and biases of one decoder layer, as the family's modeling code builds them."""
        h, f = self.hidden_size, self.intermediate_size
        qkv_biases = self.q_width + 2 * self.kv_width if self.attention_bias else 0
        output_biases = 2 * h + f if self.output_bias else 0  # o's and the MLP's (up: f, down: h)
        norms = self.norms_per_layer * self.norm_params + (2 * self.head_dim if self.qk_norm else 0)
        return self.linear_weights_per_layer + qkv_biases + output_biases + norms

    @property
    def linear_weights_per_layer(self) -> int:
        """Elements of one decoder layer's linear weights (q, k, v, o and the MLP's; no biases or norms)."""
        h, f = self.hidden_size, self.intermediate_size
        return 2 * h * self.q_width + 2 * h * self.kv_width + (3 if self.gated_mlp else 2) * h * f

    @property
    def norms_per_layer(self) -> int:
        """Hidden-width norms in one decoder layer (the q/k norms aside)."""
        return 4 if self.arch in SANDWICH_NORMS else 2

    @property
    def qk_norm(self) -> bool:
        return self.arch in QK_NORM

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (mean and variance, weight and bias) rather than RMSNorm."""
        return self.arch in LAYER_NORM

    @property
    def qkv_projections(self) -> int:
        """Linear layers reading the attention's input: one where q, k and v are fused, else three."""
        return 1 if self.arch in FUSED_QKV else 3

    @property
    def mlp_input_projections(self) -> int:
        """Linear layers reading the MLP's input: gate and up (fused into one in some families), or up alone."""
        return 2 if self.gated_mlp and self.arch not in FUSED_GATE_UP else 1

    @property
    def largest_tensor_params(self) -> int:
        """Elements of the largest single weight: the embedding (or lm_head), else an MLP matrix."""
        return max(self.embedding_params, self.hidden_size * self.intermediate_size)

    @property
    def norm_params(self) -> int:
        return (2 if self.layer_norm else 1) * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.params_per_layer + self.norm_params + lm_head

    def flops_per_token(self, seq_len: int, weight_gradients: bool = True) -> float:
        """Training FLOPs per token: 6 x (non-embedding params + lm_head) + attention 12*L*(heads x head_dim)*s
        (fwd+bwd). Without weight gradients (BAdam: one layer's only) the backward computes input gradients alone:
        4 x params."""
        matmul_params = self.num_layers * self.params_per_layer + self.embedding_params
        attention_width = self.num_heads * self.head_dim
        return (6.0 if weight_gradients else 4.0) * matmul_params + 12.0 * self.num_layers * attention_width * seq_len

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """The decoder layers' forward alone (what checkpointing runs again): 2 x their params + attention's 4*L*w*s."""
        return (
            2.0 * self.num_layers * self.params_per_layer
            + 4.0 * self.num_layers * self.num_heads * self.head_dim * seq_len
        )


def _dtype_name(value: object) -> str | None:
    """config.json's dtype ("bfloat16", "torch.float16"; transformers 5 writes `dtype`, 4.x `torch_dtype`)."""
    return str(value).removeprefix("torch.") if isinstance(value, str) and value != "auto" else None


def _from_config_dict(name: str, cfg: dict) -> ModelSpec:
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelSpec(
            name=name,
            arch=str(cfg.get("arch") or cfg.get("model_type", "llama")),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                cfg.get("attention_bias", cfg.get("use_bias", (cfg.get("model_type") or cfg.get("arch")) == "qwen2"))
            ),
            torch_dtype=_dtype_name(cfg.get("dtype") or cfg.get("torch_dtype")),
            explicit_head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
            output_bias=bool(cfg.get("use_bias", False)),
            attention_softcap=float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping") else None,
            final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
            # Qwen2-style configs carry a window they do not use unless use_sliding_window says so
            sliding_window=int(cfg["sliding_window"])
            if cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
            else None,
            attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"model config for {name} lacks a decoder shape field: {exc}") from None


CATALOG_KEYS = (
    "arch",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "torch_dtype",
    "head_dim",
    "use_bias",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "attention_dropout",
)


def catalog() -> dict[str, dict]:
    data = yaml.safe_load((catalog_dir() / "models" / "catalog.yaml").read_text())
    raise_problems(
        [p for name, shape in data.items() for p in unknown_keys(shape, CATALOG_KEYS, f"{name}: ")],
        "models/catalog.yaml",
    )
    return data


def load_model_spec(model: str) -> ModelSpec:
    """A local model folder (reads config.json) or a hub id from the catalog (no download)."""
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"model folder {model} has no config.json")
        try:
            return _from_config_dict(model, json.loads(config.read_text()))
        except json.JSONDecodeError as exc:
            raise UserError(f"{config} is not valid JSON: {exc}") from None
    known = catalog()
    if model in known:
        return _from_config_dict(model, known[model])
    if path.is_absolute() or model.startswith(".") or model.count("/") != 1:
        raise UserError(f"model path {model} does not exist")
    raise UserError(
        f"model '{model}' is neither a local folder nor in lfa's offline catalog "
        f"({', '.join(known)}); download it and pass its folder"
    )


def count_params_meta(model_dir: str) -> int:
    """Exact parameter count by instantiating the architecture on the meta device (imports torch)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
