"""Phi-3's MLP under liger without the copies: liger's LigerPhi3SwiGLUMLP chunks the fused gate_up output into two
strided halves, which its SiLU-mul function copies to contiguous tensors (and whose gradients autograd concatenates
back); liger's LigerFusedGateUpSiLUMulFunction reads both halves in place and writes the fused gradient: the same
arithmetic in the same order (liger 0.8.5 ops/swiglu.py, gate multiplier 1; bench/fused_mlp_check.py compares them
bit for bit on a GPU), 16 bytes less per token and intermediate unit in each layer's forward, recompute and
backward. LFA_FUSED_GATE_UP=0 keeps liger's own (benchmarks)."""

from __future__ import annotations

import os
import types

from . import contract


def fused_swiglu(gate_up):
    """silu(gate) * up of a [..., 2 x intermediate] tensor; liger's function takes and gives back rows (2-D)."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    rows = LigerFusedGateUpSiLUMulFunction.apply(gate_up.reshape(-1, gate_up.shape[-1]))
    return rows.view(*gate_up.shape[:-1], rows.shape[-1])


def _fused_forward(self, x):
    return self.down_proj(fused_swiglu(self.gate_up_proj(x)))


def use_on(model) -> int:
    """Switch every liger Phi-3 MLP of the model to the fused gate-up function; how many were switched (0 where
    liger did not patch the MLP or this liger lacks the function)."""
    if os.environ.get(contract.FUSED_GATE_UP) == "0":
        return 0
    try:
        from liger_kernel.ops import swiglu
        from liger_kernel.transformers.swiglu import LigerPhi3SwiGLUMLP
    except ImportError:
        return 0
    if not hasattr(swiglu, "LigerFusedGateUpSiLUMulFunction"):
        return 0
    switched = 0
    for module in model.modules():
        # liger swaps the class before the model is built, or patches an instance's forward
        liger_s = isinstance(module, LigerPhi3SwiGLUMLP) or (
            getattr(getattr(module, "forward", None), "__func__", None) is LigerPhi3SwiGLUMLP.forward
        )
        if liger_s and hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(_fused_forward, module)
            switched += 1
    return switched
