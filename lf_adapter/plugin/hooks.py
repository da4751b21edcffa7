"""Import hooks run inside LLaMA-Factory's processes (see lf_adapter/plugin/__init__.py for why)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path

from . import contract, run_kernels

_AFTER_IMPORT = {}  # module name -> function(module) called right after the module has executed


class _WrappedLoader(importlib.abc.Loader):
    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # get_source, get_filename... for tracebacks and inspect
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        after = _AFTER_IMPORT.get(fullname)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _WrappedLoader(spec.loader, after)
        return spec


def chat_template_dirs() -> list[Path]:
    from lf_adapter import catalog_dir

    extra = [Path(p) for p in os.environ.get(contract.CHAT_TEMPLATE_DIRS, "").split(os.pathsep) if p]
    return extra + [catalog_dir() / "chat"]


def register_chat_templates(template_module) -> list[str]:
    """Register every lfa chat template (catalog/chat/*.yaml) that LLaMA-Factory does not already have."""
    import yaml
    from llamafactory.data.formatter import StringFormatter

    registered = []
    for folder in chat_template_dirs():
        for path in sorted(folder.glob("*.yaml")):
            spec = yaml.safe_load(path.read_text())
            if spec["name"] in template_module.TEMPLATES:
                continue
            template_module.register_template(
                name=spec["name"],
                format_user=StringFormatter(slots=list(spec["format_user"])),
                format_assistant=StringFormatter(slots=list(spec["format_assistant"])),
                format_system=StringFormatter(slots=list(spec.get("format_system", ["{{content}}"]))),
                default_system=spec.get("default_system", ""),
                stop_words=list(spec.get("stop_words", [])),
                efficient_eos=bool(spec.get("efficient_eos", False)),
            )
            registered.append(spec["name"])
    return registered


def _indexed_cpu(obj, location: str):
    return obj if location.startswith("cpu:") else None


def restore_indexed_cpu_locations() -> None:
    """Multi-process runs on CPUs resume with transformers loading the optimizer state with map_location set to
    args.device, which is torch.device("cpu", rank) there; torch knows how to restore "cpu" but not "cpu:0" ("don't
    know how to restore data location"). An extra deserializer, after torch's own, keeps such storages where they
    are: on the CPU."""
    import torch.serialization as serialization

    if all(entry[2] is not _indexed_cpu for entry in serialization._package_registry):
        serialization.register_package(11, lambda obj: None, _indexed_cpu)


def _wrap_run_exp(tuner_module) -> None:
    original = tuner_module.run_exp

    def run_exp(args=None, callbacks=None):
        from lf_adapter.plugin import callbacks as lfa_callbacks

        restore_indexed_cpu_locations()
        lfa_callbacks.apply_memory_emulation()
        return original(args=args, callbacks=list(callbacks or []) + lfa_callbacks.build())

    run_exp.__wrapped__ = original
    tuner_module.run_exp = run_exp


def _step_batches(trainer, args) -> None:
    """Token-budget micro-batches (LFA_TOKEN_BUDGET): one batch per optimizer step, accumulation 1; training_step
    cuts it. Before the Trainer is built, so that its data loader, accelerator and schedule see the new numbers.
    Not under DeepSpeed or FSDP, whose engines own accumulation: those train the recipe's fixed micro-batches."""
    budget = contract.env_count(contract.TOKEN_BUDGET)
    if not budget or args is None:
        return
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        os.environ[contract.TOKEN_BUDGET] = "0"  # the data workers, forked later, read it
        print("lfa: token budget ignored under DeepSpeed/FSDP: fixed micro-batches as the recipe says", flush=True)
        return
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    print(
        f"lfa: token-budget micro-batches: each optimizer step's {rows} rows per process in one batch, cut into "
        f"micro-batches of at most {budget} tokens (the recipe's {args.per_device_train_batch_size} x "
        f"{args.gradient_accumulation_steps} is what runs without the plugin)",
        flush=True,
    )
    from lf_adapter.plugin import callbacks as lfa_callbacks

    trainer._lfa_token_budget = budget
    lfa_callbacks.FIXED_MICRO_BATCH["rows"] = args.per_device_train_batch_size
    args.per_device_train_batch_size, args.gradient_accumulation_steps = rows, 1


def checkpoint_first_layers(model, k: int) -> tuple[int, int] | None:
    """Keep gradient checkpointing on the first k decoder layers only (transformers' GradientCheckpointingLayer
    reads its own flag on every call); (k, layers), or None where the model has no such layers checkpointed."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers or not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return None
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < k
    return min(k, len(layers)), len(layers)


def compile_decoder_layers(model, backend: str) -> int:
    """torch.compile every decoder layer in place (dynamic shapes: token-budget micro-batches vary in length); the
    number compiled. The layers share their code, so dynamo's per-code cache is raised above the layer count."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 2 * len(layers) + 8)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 8 * len(layers) + 64)
    for layer in layers:
        layer.compile(dynamic=True, backend="inductor" if backend == "1" else backend)
    return len(layers)


# liger's per-layer kernels (autograd.Functions dynamo cannot trace in torch 2.11, bench/README.md session 27)
LIGER_LAYER_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm")


def _liger_loss_only(monkey_patch_module) -> None:
    """Under LFA_COMPILE_LAYERS liger keeps its fused loss and leaves the decoder layers' norms, MLP activations and
    rotary embedding to the compiled layers: every apply_liger_kernel_to_* LLaMA-Factory calls gets them off."""
    import functools
    import inspect

    for name in dir(monkey_patch_module):
        apply = getattr(monkey_patch_module, name)
        if not name.startswith("apply_liger_kernel_to_") or not callable(apply):
            continue
        off = {k: False for k in LIGER_LAYER_KERNELS if k in inspect.signature(apply).parameters}

        @functools.wraps(apply)
        def loss_only(*args, _apply=apply, _off=off, **kwargs):
            return _apply(*args, **{**kwargs, **_off})

        setattr(monkey_patch_module, name, loss_only)


def _padding_free_usable(model) -> str | None:
    """Why padding-free cannot train exactly and fast here (None: it can). On a CUDA GPU it needs torch's varlen
    flash attention (torch >= 2.10, sm80+); the per-row reference path is for CPUs."""
    from lf_adapter.plugin import padding_free

    if not padding_free.supported():
        return "transformers >= 4.53 (AttentionMaskInterface)"
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:  # neither torch's varlen kernel nor the per-row path drops attention weights
        return f"a model without attention dropout (this one has attention_dropout {dropout:g})"
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda" or (device.type == "cpu" and torch.cuda.is_available()):
        index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
        if not padding_free.fast_kernel_on(index):
            return "torch >= 2.10's varlen flash attention on an sm80+ GPU"
    return None


def _patch_sft_trainer(trainer_module) -> None:
    """Length-sorted steps (LFA_SORTED_STEPS=1), padding-free attention (LFA_PADDING_FREE=1), token-budget
    micro-batches (LFA_TOKEN_BUDGET), recompute of k layers (LFA_CHECKPOINT_LAYERS), master weights
    (LFA_MASTER_WEIGHTS) and per-step token counts for lfa's events."""
    from lf_adapter.plugin import callbacks as lfa_callbacks
    from lf_adapter.plugin import loss_chunks, master_weights
    from lf_adapter.plugin.token_budget import MICRO_BATCHES, split_rows, split_step

    trainer_class = trainer_module.CustomSeq2SeqTrainer
    original_sampler = trainer_class._get_train_sampler
    original_batches = trainer_class.get_batch_samples
    original_step = trainer_class.training_step

    def _get_train_sampler(self, *args, **kwargs):
        dataset = args[0] if args else kwargs.get("train_dataset") or self.train_dataset
        sampler = _sorted_step_sampler(self, dataset)  # a sampler has a length: never tested for truth
        return original_sampler(self, *args, **kwargs) if sampler is None else sampler

    def get_batch_samples(self, *args, **kwargs):
        # the step's tokens are counted on the padded rows, as transformers counts for accumulation
        started = time.perf_counter()
        batch_samples, num_items = original_batches(self, *args, **kwargs)
        budget = getattr(self, "_lfa_token_budget", 0)
        if budget:
            flat = os.environ.get(contract.PADDING_FREE) == "1"
            drop = os.environ.get(contract.DROP_PADDING_MASK) == "1"
            batch_samples = [
                split_step(b, budget, flat, drop) or split_rows(b, lfa_callbacks.FIXED_MICRO_BATCH["rows"])
                for b in batch_samples
            ]
        lfa_callbacks.record_step_batches(batch_samples, time.perf_counter() - started)
        return batch_samples, num_items

    def training_step(self, model, inputs, *args, **kwargs):
        micro_batches = inputs.get(MICRO_BATCHES) if isinstance(inputs, dict) else None
        if micro_batches is None:
            return original_step(self, model, inputs, *args, **kwargs)
        total = None
        for index, micro in enumerate(micro_batches):  # gradients are exchanged after the last micro-batch only
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                loss = original_step(self, model, micro, *args, **kwargs)
            total = loss if total is None else total + loss
        return total

    original_init = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        _step_batches(self, kwargs.get("args"))
        original_init(self, *args, **kwargs)
        _set_up_model(self.model)
        master_weights.set_up(self)
        # a 16-bit lm_head (master weights): liger sums its gradient over the chunks in fp32, as over fp32 weights
        done = loss_chunks.install(fp32_lm_head_gradient=getattr(self, "_lfa_master_weights", None) is not None)
        if done:
            print(f"lfa: liger's fused loss (where liger runs): {done}", flush=True)

    trainer_class.__init__ = __init__
    trainer_class._get_train_sampler = _get_train_sampler
    trainer_class.get_batch_samples = get_batch_samples
    trainer_class.training_step = training_step
    master_weights.patch_trainer(trainer_class)
    if os.environ.get(contract.BENCH_SKIP_FINAL_SAVE) == "1":  # benchmarks only: a 1.3B fp32 save fills small disks
        _skip_final_save(trainer_class)


def _sorted_step_sampler(trainer, dataset):
    """Length-sorted steps (LFA_SORTED_STEPS=1) where the rows' lengths are known, else None (LLaMA-Factory's own
    sampler); records which one runs for the train_begin event. Token-budget steps are one batch per process per
    step, so the sorted block is dealt round-robin to the processes."""
    from lf_adapter.plugin import callbacks as lfa_callbacks
    from lf_adapter.plugin.sampler import SortedStepSampler, row_lengths

    budget = getattr(trainer, "_lfa_token_budget", 0)
    if os.environ.get(contract.SORTED_STEPS) == "1" and not trainer.finetuning_args.disable_shuffling:
        lengths = row_lengths(dataset)
        if lengths is not None:
            a = trainer.args
            world = max(1, a.world_size)
            block = a.per_device_train_batch_size * a.gradient_accumulation_steps * world
            lfa_callbacks.SAMPLER["name"] = f"sorted_steps(block={block})" + (
                f", token_budget({budget})" if budget else ""
            )
            seed = a.data_seed if a.data_seed is not None else a.seed
            return SortedStepSampler(lengths, block, seed=seed, deal=world if budget else 1)
    lfa_callbacks.SAMPLER["name"] = f"token_budget({budget})" if budget else "default"
    return None


def _set_up_model(model) -> None:
    """Liger's fused gate-up SwiGLU where liger chunks a fused one, padding-free attention (LFA_PADDING_FREE=1) and
    recompute of the first k layers (LFA_CHECKPOINT_LAYERS) on the model the trainer holds."""
    from lf_adapter.plugin import fused_mlp, padding_free

    switched = fused_mlp.use_on(model)
    if switched:
        print(f"lfa: {switched} liger Phi-3 MLPs run liger's fused gate-up SwiGLU (no chunk copies)", flush=True)
    if os.environ.get(contract.PADDING_FREE) == "1":  # the collator flattens rows; attention keeps them apart
        why_not = _padding_free_usable(model)
        if why_not is None:
            padding_free.use_on(model)
        else:
            os.environ[contract.PADDING_FREE] = "0"  # the data workers, forked later, read it
            print(f"lfa: padding-free needs {why_not}: training padded", flush=True)
    backend = run_kernels.compile_backend(os.environ)
    if backend:
        compiled = compile_decoder_layers(model, backend)
        print(f"lfa: {compiled} decoder layers under torch.compile ({contract.COMPILE_LAYERS}={backend})", flush=True)
    layers = contract.env_count(contract.CHECKPOINT_LAYERS)
    if layers:
        done = checkpoint_first_layers(model, layers)
        print(
            f"lfa: recompute: the first {done[0]} of {done[1]} decoder layers checkpointed, the rest keep "
            "their activations"
            if done
            else "lfa: recompute of some layers needs transformers' GradientCheckpointingLayer with "
            "checkpointing on: LLaMA-Factory's setting stays",
            flush=True,
        )


def _skip_final_save(trainer_class) -> None:
    original_save = trainer_class.save_model

    def save_model(self, output_dir=None, _internal_call=False):
        if _internal_call:  # a checkpoint: keep
            return original_save(self, output_dir, _internal_call)
        print("lfa bench: final save skipped", flush=True)

    trainer_class.save_model = save_model


def drop_right_padding_mask(batch) -> bool:
    """A right-padded text batch needs no padding mask under causal attention: a real token only attends to
    earlier positions, which are all real, and padded positions carry label -100. Without the mask, SDPA takes
    its causal flash kernel instead of the masked path. The non-pad count is kept for lfa's events."""
    from lf_adapter.plugin.padding_free import right_padding_mask

    mask = right_padding_mask(batch)
    if mask is None:
        return False
    batch["lfa_nonpad_tokens"] = mask.sum()
    batch["attention_mask"] = None
    return True


def _patch_collator(collator_module) -> None:
    from lf_adapter.plugin import padding_free

    collator_class = collator_module.SFTDataCollatorWith4DAttentionMask
    original_call = collator_class.__call__

    def __call__(self, features):
        batch = original_call(self, features)
        if self.block_diag_attn:  # LLaMA-Factory's neat_packing: its own mask
            return batch
        if contract.env_count(contract.TOKEN_BUDGET):  # the trainer cuts each step (eval stays padded)
            return batch
        # both run in the data workers, on the CPU: no GPU sync
        if (
            os.environ.get(contract.PADDING_FREE) == "1"
            and padding_free.supported()
            and padding_free.flatten_batch(batch)
        ):
            return batch
        if os.environ.get(contract.DROP_PADDING_MASK) == "1":
            drop_right_padding_mask(batch)
        return batch

    collator_class.__call__ = __call__


def install() -> None:
    if any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        return
    if os.environ.get(contract.EVENTS_FILE):  # under lfa train: output goes to the run folder's attempt log
        from .streams import tolerate_full_disk

        tolerate_full_disk()
    _AFTER_IMPORT["llamafactory.data.template"] = register_chat_templates
    _AFTER_IMPORT["llamafactory.train.tuner"] = _wrap_run_exp
    _AFTER_IMPORT["llamafactory.train.sft.trainer"] = _patch_sft_trainer
    _AFTER_IMPORT["llamafactory.data.collator"] = _patch_collator
    if run_kernels.compile_backend(os.environ):
        _AFTER_IMPORT["liger_kernel.transformers.monkey_patch"] = _liger_loss_only
    sys.meta_path.insert(0, _AfterImportFinder())
