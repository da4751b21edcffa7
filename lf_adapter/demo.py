"""The embedded default: a tiny DeepSeek-Coder-shaped model and sample pseudo2norm data, built offline.

The data are IDA-Hex-Rays-like pseudo-C paired with the original C skeleton whose identifiers are placeholders
(func1, var1, type1, field1), generated from one random program so both sides describe the same function.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"
PROMPT = "# This is the pseudo code:\n{code}\n# What is the source code?\n"
_WIDTH = {"int": ("_DWORD", 4), "long": ("_QWORD", 8), "char": ("_BYTE", 1), "short": ("_WORD", 2)}


def _function(rng: random.Random) -> tuple[str, str]:
    """One function as (pseudo-C, placeholder skeleton)."""
    fields = [rng.choice(list(_WIDTH)) for _ in range(rng.randint(2, 5))]
    offsets, off = [], 0
    for ctype in fields:
        offsets.append(off)
        off += _WIDTH[ctype][1] if _WIDTH[ctype][1] >= 4 else 4
    n_locals = rng.randint(2, 5)
    sub = f"sub_{rng.randint(0x401000, 0x40FFFF):X}"
    pseudo = [f"__int64 __fastcall {sub}(__int64 a1, unsigned int a2)", "{"]
    skel = ["int func1(struct type1 *var1, unsigned int var2)", "{"]
    pseudo += [f"  __int64 v{i + 3}; // rax" for i in range(n_locals)] + [""]
    skel += [f"  int var{i + 3};" for i in range(n_locals)] + [""]
    callees = {}

    def stmt(depth: int, indent: str) -> tuple[list[str], list[str]]:
        kind = rng.random()
        local = rng.randint(3, n_locals + 2)
        field_index = rng.randrange(len(fields))
        tag, _ = _WIDTH[fields[field_index]]
        if kind < 0.3:
            return (
                [f"{indent}v{local} = *({tag} *)(a1 + {offsets[field_index]});"],
                [f"{indent}var{local} = var1->field{field_index + 1};"],
            )
        if kind < 0.5:
            address = rng.randint(0x401000, 0x40FFFF)
            name = callees.setdefault(address, f"func{len(callees) + 2}")
            const = rng.randint(0, 64)
            return (
                [f"{indent}v{local} = sub_{address:X}(v{local}, {const}LL);"],
                [f"{indent}var{local} = {name}(var{local}, {const});"],
            )
        if kind < 0.65:
            return (
                [f"{indent}*({tag} *)(a1 + {offsets[field_index]}) = v{local};"],
                [f"{indent}var1->field{field_index + 1} = var{local};"],
            )
        if kind < 0.85 and depth < 2:
            limit = rng.randint(0, 99)
            body = [stmt(depth + 1, indent + "  ") for _ in range(rng.randint(1, 3))]
            return (
                [f"{indent}if ( v{local} > {limit} )", f"{indent}{{"]
                + [line for b in body for line in b[0]]
                + [f"{indent}}}"],
                [f"{indent}if (var{local} > {limit}) {{"] + [line for b in body for line in b[1]] + [f"{indent}}}"],
            )
        if depth < 2:
            body = [stmt(depth + 1, indent + "  ") for _ in range(rng.randint(1, 3))]
            return (
                [f"{indent}for ( i = 0; i < a2; ++i )", f"{indent}{{"]
                + [line for b in body for line in b[0]]
                + [f"{indent}}}"],
                [f"{indent}for (var{n_locals + 3} = 0; var{n_locals + 3} < var2; ++var{n_locals + 3}) {{"]
                + [line for b in body for line in b[1]]
                + [f"{indent}}}"],
            )
        return [f"{indent}++v{local};"], [f"{indent}var{local}++;"]

    for _ in range(rng.randint(3, 9)):
        p, s = stmt(0, "  ")
        pseudo += p
        skel += s
    result = rng.randint(3, n_locals + 2)
    pseudo += [f"  return v{result};", "}"]
    skel += [f"  return var{result};", "}"]
    return "\n".join(pseudo), "\n".join(skel)


def sample_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        pseudo, skeleton = _function(rng)
        rows.append({"instruction": "", "input": PROMPT.format(code=pseudo), "output": skeleton})
    return rows


def write_dataset(path: Path, count: int = 256, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in sample_rows(count, seed):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def build_tiny_model(
    out_dir: Path, corpus_rows: list[dict], vocab_size: int = 600, hidden: int = 64, layers: int = 2, heads: int = 4
) -> Path:
    """A random-weight LlamaForCausalLM (DeepSeek-Coder architecture) with a BPE tokenizer trained on the rows."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([r["input"] + r["output"] for r in corpus_rows], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2 + hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        rope_theta=100000.0,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def build_demo_assets(root: Path, rows: int = 256) -> tuple[Path, Path]:
    """root/model (tiny model + tokenizer) and root/pseudo2norm.jsonl; reused when already built."""
    data = root / "pseudo2norm.jsonl"
    model = root / "model"
    if not data.is_file():
        write_dataset(data, rows)
    if not (model / "config.json").is_file():
        corpus = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        build_tiny_model(model, corpus)
    return model, data
