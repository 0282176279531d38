"""numa_engram as a vLLM general plugin, for the releases in ``manifest.py``
(0.31.0-0.34.0): vLLM keeps its own hashing, lookup kernels and prefetch;
the plugin replaces only where DeepSeek V4.1's Engram bytes and
Qwen4-Exp's PLE bytes live (our tables: NUMA-placed, huge pages, one copy
per node or socket, warm restarts from the table service).

vLLM calls ``register()`` (the ``vllm.general_plugins`` entry point) in
every process; it warns once about a vLLM the manifest does not list and
installs an import hook, so each patch (``patch_engram``,
``patch_vl_model``, ``patch_ple_embedding``) is in place before any worker
constructs the model.  ``patch(nv, common, vl)`` and ``patch_ple(common,
ple, model)`` take the modules themselves (tests load the wheel's under
stubs).  Every log line goes to a child of vLLM's ``vllm`` logger.
Nothing here imports torch or vLLM at import time.
"""

from __future__ import annotations

from types import ModuleType


def register() -> None:
    """Warn about an unlisted vLLM and install the patches (idempotent,
    cheap): now for vLLM's modules already loaded, else when imported."""
    from .hook import install

    install()


def patch_ple(common: ModuleType, ple: ModuleType | None = None,
              model: ModuleType | None = None) -> None:
    """Patch vLLM's Qwen4-Exp ``common/ngram_embedding.py`` (``common``),
    with its ``common/ple.py`` (``ple``), and ``nvidia/ngram_embedding.py``
    (``model``): PLE tables in ours."""
    from . import patch_ple_embedding as patches

    patches.patch(common, ple)
    if model is not None:
        patches.patch_model(model)


def patch(nv: ModuleType, common: ModuleType, vl: ModuleType | None = None) -> None:
    """Patch vLLM's Engram module (``nv``: 0.31's ``nvidia/engram.py``, from
    0.32 on ``common/engram.py`` itself), with its ``common/engram.py``
    (``common``) and ``nvidia/vl_model.py`` (``vl``)."""
    from . import patch_engram, patch_vl_model

    if vl is not None:
        patch_vl_model.patch(vl)
    patch_engram.patch(nv, common)


__all__ = ["patch", "patch_ple", "register"]
