"""Causal varlen attention, forward + backward, by kernel: flash (what torch's varlen_attn runs on the device's torch
2.11) against cuDNN's ragged SDPA (aten._cudnn_attention_forward/backward with cumulative sequence lengths, what
torch 2.14's varlen_attn takes on Hopper with cuDNN >= 9.18). Issue 33: attention was 16-18% of the 1.3B's step on
the H100 (session 34), the flash backward 0.18 s of 1.57 s. Each case checks cuDNN's output and gradients against
flash's and times both with CUDA events. Needs only torch and a GPU.

usage: python bench/attention_kernels.py OUT_JSON [--budgets 16384,32768,65536] [--heads 16,32] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

HEAD_DIM = 128
CUTOFF = 2048


def row_lengths(budget: int, seed: int) -> list[int]:
    """Rows as the bench data has them (mean ~1,700 of at most 2,048 tokens after the cutoff), filling the budget."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while True:
        n = min(CUTOFF, max(64, int(rng.lognormvariate(7.35, 0.45))))
        if sum(lengths) + n > budget:
            return lengths or [budget]
        lengths.append(n)


def flash(q, k, v, cu, max_len, scale):
    out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, return_debug_mask=False, scale=scale
    )
    return out, (lse, rng_state)


def flash_backward(grad, q, k, v, out, saved, cu, max_len, scale):
    lse, rng_state = saved
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng_state, unused, scale=scale
    )


def cudnn(q, k, v, cu, max_len, scale):
    result = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )
    return result[0], (result[1], result[6], result[7])


def cudnn_backward(grad, q, k, v, out, saved, cu, max_len, scale):
    lse, seed, offset = saved
    return torch.ops.aten._cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cu, cu, max_len, max_len, 0.0, True, scale=scale
    )


KERNELS = {"flash": (flash, flash_backward), "cudnn": (cudnn, cudnn_backward)}


def run(name, q, k, v, grad, cu, max_len, scale):
    forward, backward = KERNELS[name]
    out, saved = forward(q, k, v, cu, max_len, scale)
    return (out, *backward(grad, q, k, v, out, saved, cu, max_len, scale))


def timed(name, q, k, v, grad, cu, max_len, scale, iters: int) -> dict:
    forward, backward = KERNELS[name]
    for _ in range(3):
        run(name, q, k, v, grad, cu, max_len, scale)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fwd = bwd = 0.0
    for _ in range(iters):
        marks[0].record()
        out, saved = forward(q, k, v, cu, max_len, scale)
        marks[1].record()
        backward(grad, q, k, v, out, saved, cu, max_len, scale)
        marks[2].record()
        torch.cuda.synchronize()
        fwd += marks[0].elapsed_time(marks[1])
        bwd += marks[1].elapsed_time(marks[2])
    return {"forward_ms": round(fwd / iters, 3), "backward_ms": round(bwd / iters, 3)}


def causal_flops(lengths: list[int], heads: int) -> float:
    """Forward + backward matmul FLOPs of causal attention (backward 2.5x forward, as FlashAttention counts)."""
    forward = sum(4 * n * n * HEAD_DIM * heads / 2 for n in lengths)
    return 3.5 * forward


def case(budget: int, heads: int, iters: int, seed: int, layout: str = "tokens-major") -> dict:
    lengths = row_lengths(budget, seed)
    total, max_len = sum(lengths), max(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(torch.tensor(lengths, device="cuda"), 0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, grad = (
        torch.randn(total, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)
    )
    if layout == "heads-major":  # [H, T, D] storage seen as [T, H, D], as liger's RoPE hands q and k over
        q, k, v, grad = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v, grad))
    scale = HEAD_DIM**-0.5
    row = {"budget": budget, "heads": heads, "layout": layout, "rows": len(lengths), "tokens": total}
    row["max_len"] = max_len
    reference = run("flash", q, k, v, grad, cu, max_len, scale)
    try:
        other = run("cudnn", q, k, v, grad, cu, max_len, scale)
    except Exception as error:  # the op or this layout missing on this torch/cuDNN: say so, time flash alone
        row["cudnn_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        other = None
    if other is not None:
        row["max_abs_diff"] = {
            name: round(float((a.float() - b.float()).abs().max()), 5)
            for name, a, b in zip(("out", "dq", "dk", "dv"), reference, other)
        }
        again = run("flash", q, k, v, grad, cu, max_len, scale)  # flash against itself: its backward's atomics
        row["flash_rerun_max_abs_diff"] = {
            name: round(float((a.float() - b.float()).abs().max()), 5)
            for name, a, b in zip(("out", "dq", "dk", "dv"), reference, again)
        }
        row["reference_max_abs"] = {
            name: round(float(a.float().abs().max()), 5) for name, a in zip(("out", "dq", "dk", "dv"), reference)
        }
    flops = causal_flops(lengths, heads)
    for name in KERNELS if other is not None else ("flash",):
        times = timed(name, q, k, v, grad, cu, max_len, scale, iters)
        times["tflops"] = round(flops / ((times["forward_ms"] + times["backward_ms"]) / 1e3) / 1e12, 1)
        row[name] = times
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--budgets", default="16384,32768,65536")
    parser.add_argument("--heads", default="16,32")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    header = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
    }
    print("ATTN", json.dumps(header), flush=True)
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        for budget in (int(b) for b in args.budgets.split(",")):
            for layout in ("tokens-major", "heads-major") if budget == 32768 else ("tokens-major",):
                row = case(budget, heads, args.iters, seed=budget + heads, layout=layout)
                rows.append(row)
                print("ATTN", json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({**header, "rows": rows}, f, indent=1)
    print(
        f"{'heads':>5} {'layout':>12} {'tokens':>7} {'flash fwd+bwd ms':>17} {'cudnn fwd+bwd ms':>17} "
        f"{'speed-up':>8}  max diff"
    )
    for r in rows:
        f = r["flash"]
        c = r.get("cudnn")
        fl = f["forward_ms"] + f["backward_ms"]
        cu = f"{c['forward_ms'] + c['backward_ms']:17.2f}" if c else f"{'-':>17}"
        ratio = f"{fl / (c['forward_ms'] + c['backward_ms']):8.2f}" if c else f"{'-':>8}"
        print(
            f"{r['heads']:5} {r['tokens']:7} {fl:17.2f} {cu} {ratio}  {r.get('max_abs_diff') or r.get('cudnn_error')}"
        )


if __name__ == "__main__":
    main()
