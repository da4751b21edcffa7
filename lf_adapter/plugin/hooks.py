"""Import hooks run inside LLaMA-Factory's processes (see lf_adapter/plugin/__init__.py for why)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

from . import contract

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


def _patch_sft_trainer(trainer_module) -> None:
    """Length-sorted steps (LFA_SORTED_STEPS=1), padding-free attention (LFA_PADDING_FREE=1) and per-step token
    counts for lfa's events."""
    from lf_adapter.plugin import callbacks as lfa_callbacks
    from lf_adapter.plugin import padding_free
    from lf_adapter.plugin.sampler import SortedStepSampler, row_lengths

    trainer_class = trainer_module.CustomSeq2SeqTrainer
    original_sampler = trainer_class._get_train_sampler
    original_batches = trainer_class.get_batch_samples

    def _get_train_sampler(self, *args, **kwargs):
        if os.environ.get(contract.SORTED_STEPS) == "1" and not self.finetuning_args.disable_shuffling:
            dataset = args[0] if args else kwargs.get("train_dataset") or self.train_dataset
            lengths = row_lengths(dataset)
            if lengths is not None:
                a = self.args
                block = a.per_device_train_batch_size * a.gradient_accumulation_steps * max(1, a.world_size)
                lfa_callbacks.SAMPLER["name"] = f"sorted_steps(block={block})"
                return SortedStepSampler(lengths, block, seed=a.data_seed if a.data_seed is not None else a.seed)
        lfa_callbacks.SAMPLER["name"] = "default"
        return original_sampler(self, *args, **kwargs)

    def get_batch_samples(self, *args, **kwargs):
        batch_samples, num_items = original_batches(self, *args, **kwargs)
        lfa_callbacks.record_step_batches(batch_samples)
        return batch_samples, num_items

    original_init = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if os.environ.get(contract.PADDING_FREE) == "1":  # the collator flattens rows; attention keeps them apart
            if padding_free.supported():
                padding_free.use_on(self.model)
            else:
                print(
                    "lfa: padding-free needs transformers >= 4.53 (AttentionMaskInterface): training padded", flush=True
                )

    trainer_class.__init__ = __init__
    trainer_class._get_train_sampler = _get_train_sampler
    trainer_class.get_batch_samples = get_batch_samples
    if os.environ.get(contract.BENCH_SKIP_FINAL_SAVE) == "1":  # benchmarks only: a 1.3B fp32 save fills small disks
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
    sys.meta_path.insert(0, _AfterImportFinder())
