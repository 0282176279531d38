"""Patch of V4.1's NVIDIA Engram module (0.31: ``nvidia/engram.py``; 0.32+:
``common/engram.py``, the release's ``engram_module`` in the manifest).

Replaces: ``Engram._create_embedding``, ``can_share_engram_tables`` (and
``nvidia/model.py``'s name for it, bound at its import).

Why: vLLM keeps each Engram table in pinned or /dev/shm memory placed by
first touch; the plugin's tables are NUMA-placed, on huge pages, one copy
per node or socket, and kept across restarts by the table service.

How: ``_create_embedding`` builds a subclass of vLLM's
``ParallelEngramEmbedding`` whose ``_allocate_weights`` returns views of one
of our tables and whose ``_shared_memory`` is a ``layers.TableStorage``
(the contract of vLLM's ``DPSharedEngramStorage``: ``get_views``,
``load_weight``, and what the release reads besides, ``huge_pages`` on
0.34), so vLLM's lookup kernel, prefetch and loader run unchanged.
``can_share_engram_tables`` answers from the plugin's placement decision,
alike on every EDP rank (a service's tables or one shared copy: True).
Tables kept in GPU memory (``cpu_offload=False``, 0.33's peer rows) pass
through to vLLM's own ``_create_embedding`` with one INFO line.  With tier
mapped the subclass's ``lookup`` gathers through the storage's staging
(``layers.MappedTableStorage``; ``mapped.py``).

Mirrors: vLLM's ``Engram._create_embedding`` (the same constructor call,
identical in 0.31-0.34) and its ``DPSharedEngramStorage``.

Removable: when vLLM lets a plugin provide an Engram embedding's storage
(a storage hook or registry), which no release up to 0.34 has.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import manifest
from .patches import FIRED, settings_given
from .settings import PluginError

log = logging.getLogger("vllm." + __name__)

PATCHED = "_numa_engram_patched"


def patch(nv: Any, common: Any) -> None:
    """Patch ``nv`` (the release's Engram module; ``common``: its
    ``common/engram.py``, the same module from 0.32 on) in place;
    idempotent.  What is not as checked (an unknown release, a file of
    another sha256, a missing symbol) is recorded, logged, and at model
    construction an error where the plugin's settings were given."""
    if getattr(nv, PATCHED, False):
        return
    problem = manifest.module_problem(nv, "engram") or (
        manifest.module_problem(common, manifest.ENGRAM_COMMON) if common is not nv else None)
    FIRED[nv.__name__] = problem
    setattr(nv, PATCHED, True)
    if problem:
        log.warning("numa_engram: %s", problem)
    if manifest.missing_symbols(nv, "engram"):
        return  # nothing to wrap: the VL model's construction raises (patch_vl_model)
    _wrap_create_embedding(nv, common, problem)
    shareable = _can_share(nv, nv.can_share_engram_tables, problem)
    nv.can_share_engram_tables = shareable
    model: Any = sys.modules.get(manifest.MODEL)
    if model is not None and hasattr(model, "can_share_engram_tables"):
        model.can_share_engram_tables = shareable  # bound by name at its import
    log.info("numa_engram: vLLM %s's Engram storage patched (%s)%s", manifest.vllm_version(),
             nv.__name__, f"; refused at model construction: {problem}" if problem else "")


def _wrap_create_embedding(nv: Any, common: Any, problem: str | None) -> None:
    embedding = _embedding_class(nv.ParallelEngramEmbedding)
    original = nv.Engram._create_embedding

    def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
        from .layers import build_embedding
        from .patches import say_once

        config = nv.get_current_vllm_config()
        if problem:
            if settings_given(config):
                raise PluginError(problem)
            return original(self, layout, layer_hash_index)
        engram = config.engram_config
        if engram is not None and not engram.cpu_offload:
            say_once(config, "gpu", "numa_engram: engram_config.cpu_offload=False keeps the "
                     "Engram tables in GPU memory (HBM, or 0.33+'s GPU peer rows): vLLM's own "
                     "storage, untouched by the plugin")
            return original(self, layout, layer_hash_index)
        return build_embedding(nv, common, embedding, layout, layer_hash_index)

    _create_embedding.__wrapped__ = original  # type: ignore[attr-defined]
    nv.Engram._create_embedding = _create_embedding


def _embedding_class(base: type) -> type:
    """vLLM's ``ParallelEngramEmbedding`` (``base``) with its weights in a table."""

    class NumaEngramEmbedding(base):
        """Weights and scales are views of ``numa_table``; ``_shared_memory``
        serves vLLM's kernel its views and loads the checkpoint into it."""

        def __init__(self, *args: Any, numa_layer: Any, **kwargs: Any) -> None:
            # (before the base constructor: it calls _allocate_weights)
            self._numa_layer = numa_layer
            self.numa_table = None
            super().__init__(*args, **kwargs)

        def _allocate_weights(self) -> tuple[Any, Any]:
            rel = manifest.release()
            if rel is not None and rel.meta_branch and _meta_device():
                return super()._allocate_weights()  # vLLM's meta tensors: nothing to place
            storage = self._numa_layer.allocate(self)
            self.numa_table = storage.table
            self._shared_memory = storage
            self._weight_loader = storage.load_weight  # read by the base constructor
            return storage.weight, storage.scales

        def lookup(self, indices: Any, out: Any, background: bool = False) -> None:
            # tier mapped: the rows gathered through the plugin's staging
            # (layers.MappedTableStorage), never read by the device in place
            rows = getattr(self._shared_memory, "gather", None)
            if rows is None:
                return super().lookup(indices, out, background)
            return rows(indices, out)

    return NumaEngramEmbedding


def _meta_device() -> bool:
    import torch

    return torch.get_default_device().type == "meta"


def _can_share(nv: Any, original: Any, problem: str | None) -> Any:
    def can_share_engram_tables(layout: Any, block_size: int = 32) -> bool:
        """Whether the EDP peers hold one copy of our tables (a table
        service's, or one shared per host), decided alike on every rank."""
        from .layers import can_share

        config = nv.get_current_vllm_config()
        if problem:
            if settings_given(config):
                raise PluginError(problem)
            return bool(original(layout, block_size))
        if config.engram_config is not None and not config.engram_config.cpu_offload:
            return bool(original(layout, block_size))
        return can_share(nv, layout, block_size)

    can_share_engram_tables.__wrapped__ = original  # type: ignore[attr-defined]
    return can_share_engram_tables
