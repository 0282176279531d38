"""numa_engram as a vLLM 0.31.0 general plugin: vLLM keeps its own hashing,
lookup kernel and prefetch; the plugin replaces only where DeepSeek V4.1's
Engram bytes and Qwen4-Exp's PLE bytes live (our tables: NUMA-placed, huge
pages, one copy per node or socket, warm restarts from the table service).

vLLM calls ``register()`` (the ``vllm.general_plugins`` entry point) in
every process; it only installs an import hook, so the patch is in place
before any worker constructs the model.  ``patch(nv, common, vl)`` takes
the modules themselves (tests load the wheel's under stubs).  Neither
imports torch or vLLM at this module's import time.
"""

from __future__ import annotations

from types import ModuleType


def register() -> None:
    """Install the patch (idempotent, cheap): now if vLLM's Engram module is
    loaded already, else when it is imported."""
    from .hook import install

    install()


def patch_ple(common: ModuleType, ple: ModuleType | None = None) -> None:
    """Patch vLLM's Qwen4-Exp ``common/ngram_embedding.py`` (``common``),
    with its ``common/ple.py`` (``ple``): PLE tables in ours."""
    from .ple import patch_ple as patch_module

    patch_module(common, ple)


def patch(nv: ModuleType, common: ModuleType, vl: ModuleType | None = None) -> None:
    """Patch vLLM's ``nvidia/engram.py`` (``nv``), with its
    ``common/engram.py`` (``common``) and ``nvidia/vl_model.py`` (``vl``)."""
    from .patching import patch as patch_modules

    patch_modules(nv, common, vl)


__all__ = ["patch", "patch_ple", "register"]
