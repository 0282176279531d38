"""The import hook ``register()`` installs: each module the manifest names
is patched right after it runs (the release's Engram module before
``nvidia/model.py`` binds ``can_share_engram_tables`` by name; the VL
model, for its weights mapper; Qwen4-Exp's PLE modules before any model
constructs a PLE table).  At register, a vLLM the manifest does not list
(its release, or a patched file's sha256) is one WARNING naming it and
what to install."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any

from . import manifest

log = logging.getLogger("vllm." + __name__)

WARNED = "_numa_engram_warned"


def watched() -> tuple[str, ...]:
    """The modules the hook patches (both Engram candidates on a release
    the manifest lacks: whichever it has is patched, and refused)."""
    rel = manifest.release()
    engram = (rel.engram_module,) if rel else (manifest.ENGRAM_NV, manifest.ENGRAM_COMMON)
    return (*engram, manifest.VL, manifest.PLE_COMMON, manifest.PLE_MODEL)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None  # noqa: ARG002 (the finder protocol)
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in watched():
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
    """Patch whichever of vLLM's watched modules are loaded (idempotent)."""
    from . import patch_engram, patch_ple_embedding, patch_vl_model

    loaded = {name: sys.modules[name] for name in watched() if name in sys.modules}
    common = sys.modules.get(manifest.ENGRAM_COMMON)
    for name in (manifest.ENGRAM_NV, manifest.ENGRAM_COMMON):
        if name in loaded and common is not None:
            patch_engram.patch(loaded[name], common)
    if manifest.VL in loaded:
        patch_vl_model.patch(loaded[manifest.VL])
    if manifest.PLE_COMMON in loaded:
        helpers = sys.modules.get(manifest.PLE_HELPERS)
        patch_ple_embedding.patch(loaded[manifest.PLE_COMMON], helpers)
    if manifest.PLE_MODEL in loaded:
        patch_ple_embedding.patch_model(loaded[manifest.PLE_MODEL])


def warn_unlisted() -> None:
    """One WARNING per problem, once per process: the running vLLM's
    release or an installed patched file the manifest does not list."""
    vllm = sys.modules.get("vllm")
    if vllm is None or getattr(vllm, WARNED, False):
        return
    setattr(vllm, WARNED, True)
    roots = list(getattr(vllm, "__path__", []) or [])
    for problem in manifest.installed_problems(roots[0] if roots else ""):
        log.warning("numa_engram: %s", problem)


def install() -> None:
    warn_unlisted()
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    patch_loaded()
