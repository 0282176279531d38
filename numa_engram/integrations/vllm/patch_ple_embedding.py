"""Patches of Qwen4-Exp's PLE modules (0.31-0.34): ``common/ngram_embedding.py``
(with ``common/ple.py``, whose ``weight_loader`` it inherits) and
``nvidia/ngram_embedding.py``.

Replaces: ``Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight``,
``.weight_loader`` and ``._lookup`` (tier mapped: the rows gathered
through the plugin's staging, ``ple.MappedPLEStorage``; else vLLM's
own); wraps ``Qwen4ExpNGramEmbedding.__init__`` and the PLE embedding
quant methods' ``process_weights_after_loading`` (the end of
vLLM's load for each PLE table: one not loaded nor attached is refused
there).

Why: vLLM keeps each PLE layer's ETP row range per rank in pinned memory
(one private copy per DP replica, placed by first touch); the plugin's
tables are NUMA-placed, on huge pages, one copy per DP group sharing an
ETP shard, or attached from the table service.

How: ``allocate_embedding_weight`` returns a view of one of our tables
(``ple.PLEStorage``), registered with the rank's GPU so vLLM's own UVA
view, lookup kernel, prefetch and all-reduce read it unchanged;
``weight_loader`` lets vLLM's loader write only where this rank writes
the table and only checks a served table.  ``Qwen4ExpNGramEmbedding``'s
constructor is where the plugin sees the model built: branches that are
not pinned host memory (``cpu_offload=False``: device memory; 0.34's
``disk_offload``: rows read from the checkpoint files) pass through with
one INFO line, and where the plugin's settings were given an unpatched
PLE module (its hook never fired, or not the checked file) is a
PluginError.

Tier mapped on 0.34 with ``disk_offload``: ``Qwen4ExpNGramEmbedding``'s
constructor gives vLLM's ``Qwen4ExpPLEDiskOffloadEmbedding`` a mapped
table (``ple.MappedStagedPLE``) and its ``stage_rows`` (vLLM's pre-forward
staging) reads the rows from it instead of a ``preadv`` per row.

Mirrors: vLLM's ``Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight``
(``torch.empty(n, d, dtype, pin_memory=True)``, identical in 0.31-0.34) and
``PLEVocabParallelEmbedding.weight_loader``.

Removable: when vLLM lets a plugin provide a PLE table's host storage.
"""

from __future__ import annotations

import logging
from typing import Any

from . import manifest
from .patches import FIRED, fired, say_once, settings_given
from .settings import PluginError

log = logging.getLogger("vllm." + __name__)

PATCHED = "_numa_engram_ple_patched"


def patch(common: Any, ple: Any = None) -> None:
    """Patch vLLM's ``common/ngram_embedding.py`` (``common``; ``ple``: its
    ``common/ple.py``) in place; idempotent."""
    if getattr(common, PATCHED, False):
        return
    setattr(common, PATCHED, True)
    problem = manifest.module_problem(common, manifest.PLE_COMMON) or (
        manifest.module_problem(ple, manifest.PLE_HELPERS) if ple is not None else None)
    FIRED[common.__name__] = problem
    if problem:
        log.warning("numa_engram: %s", problem)
    if manifest.missing_symbols(common, manifest.PLE_COMMON):
        return  # nothing to wrap: Qwen4ExpNGramEmbedding's construction raises
    pinned = common.Qwen4ExpPLEPinnedHostEmbedding
    allocate, load = pinned.allocate_embedding_weight, pinned.weight_loader
    lookup = pinned._lookup

    def allocate_embedding_weight(self: Any, num_embeddings: int, embedding_dim: int,
                                  dtype: Any) -> Any:
        from .ple import PLEStorage

        if problem:
            if settings_given(_config()):
                raise PluginError(problem)
            return allocate(self, num_embeddings, embedding_dim, dtype)
        storage = PLEStorage.allocate(common, self, num_embeddings, embedding_dim, dtype)
        self._numa_ple = storage
        return storage.parameter()

    def weight_loader(self: Any, param: Any, loaded_weight: Any,
                      checkpoint_start: int | None = None) -> None:
        storage = getattr(self, "_numa_ple", None)
        if storage is None:
            load(self, param, loaded_weight, checkpoint_start)
        elif param is self.weight:
            storage.load_rows(lambda: load(self, param, loaded_weight, checkpoint_start),
                              loaded_weight, checkpoint_start)
        else:  # the per-tensor scale: vLLM's own parameter
            load(self, param, loaded_weight, checkpoint_start)
            storage.load_scale(param)

    def _lookup(self: Any, input_ids: Any, output: Any = None) -> Any:
        # tier mapped: the rows gathered through the plugin's staging
        # (ple.MappedPLEStorage), never read by the device in place
        gather = getattr(getattr(self, "_numa_ple", None), "gather", None)
        if gather is None:
            return lookup(self, input_ids, output)
        if output is None:
            import torch

            output = torch.empty((*input_ids.shape, self.embedding_dim),
                                 dtype=self.weight.dtype, device=input_ids.device)
        return gather(input_ids, output)

    allocate_embedding_weight.__wrapped__ = allocate  # type: ignore[attr-defined]
    weight_loader.__wrapped__ = load  # type: ignore[attr-defined]
    _lookup.__wrapped__ = lookup  # type: ignore[attr-defined]
    pinned.allocate_embedding_weight = allocate_embedding_weight
    pinned.weight_loader = weight_loader
    pinned._lookup = _lookup
    for method in _embedding_methods(common):
        _check_after_loading(method)
    log.info("numa_engram: vLLM %s's Qwen4-Exp PLE storage patched%s",
             manifest.vllm_version(),
             f"; refused at model construction: {problem}" if problem else "")


def _embedding_methods(common: Any) -> list[type]:
    """vLLM's PLE embedding quant methods (``Qwen4ExpPLEEmbeddingMethod``
    and the release's subclasses: unquantized, FP8, 0.33+'s NVFP4)."""
    base = getattr(common, "Qwen4ExpPLEEmbeddingMethod", None)
    if not isinstance(base, type):
        return []
    return [value for value in vars(common).values()
            if isinstance(value, type) and issubclass(value, base)]


def _check_after_loading(method: type) -> None:
    """Wrap ``method.process_weights_after_loading(layer)``, vLLM's end of
    the load for each PLE embedding (its loader's per-layer pass over quant
    methods, in every release): a table of ours that was neither loaded
    nor attached is a PluginError there, never zeros at the first forward.
    On the base class (whose subclasses without their own inherit it), and
    on each subclass that overrides it."""
    if "process_weights_after_loading" not in vars(method) and \
            method.__name__ != "Qwen4ExpPLEEmbeddingMethod":
        return
    original = getattr(method, "process_weights_after_loading", None)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        storage = getattr(layer, "_numa_ple", None)
        problem = storage.unready() if storage is not None else None
        if problem:
            raise PluginError(problem)
        if original is not None:
            original(self, layer)

    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    method.process_weights_after_loading = process_weights_after_loading  # type: ignore


def patch_model(model: Any) -> None:
    """Wrap ``Qwen4ExpNGramEmbedding.__init__`` of vLLM's
    ``nvidia/ngram_embedding.py`` (``model``); idempotent."""
    if getattr(model, PATCHED, False):
        return
    setattr(model, PATCHED, True)
    FIRED[model.__name__] = manifest.module_problem(model, manifest.PLE_MODEL)
    if manifest.missing_symbols(model, manifest.PLE_MODEL):
        log.warning("numa_engram: %s", FIRED[model.__name__])
        return
    klass = model.Qwen4ExpNGramEmbedding
    original = klass.__init__
    disk = getattr(model, "Qwen4ExpPLEDiskOffloadEmbedding", None)  # 0.34+

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = _config()
        check_construction(config)
        original(self, *args, **kwargs)
        if disk is not None and isinstance(self.ngram_embedding, disk) and \
                settings_given(config):
            from .ple import MappedStagedPLE

            MappedStagedPLE.attach(config, self.ngram_embedding)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    klass.__init__ = __init__
    if disk is not None and callable(getattr(disk, "stage_rows", None)):
        _stage_mapped(disk)


def _stage_mapped(disk: type) -> None:
    """Wrap 0.34's ``Qwen4ExpPLEDiskOffloadEmbedding.stage_rows``: an
    embedding given a mapped table (``ple.MappedStagedPLE``) reads its rows
    from it, vLLM's own otherwise."""
    stage = disk.stage_rows  # type: ignore[attr-defined]

    def stage_rows(self: Any, num_tokens: int) -> None:
        storage = getattr(self, "_numa_ple", None)
        if storage is None:
            return stage(self, num_tokens)
        return storage.stage(self, num_tokens)

    stage_rows.__wrapped__ = stage  # type: ignore[attr-defined]
    disk.stage_rows = stage_rows  # type: ignore[attr-defined]


def check_construction(config: Any) -> None:
    """At a PLE layer's construction: the branches passed through say so,
    once per engine; where the plugin's settings were given, the PLE
    module was patched as checked."""
    engram = getattr(config, "engram_config", None)
    rel = manifest.release()
    if engram is not None and getattr(engram, "disk_offload", False) and \
            rel is not None and rel.ple_disk_offload:
        if not _tier_mapped(config):
            say_once(config, "disk", "numa_engram: engram_config.disk_offload keeps the "
                     "Qwen4-Exp PLE tables in the checkpoint files, read per step: vLLM's own, "
                     "untouched by the plugin")
        return
    if engram is None or not engram.cpu_offload:
        say_once(config, "ple-gpu", "numa_engram: engram_config.cpu_offload is off: the "
                 "Qwen4-Exp PLE tables stay in GPU memory, vLLM's own, untouched by the plugin")
        return
    if not settings_given(config):
        return
    ran, problem = fired(manifest.PLE_COMMON)
    if not ran:
        raise PluginError(f"the numa_engram plugin's hook for vLLM {manifest.vllm_version()}'s "
                          f"{manifest.PLE_COMMON} never fired: the PLE tables would be vLLM's "
                          f"own, not the plugin's; {manifest.INSTALL}")
    if problem or FIRED.get(manifest.PLE_MODEL):
        raise PluginError(problem or str(FIRED[manifest.PLE_MODEL]))


def _tier_mapped(config: Any) -> bool:
    """Whether the plugin's settings ask for tier mapped."""
    from .settings import settings_of

    return settings_given(config) and settings_of(config).tier == "mapped"


def _config() -> Any:
    import importlib

    return importlib.import_module("vllm.config").get_current_vllm_config()
