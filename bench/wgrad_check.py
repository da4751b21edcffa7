"""The fp32 weight-gradient accumulation of master weights, timed two ways on one decoder layer's linear shapes
(issue 33: "gradient accumulation without an fp32 pass per micro-batch"):

  hook    what lfa's plugin does (plugin/master_weights.py): the 16-bit weight-gradient GEMM, then the mixed-dtype
          add of that 16-bit gradient into the fp32 master gradient (10 bytes per parameter, priced at the
          streaming rate);
  fused   the GEMM adds into the fp32 gradient itself (torch.addmm with out_dtype=float32 over the fp32 gradient,
          Megatron's gradient-accumulation fusion): no 16-bit gradient and no separate pass.

For each, the time per micro-batch for the whole model (layer x layers) and the largest error against an fp64
reference of the same accumulation. Prints a table, writes JSON. Not lfa's training path: a measurement of what a
fused path would save before one is built.

usage: python bench/wgrad_check.py OUT_DIR [--model NAME] [--tokens 4096] [--repeats 20] [--device cuda|cpu]
(cpu: small shapes, a check of the script only; no timing is meaningful there)"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lf_adapter.hardware import load_profile  # noqa: E402
from lf_adapter.model_spec import load_model_spec  # noqa: E402
from lf_adapter.throughput import MASTER_ACCUMULATE_BYTES_PER_PARAM, streaming_bytes_per_s  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import HARDWARE  # noqa: E402

WHOLE_CARD_PROFILES = HARDWARE["whole"][0]  # lfa's profile of each card the bench runs on


def layer_linears(spec) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear weight in one decoder layer."""
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.q_width, spec.kv_width
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "up": (f, h), "down": (h, f)}
    if spec.gated_mlp:
        shapes["gate"] = (f, h)
    return shapes


def hook_path(master_grad, grad_out, inputs) -> None:
    master_grad.add_(grad_out.t() @ inputs)  # a 16-bit GEMM output, then the mixed-dtype add


def fused_path(master_grad, grad_out, inputs) -> None:
    import torch

    torch.addmm(master_grad, grad_out.t(), inputs, out_dtype=torch.float32, out=master_grad)


def timed(fn, args_list, repeats: int, device: str) -> float:
    """Seconds per call over all shapes, after one warm-up pass."""
    import torch

    for args in args_list:
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        for args in args_list:
            fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="LLM4Binary/llm4decompile-6.7b-v2")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in one micro-batch (the 6.7B default: 4096)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("wgrad_check: no CUDA GPU here (--device cpu checks the script on small shapes)")
    spec = load_model_spec(args.model)
    shapes = layer_linears(spec)
    scale = 1 if args.device == "cuda" else 64  # the CPU check runs the same code on shapes 64x smaller
    tokens = max(8, args.tokens // scale)
    torch.manual_seed(0)
    cases = {}
    for name, (out_features, in_features) in shapes.items():
        out_features, in_features = max(8, out_features // scale), max(8, in_features // scale)
        grad_out = torch.randn(tokens, out_features, device=args.device, dtype=torch.bfloat16)
        inputs = torch.randn(tokens, in_features, device=args.device, dtype=torch.bfloat16)
        master = torch.randn(out_features, in_features, device=args.device, dtype=torch.float32)
        cases[name] = (master, grad_out, inputs)
    reference = {
        name: master.double() + grad_out.double().t() @ inputs.double()
        for name, (master, grad_out, inputs) in cases.items()
    }
    row = {"model": args.model, "tokens": tokens, "device": args.device, "layers": spec.num_layers}
    if args.device == "cuda":
        row["gpu"] = torch.cuda.get_device_name(0)
    params = sum(master.numel() for master, _, _ in cases.values())
    for path, fn in (("hook", hook_path), ("fused", fused_path)):
        copies = {name: (master.clone(), g, x) for name, (master, g, x) in cases.items()}
        try:
            for case in copies.values():
                fn(*case)
        except (RuntimeError, NotImplementedError, TypeError) as error:  # out_dtype: CUDA only, torch >= 2.8
            row[path] = {"unsupported": str(error).splitlines()[0][:200]}
            continue
        error = max(
            ((case[0].double() - reference[name]).abs().max() / reference[name].abs().max()).item()
            for name, case in copies.items()
        )
        seconds = timed(fn, [(master.clone(), g, x) for master, g, x in cases.values()], args.repeats, args.device)
        row[path] = {
            "ms_per_layer": round(seconds * 1e3, 3),
            "ms_per_micro_batch": round(seconds * 1e3 * spec.num_layers, 2),
            "max_relative_error_vs_fp64": float(f"{error:.3g}"),
        }
    profile = next((p for kind, p in WHOLE_CARD_PROFILES.items() if kind in row.get("gpu", "")), None)
    if profile:  # what lfa prices for the add alone on this card's profile (the 16-bit GEMM is in the FLOP term)
        hbm = load_profile(profile).gpu.hbm_tbps
        row["priced_add_ms_per_micro_batch"] = round(
            MASTER_ACCUMULATE_BYTES_PER_PARAM * params * spec.num_layers / streaming_bytes_per_s(hbm) * 1e3, 2
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wgrad_check.json").write_text(json.dumps(row, indent=1))
    print(f"BENCH wgrad {args.model} {tokens} tokens, {spec.num_layers} layers, {args.device}")
    for path in ("hook", "fused"):
        r = row[path]
        if "unsupported" in r:
            print(f"  {path:6s} unsupported here: {r['unsupported']}")
        else:
            print(
                f"  {path:6s} {r['ms_per_layer']:8.3f} ms/layer {r['ms_per_micro_batch']:9.2f} ms/micro-batch"
                f"  max error vs fp64 {r['max_relative_error_vs_fp64']:.2e}"
            )
    if "priced_add_ms_per_micro_batch" in row:
        print(f"  priced add (lfa, streaming rate): {row['priced_add_ms_per_micro_batch']} ms/micro-batch")


if __name__ == "__main__":
    main()
