"""Peak probe (device): one micro-batch of a zoo shape at full depth, forward with the loss and backward, without
optimizer states: the GPU memory its activations and logits path take, in each precision path, beside lfa's
prediction of the same (memory.py's activation and logits items of the plan). Separates what a zoo row's peak mixes.

The model is built on the GPU (random weights): a 16-bit model (master weights' path) or fp32 weights under autocast;
each parameter's gradient is dropped as soon as autograd has it (what lfa's master weights do after adding it into
the fp32 master's; the states are priced apart), rows flattened with lfa's varlen attention, the first K decoder
layers checkpointed. Reported in GiB above the weights: after the forward (the loss computed as transformers does)
and the peak through the backward.

usage: python bench/peak_probe.py OUT_DIR --only NAME[,NAME] [--tokens 6144] [--rows 3] [--checkpoint 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import ZOO, zoo_config  # noqa: E402

GIB = 1024**3


def measure(name: str, mode: str, tokens: int, rows: int, checkpoint: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lf_adapter.plugin import padding_free
    from lf_adapter.plugin.hooks import checkpoint_first_layers

    sixteen_bit = mode == "16-bit"
    config = zoo_config(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if sixteen_bit else torch.float32)
    model.train()
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpoint_first_layers(model, checkpoint)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    row_len = tokens // rows
    ids = torch.randint(3, config.vocab_size, (rows, row_len), device="cuda")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    padding_free.use_on(model)
    assert padding_free.flatten_batch(batch, [row_len] * rows)
    batch.pop("attention_mask", None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not sixteen_bit):
        loss = model(**batch, use_cache=False).loss
    after_forward = torch.cuda.memory_allocated() - base
    forward_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated() - base
    result = {
        "after_forward_gib": after_forward / GIB,
        "forward_peak_gib": forward_peak / GIB,
        "backward_peak_gib": backward_peak / GIB,
        "weights_gib": base / GIB,
    }
    del model, loss, batch
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", required=True, help="comma-separated zoo names (or their last part)")
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--checkpoint", type=int, default=4, help="first K decoder layers checkpointed (0: none)")
    args = parser.parse_args()
    names = [n for n in ZOO if any(o in (n, n.split("/")[-1]) for o in args.only.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        for mode in ("16-bit", "autocast"):
            result = measure(name, mode, args.tokens, args.rows, args.checkpoint)
            row = {
                "model": name,
                "mode": mode,
                "tokens": args.tokens,
                "rows": args.rows,
                "checkpoint_layers": args.checkpoint,
                **{k: round(v, 3) for k, v in result.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "peak_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
