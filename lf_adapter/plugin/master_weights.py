"""16-bit weights in the model, fp32 master weights in the optimizer (LFA_MASTER_WEIGHTS=1; bf16 or fp16, one
process, no DeepSpeed or FSDP), as DeepSpeed and Megatron train. LLaMA-Factory upcasts a full fine-tune to fp32 and
trains under autocast, which casts every weight to 16 bits again in each micro-batch's forward (and recompute) and
keeps the residual stream in fp32. Here the model holds 16-bit weights; each fp32 weight becomes the optimizer's
master, each micro-batch's 16-bit gradient is added into the master's fp32 gradient as soon as autograd has it (then
freed), unscaling (fp16), clipping and AdamW run on the masters, and the step copies them back into the model.
The plain linear layers go further (LFA_FUSED_WGRAD unset or "1"; "0" leaves them to the hook): their
weight-gradient GEMM adds into the fp32 gradient itself (addmm with an fp32 output, Megatron's gradient-accumulation
fusion), with no 16-bit gradient and no separate pass; where this torch lacks that GEMM (the CPU) they add its
16-bit product, as the hook does.
LLaMA-Factory's pure_bf16 is not this: it has no fp32 master. Checkpoints and the final model are saved from the
masters (fp32, as without this), and a resume loads them back."""

from __future__ import annotations

import contextlib
import functools
import os
import types

from . import contract, run_kernels


def why_not(trainer) -> str | None:
    """Why master weights cannot run in this trainer (None: they can)."""
    args = trainer.args
    if not (args.bf16 or args.fp16):
        return "16-bit mixed precision (bf16 or fp16)"
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        return "a plain process: DeepSpeed and FSDP keep their own master weights"
    if args.world_size > 1:
        return "one process (DDP reduces the model's own gradients)"
    import torch

    if not any(p.requires_grad and p.dtype == torch.float32 for p in trainer.model.parameters()):
        return "fp32 trainable weights to keep as masters (these are 16-bit already)"
    return None


class MasterWeights:
    """The model's trainable parameters (16-bit now) paired with their fp32 masters."""

    def __init__(self, model, dtype=None, fused_weight_gradients: bool = False):
        import torch

        self.dtype = dtype or torch.bfloat16
        self.pairs = []
        seen = set()
        for param in model.parameters():
            if not param.requires_grad or id(param) in seen or param.dtype != torch.float32:
                continue
            seen.add(id(param))  # tied weights are one parameter: one master
            master = torch.nn.Parameter(param.data, requires_grad=True)  # the fp32 storage moves, no copy
            param.data = param.data.to(self.dtype)
            param.register_post_accumulate_grad_hook(_accumulate_into(master))
            self.pairs.append((param, master))
        self.master_of = {id(param): master for param, master in self.pairs}
        self.fused_linears = _fuse_weight_gradients(model, self.master_of) if fused_weight_gradients else 0

    @property
    def masters(self) -> list:
        return [master for _, master in self.pairs]

    def take_over(self, optimizer) -> None:
        """Point the optimizer (built over the model's parameters, no state yet) at the masters; its step copies
        them back into the model and clears their gradients (a step the loss scaler skips: zero_grad below)."""
        for group in optimizer.param_groups:
            group["params"] = [self.master_of.get(id(p), p) for p in group["params"]]
        original_step = optimizer.step

        def step(_optimizer, *args, **kwargs):
            result = original_step(*args, **kwargs)
            self.copy_to_model()
            self.zero_grad()
            return result

        # a bound method: torch's LR schedulers wrap optimizer.step through its __func__
        optimizer.step = types.MethodType(step, optimizer)

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None

    def copy_to_model(self) -> None:
        import torch

        with torch.no_grad():
            torch._foreach_copy_([p for p, _ in self.pairs], self.masters)

    @contextlib.contextmanager
    def masters_in_model(self):
        """The model holds the fp32 masters themselves while saving or loading a checkpoint (a load copies into
        them in place), then 16-bit copies again."""

        for param, master in self.pairs:
            param.data = master.data
        try:
            yield
        finally:
            for param, master in self.pairs:
                param.data = master.data.to(self.dtype)


def _fuse_weight_gradients(model, master_of: dict) -> int:
    """Point each plain linear layer whose weight has a master (the output embedding aside: tied to the input one,
    or walked by liger's fused loss) at fused_weight_gradient_linear; how many. Any other use of a weight still reaches
    its master through the hook, so a sum of both paths is still the whole gradient."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    fused = 0
    for module in model.modules():
        if type(module).forward is not torch.nn.Linear.forward or module is output:
            continue
        master = master_of.get(id(module.weight))
        if master is not None:
            module.forward = types.MethodType(_fused_linear_forward(master), module)
            fused += 1
    return fused


def _fused_linear_forward(master):
    def forward(self, x):  # the weight detached: autograd has no gradient for it, so its hook does not run
        return fused_weight_gradient_linear().apply(x, self.weight.detach(), self.bias, master)

    return forward


def _weight_gradient_into(master, grad_out, inputs) -> None:
    """master.grad += grad_out^T @ inputs (rows: tokens), in the GEMM with an fp32 output where this torch has one
    for the device and dtype, else the 16-bit product added (the hook's arithmetic)."""
    import torch

    if _fp32_output_gemm(grad_out.device.type, grad_out.dtype):
        if master.grad is None:
            master.grad = torch.mm(grad_out.t(), inputs, out_dtype=torch.float32)
        else:
            torch.addmm(master.grad, grad_out.t(), inputs, out_dtype=torch.float32, out=master.grad)
    elif master.grad is None:
        master.grad = (grad_out.t() @ inputs).to(torch.float32)
    else:
        master.grad.add_(grad_out.t() @ inputs)


@functools.cache
def _fp32_output_gemm(device_type: str, dtype) -> bool:
    """Whether torch's 16-bit GEMM with an fp32 output (mm/addmm out_dtype: CUDA, torch >= 2.8) runs here."""
    import torch

    try:
        a = torch.ones(2, 2, device=device_type, dtype=dtype)
        c = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(c.dtype == torch.float32 and c[0, 0].item() == 4.0)


@functools.cache
def fused_weight_gradient_linear():
    """The autograd function (built on first use: torch is imported when the plugin trains)."""
    import torch

    class FusedWeightGradLinear(torch.autograd.Function):
        """y = x W^T + b whose backward adds the weight's gradient into its fp32 master's; the input's and the bias's
        gradients as nn.Linear's."""

        @staticmethod
        def forward(ctx, x, weight, bias, master):
            # as autocast would cast it (an fp32 norm's output); autograd casts its gradient back
            x = x.to(weight.dtype)
            ctx.save_for_backward(x, weight)
            ctx.master, ctx.has_bias = master, bias is not None
            return torch.nn.functional.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, grad_out):
            x, weight = ctx.saved_tensors
            rows = grad_out.reshape(-1, grad_out.shape[-1])
            grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
            _weight_gradient_into(ctx.master, rows, x.reshape(-1, x.shape[-1]))
            grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return grad_x, None, grad_bias, None

    return FusedWeightGradLinear


def _accumulate_into(master):
    import torch

    def hook(param) -> None:
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return hook


def set_up(trainer) -> None:
    """After the Trainer is built (the model on its device): master weights where LFA_MASTER_WEIGHTS=1 asks and
    they can run, else the autocast path with a message. The trainer zeroes the model's gradients after each step,
    taken or skipped by fp16's loss scaler: the masters' are cleared with them."""
    if os.environ.get(contract.MASTER_WEIGHTS) != "1":
        return
    reason = why_not(trainer)
    if reason:
        os.environ[contract.MASTER_WEIGHTS] = "0"
        print(f"lfa: master weights need {reason}: training fp32 weights under autocast", flush=True)
        return
    import torch

    dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16
    # not under torch.compile (a bench experiment): its graphs would have to carry the in-place gradient add
    fused = run_kernels.from_env(os.environ).fused_weight_gradients and not run_kernels.compile_backend(os.environ)
    trainer._lfa_master_weights = weights = MasterWeights(trainer.model, dtype, fused_weight_gradients=fused)
    model_zero_grad = trainer.model.zero_grad

    def zero_grad(*args, **kwargs):
        weights.zero_grad()
        return model_zero_grad(*args, **kwargs)

    trainer.model.zero_grad = zero_grad
    accelerator = trainer.accelerator
    original_clip = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):  # the trainer passes the model's: the masters have them
        return original_clip(weights.masters, max_norm, norm_type=norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    device = next(trainer.model.parameters()).device.type
    if not weights.fused_linears:
        how = "each weight gradient added into its fp32 one by a hook"
    elif _fp32_output_gemm(device, dtype):
        how = f"{weights.fused_linears} linear layers' weight-gradient GEMMs add into the fp32 ones"
    else:
        how = (
            f"{weights.fused_linears} linear layers add their 16-bit weight gradients (no fp32-output GEMM on {device})"
        )
    print(
        f"lfa: master weights: {len(weights.pairs)} {str(dtype).split('.')[-1]} weights in the model, their fp32 "
        f"masters and fp32 gradients in the optimizer; {how}",
        flush=True,
    )


def patch_trainer(trainer_class) -> None:
    """The optimizer over the masters; saves and loads through them."""
    original_create = trainer_class.create_optimizer
    original_save = trainer_class._save
    original_load = trainer_class._load_from_checkpoint

    def create_optimizer(self, *args, **kwargs):
        optimizer = original_create(self, *args, **kwargs)
        weights = getattr(self, "_lfa_master_weights", None)
        if weights is not None and not getattr(optimizer, "_lfa_masters", False):
            weights.take_over(optimizer)
            optimizer._lfa_masters = True
        return optimizer

    def _save(self, output_dir=None, state_dict=None):
        weights = getattr(self, "_lfa_master_weights", None)
        with contextlib.nullcontext() if weights is None or state_dict is not None else weights.masters_in_model():
            return original_save(self, output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        weights = getattr(self, "_lfa_master_weights", None)
        with contextlib.nullcontext() if weights is None else weights.masters_in_model():
            return original_load(self, resume_from_checkpoint, model)

    trainer_class.create_optimizer = create_optimizer
    trainer_class._save = _save
    trainer_class._load_from_checkpoint = _load_from_checkpoint
