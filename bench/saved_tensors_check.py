"""Saved-tensor check (device or CPU): what one decoder layer of each zoo family keeps for its backward, measured,
against lf_adapter/saved_tensors.py (the activation term of lfa's memory model, by construction).

Each zoo shape is built with 1 and 3 decoder layers (random weights, a small vocabulary) and run forward on 2 and 4
rows of one length, as one flattened micro-batch (padding-free, lfa's varlen attention) or a padded batch (sdpa /
eager), as a 16-bit model (without autocast, or under it as lfa's master weights run in LLaMA-Factory's trainer)
or fp32 weights under autocast, with liger's kernels where lfa plans them (CUDA only).
Two measures per layer and token, each the difference of 3 and 1 layers at two row counts (weights and
per-micro-batch constants cancel):
- saved: the bytes of the distinct storages autograd's saved-tensor hooks see (what the backward keeps);
- live: allocated memory after the forward minus before (CUDA only: also what the saved tensors keep alive).
Rows go to OUT/saved_tensors.json; the table prints measured / predicted - 1.

usage: python bench/saved_tensors_check.py OUT_DIR [--only NAME,...] [--row-len 1024] [--cpu]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import ZOO, zoo_config  # noqa: E402

from lf_adapter.model_spec import load_model_spec  # noqa: E402
from lf_adapter.saved_tensors import saved_tensors_per_token  # noqa: E402

NO_LIGER = {"starcoder2"}  # liger has no patch for it (lfa plans it without)
EAGER = {"gemma2"}  # lfa plans eager attention for soft-capped scores


def build(name: str, layers: int, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM

    # a small vocabulary: the layers' tensors do not depend on it, the embedding would only fill memory
    config = zoo_config(name, {"num_hidden_layers": layers, "vocab_size": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def apply_liger(model) -> None:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    from lf_adapter.plugin import fused_mlp

    _apply_liger_kernel_to_instance(model=model)
    fused_mlp.use_on(model)


def measure(name: str, layers: int, rows: int, row_len: int, mode: str, attention: str, liger: bool, device) -> dict:
    """Saved bytes (and live bytes on CUDA) of one forward of the decoder stack."""
    import torch

    from lf_adapter.plugin import padding_free

    sixteen_bit = mode != "autocast"  # "16-bit" without autocast, "16-bit+autocast": lfa's master weights in a trainer
    model, config = build(name, layers, torch.bfloat16 if sixteen_bit else torch.float32, device)
    if liger:
        apply_liger(model)
    model.train()
    ids = torch.randint(3, 1000, (rows, row_len), device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if attention == "varlen":
        padding_free.register()
        padding_free.use_on(model)
        assert padding_free.flatten_batch(batch, [row_len] * rows)
    else:
        model.config._attn_implementation = attention
    batch.pop("labels")
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mode != "16-bit"):
            hidden = model.model(**batch, use_cache=False).last_hidden_state
    live = torch.cuda.memory_allocated() - before - hidden.numel() * hidden.element_size() if cuda else None
    result = {"saved": sum(storages.values()), "live": live}
    del hidden, model, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def per_token_layer(name, rows_pair, row_len, mode, attention, liger, device) -> dict:
    """Rows of one length (eager attention's scores grow with it), two row counts: bytes per token and layer."""
    values = {}
    for rows in rows_pair:
        three = measure(name, 3, rows, row_len, mode, attention, liger, device)
        one = measure(name, 1, rows, row_len, mode, attention, liger, device)
        values[rows] = {k: (three[k] - one[k]) / 2 if three[k] is not None else None for k in three}
    low, high = rows_pair
    span = (high - low) * row_len
    return {k: (values[high][k] - values[low][k]) / span if values[high][k] is not None else None for k in values[high]}


def eager_bytes_per_token_layer(spec, row_len: int) -> float:
    from lf_adapter.memory import coefficients

    per_score = coefficients()["activation"]["eager_attention_bytes_per_score"] + (
        2.0 if spec.attention_softcap else 0.0
    )
    return per_score * spec.num_heads * row_len


def _error(measured: float | None, predicted: float) -> str:
    return f"{measured / predicted - 1:+7.1%}" if measured is not None else "      -"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default="", help="comma-separated zoo names (or their last part)")
    parser.add_argument("--row-len", type=int, default=0, help="tokens per row (default 1,024; 256 on the CPU)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU: no liger, no live memory")
    args = parser.parse_args()
    import torch

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    names = [n for n in ZOO if not args.only or any(o in (n, n.split("/")[-1]) for o in args.only.split(","))]
    row_len = args.row_len or (256 if device == "cpu" else 1024)
    rows_pair = (2, 4)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    columns = ("model", 34), ("mode", 9), ("attn", 7), ("liger", 5), ("pred B", 8), ("saved B", 8), ("err", 7)
    print(" ".join(f"{n:{w}}" for n, w in columns), f"{'live B':>8} {'err':>7}")
    for name in names:
        arch = ZOO[name]["model_type"]
        attentions = ["eager", "sdpa"] if arch in EAGER else ["varlen", "sdpa"]
        liger = device == "cuda" and arch not in NO_LIGER
        spec = load_model_spec(name)  # the catalog's shape of the hub name (the zoo's)
        for mode in ("16-bit", "16-bit+autocast", "autocast"):
            for attention in attentions:
                start = time.time()
                measured = per_token_layer(name, rows_pair, row_len, mode, attention, liger, device)
                predicted = sum(saved_tensors_per_token(spec, mode != "autocast", liger, attention).values())
                if attention == "eager":  # the scores per query token (heads x row length), as memory.py adds them
                    predicted += eager_bytes_per_token_layer(spec, row_len)
                row = {
                    "model": name,
                    "model_type": arch,
                    "mode": mode,
                    "attention": attention,
                    "liger": liger,
                    "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                    "rows": list(rows_pair),
                    "row_len": row_len,
                    "predicted_bytes": predicted,
                    "saved_bytes": measured["saved"],
                    "live_bytes": measured["live"],
                    "seconds": round(time.time() - start, 1),
                }
                rows.append(row)
                print(
                    f"{name:34} {mode:9} {attention:7} {str(liger):5} {predicted:8.0f} {measured['saved']:8.0f}",
                    _error(measured["saved"], predicted),
                    f"{measured['live']:8.0f}" if measured["live"] is not None else "       -",
                    _error(measured["live"], predicted),
                    flush=True,
                )
                (args.out / "saved_tensors.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
