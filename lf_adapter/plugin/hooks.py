"""Import hooks run inside LLaMA-Factory's processes (see lf_adapter/plugin/__init__.py for why)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

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
    from lf_adapter import templates_dir

    extra = [Path(p) for p in os.environ.get("LFA_CHAT_TEMPLATE_DIRS", "").split(os.pathsep) if p]
    return extra + [templates_dir() / "chat"]


def register_chat_templates(template_module) -> list[str]:
    """Register every lfa chat template (templates/chat/*.yaml) that LLaMA-Factory does not already have."""
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


def _wrap_run_exp(tuner_module) -> None:
    original = tuner_module.run_exp

    def run_exp(args=None, callbacks=None):
        from lf_adapter.plugin import callbacks as lfa_callbacks

        lfa_callbacks.apply_memory_emulation()
        return original(args=args, callbacks=list(callbacks or []) + lfa_callbacks.build())

    run_exp.__wrapped__ = original
    tuner_module.run_exp = run_exp


def install() -> None:
    if any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        return
    _AFTER_IMPORT["llamafactory.data.template"] = register_chat_templates
    _AFTER_IMPORT["llamafactory.train.tuner"] = _wrap_run_exp
    sys.meta_path.insert(0, _AfterImportFinder())
