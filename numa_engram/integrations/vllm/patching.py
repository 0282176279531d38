"""What the plugin changes in vLLM 0.31.0's DeepSeek V4.1 Engram code: only
where the bytes live.

``Engram._create_embedding`` builds a subclass of vLLM's NVIDIA
``ParallelEngramEmbedding`` whose ``_allocate_weights`` returns views of
one of our tables (``layers``), and whose ``_shared_memory`` is a
``TableStorage`` with the contract of vLLM's ``DPSharedEngramStorage``.
``can_share_engram_tables`` answers from what the plugin will really use,
alike on every rank.  The VL model's weights mapper drops the Engram
tensors when the tables come from a table service (vLLM's "maps to None:
dropped" rule), so a restart reads none of them.

Refused at model construction, naming what to change (vLLM skips a
plugin that fails to import without a word, so nothing is refused at the
plugin's import): another vLLM version or a patched file whose source we
have not checked, ``use_thp``, ROCm, tables kept on the GPU
(``cpu_offload=False``), and any load that would write into a table the
engine only reads.  A patched module that lacks a symbol the patch
replaces is a PluginError naming it when vLLM imports that module.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .settings import PluginError

log = logging.getLogger(__name__)

VLLM_VERSION = "0.31.0"
# sha256 of the files whose names and behaviour the patch relies on
CHECKED_SOURCES = {
    "nvidia/engram.py": "d7765d509bcfc014efdbcc502b55a95aeec22e3eacd9f3677fab49ae90a9787a",
    "common/engram.py": "0bdd36b2ab4d28a8c30e9e77f1d8e25dffd05e4aff382cb21ba39aca3e84ab91",
    "nvidia/vl_model.py": "627a321c526295547c065778b610b62b16d4cacc9f73572e987b5cfc8949ea80",
}
PATCHED = "_numa_engram_patched"
MODEL_MODULE = "vllm.models.deepseek_v41.nvidia.model"


def engram_tensors(layers: Iterable[int]) -> re.Pattern[str]:
    """V4.1's index names of the Engram tensors of ``layers`` (with or
    without "model."): what the mapper drops for the layers attached."""
    ids = "|".join(str(layer) for layer in sorted(layers))
    return re.compile(rf"^(model\.)?layers\.({ids})\.engram\.embed\.(weight|scale)$")


def symbol(module: Any, name: str, file: str) -> Any:
    """``module.name`` (``name`` may be dotted), or a PluginError naming
    vLLM's file and the symbol it lacks."""
    value = module
    for part in name.split("."):
        value = getattr(value, part, None)
        if value is None:
            version = getattr(sys.modules.get("vllm"), "__version__", None)
            raise PluginError(f"vLLM {version}'s {file} has no {name}, which the numa_engram "
                              f"plugin replaces: this is not the vLLM {VLLM_VERSION} code it "
                              f"was written against; install vllm=={VLLM_VERSION}, or unset "
                              "VLLM_PLUGINS=numa_engram")
    return value


def patch(nv: Any, common: Any, vl: Any = None) -> None:
    """Patch ``nv`` (and ``vl``) in place; idempotent.  A version or source
    we have not checked is recorded and refused at model construction."""
    if vl is not None and not getattr(vl, PATCHED, False):
        patch_vl(vl)
    if getattr(nv, PATCHED, False):
        return
    problem = source_problem(nv, common, vl)
    embedding = _embedding_class(symbol(nv, "ParallelEngramEmbedding", "nvidia/engram.py"))
    original = symbol(nv, "Engram._create_embedding", "nvidia/engram.py")

    def _create_embedding(self: Any, layout: Any,  # noqa: ARG001 (a method of vLLM's)
                          layer_hash_index: int) -> Any:
        from .layers import build_embedding

        if problem:
            raise PluginError(problem)
        return build_embedding(nv, common, embedding, layout, layer_hash_index)

    _create_embedding.__wrapped__ = original  # type: ignore[attr-defined]
    nv.Engram._create_embedding = _create_embedding
    shareable = _can_share(nv, problem)
    nv.can_share_engram_tables = shareable
    model: Any = sys.modules.get(MODEL_MODULE)
    if model is not None and hasattr(model, "can_share_engram_tables"):
        model.can_share_engram_tables = shareable  # bound by name at its import
    setattr(nv, PATCHED, True)
    log.info("numa_engram: vLLM's Engram storage patched%s",
             f" (refused at model construction: {problem})" if problem else "")


def source_problem(nv: Any, common: Any, vl: Any) -> str | None:
    """Why these modules are not the ones the patch was checked against, or None."""
    return sources_problem((("nvidia/engram.py", nv), ("common/engram.py", common),
                            ("nvidia/vl_model.py", vl)), CHECKED_SOURCES)


def sources_problem(modules: Iterable[tuple[str, Any]], checked: dict[str, str]) -> str | None:
    """Why vLLM's version or one of ``modules`` (name, module or None: not
    loaded) is not what the patch was checked against (``checked``: sha256
    by name), or None."""
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if version != VLLM_VERSION:
        return (f"the numa_engram vLLM plugin supports vLLM {VLLM_VERSION}, this is "
                f"{version}: install vllm=={VLLM_VERSION}, or unset VLLM_PLUGINS=numa_engram")
    for name, module in modules:
        if module is None:
            continue
        digest = hashlib.sha256(Path(module.__file__ or "").read_bytes()).hexdigest()
        if digest != checked[name]:
            return (f"vLLM's {name} ({module.__file__}) is not the 0.31.0 file the numa_engram "
                    f"plugin was checked against (sha256 {digest[:16]}...): reinstall "
                    f"vllm=={VLLM_VERSION} unpatched, or unset VLLM_PLUGINS=numa_engram")
    return None


def _embedding_class(base: type) -> type:
    """vLLM's NVIDIA ``ParallelEngramEmbedding`` (``base``) with its weights
    in a table."""

    class NumaEngramEmbedding(base):
        """Weights and scales are views of ``numa_table``; ``_shared_memory``
        serves vLLM's kernel its views and loads the checkpoint into it."""

        def __init__(self, *args: Any, numa_layer: Any, **kwargs: Any) -> None:
            # (before the base constructor: it calls _allocate_weights)
            self._numa_layer = numa_layer
            self.numa_table = None
            super().__init__(*args, **kwargs)

        def _allocate_weights(self) -> tuple[Any, Any]:
            storage = self._numa_layer.allocate(self)
            self.numa_table = storage.table
            self._shared_memory = storage
            self._weight_loader = storage.load_weight  # read by the base constructor
            return storage.weight, storage.scales

    return NumaEngramEmbedding


def _can_share(nv: Any, problem: str | None) -> Any:
    def can_share_engram_tables(layout: Any, block_size: int = 32) -> bool:
        """Whether the EDP peers can share our tables (not whether /dev/shm
        is big: memfd and hugetlbfs tables do not live there), decided
        alike on every rank."""
        from .layers import can_share

        if problem:
            raise PluginError(problem)
        return can_share(nv, layout, block_size)

    return can_share_engram_tables


def patch_vl(vl: Any) -> None:
    """The VL model's weights mapper drops the Engram tensors of the layers
    the engine being constructed attached from a table service (the
    mapper is made after the language model, so they are known)."""
    make = symbol(vl, "_make_deepseek_v4_vl_weights_mapper", "nvidia/vl_model.py")

    def mapper(*args: Any, **kwargs: Any) -> Any:
        from .placement import current_attached

        base = make(*args, **kwargs)
        attached = current_attached()
        if not attached:
            return base
        return type(base)(orig_to_new_regex={engram_tensors(attached): None}) | base

    mapper.__wrapped__ = make  # type: ignore[attr-defined]
    vl._make_deepseek_v4_vl_weights_mapper = mapper
    setattr(vl, PATCHED, True)
