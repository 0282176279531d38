"""The import hook ``register()`` installs: when vLLM imports its NVIDIA
Engram module, the module is patched right after it runs, before
``nvidia/model.py`` binds ``can_share_engram_tables`` by name; its VL model
module likewise, for the weights mapper; and Qwen4-Exp's common n-gram
embedding module, before any model constructs a PLE table."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

NV = "vllm.models.deepseek_v41.nvidia.engram"
COMMON = "vllm.models.deepseek_v41.common.engram"
VL = "vllm.models.deepseek_v41.nvidia.vl_model"
PLE_COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
PLE_HELPERS = "vllm.models.qwen4_exp.common.ple"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None  # noqa: ARG002 (the finder protocol)
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (NV, VL, PLE_COMMON):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, fullname: str) -> None:
        self.inner, self.fullname = inner, fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch_loaded()


def patch_loaded() -> None:
    """Patch whichever of vLLM's modules are loaded (idempotent)."""
    nv, common = sys.modules.get(NV), sys.modules.get(COMMON)
    if nv is not None and common is not None:
        from .patching import patch

        patch(nv, common, sys.modules.get(VL))
    ple_common = sys.modules.get(PLE_COMMON)
    if ple_common is not None:
        from .ple import patch_ple

        patch_ple(ple_common, sys.modules.get(PLE_HELPERS))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    patch_loaded()
