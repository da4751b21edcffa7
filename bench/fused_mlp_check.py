"""On a GPU with liger: liger's chunked Phi-3 SwiGLU (LigerSiLUMulFunction over torch.chunk) and lfa's fused
gate-up path (plugin/fused_mlp.fused_swiglu: liger's LigerFusedGateUpSiLUMulFunction) give bit-identical outputs
and gradients on a [1, tokens, 2 x intermediate] activation, as a decoder layer has it. Prints one line, exits 1
if not."""

import sys

import torch
from liger_kernel.ops import LigerSiLUMulFunction

from lf_adapter.plugin.fused_mlp import fused_swiglu


def main() -> None:
    torch.manual_seed(0)
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        y = torch.randn(1, 4096, 2 * 8192, device="cuda", dtype=dtype) * 3
        grad = torch.randn(1, 4096, 8192, device="cuda", dtype=dtype)
        chunked_in = y.clone().requires_grad_()
        gate, up = chunked_in.chunk(2, dim=-1)
        chunked = LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0)
        chunked.backward(grad)
        fused_in = y.clone().requires_grad_()
        fused = fused_swiglu(fused_in)
        fused.backward(grad)
        same = torch.equal(chunked, fused) and torch.equal(chunked_in.grad, fused_in.grad)
        results.append(f"{str(dtype).split('.')[-1]} {'bit-identical' if same else 'DIFFERENT'}")
    print("BENCH fused gate-up vs chunked SwiGLU:", ", ".join(results), flush=True)
    sys.exit(0 if all(r.endswith("bit-identical") for r in results) else 1)


if __name__ == "__main__":
    main()
