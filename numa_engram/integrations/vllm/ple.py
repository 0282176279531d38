"""The plugin's Qwen4-Exp part: vLLM 0.31.0's pinned-host PLE tables
(``Qwen4ExpPLEPinnedHostEmbedding``) live in ours instead.

vLLM keeps each PLE layer's ETP row range per rank in pinned memory; the
patch makes ``allocate_embedding_weight`` return a view of one of our
tables (NUMA-placed, huge pages, one copy per DP group sharing an ETP
shard, or attached from the table service), registered with the rank's
GPU so vLLM's own UVA view, lookup kernel, prefetch and all-reduce read it
unchanged.  ``weight_loader`` lets vLLM's loader write the rows only where
this rank writes the table (a private table, a DP group's leader), meets
the group at a barrier once every checkpoint part that covers its rows is
in, and only checks shapes (and the scale) when the table came from the
service.  The same refusals and settings as the Engram part.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import replace
from typing import Any

from ...literals import DEFAULT_DIRECTORY
from ...model.ple import PLESpec
from ...sharing.pletable import SharedPLETable
from ...sharing.request import TableOptions
from . import placement
from .layers import TABLES, directory_spec, refuse_config, refuse_load, serve_metrics
from .patching import sources_problem, symbol
from .settings import PluginError, PluginSettings, settings_of

log = logging.getLogger(__name__)

CHECKED_SOURCES = {
    "qwen4_exp/common/ngram_embedding.py":
        "1392f51ccf0b610542bf05c3021271bf6754221d9616ff92831b94f79fc3a892",
    "qwen4_exp/common/ple.py":
        "585fabb01a14f8071251e52891843cdc1340f75b4d7173abf4748e2ba8746b76",
}
PLE_PATCHED = "_numa_engram_ple_patched"
# vLLM's prefix of a PLE table: the 0-based decoder layer, one less than
# the 1-based ple_layer_ids entry
LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def patch_ple(common: Any, ple: Any = None) -> None:
    """Patch vLLM's ``common/ngram_embedding.py`` (``common``; ``ple``: its
    ``common/ple.py``) in place; idempotent.  A version or source we have
    not checked is recorded and refused when a table is allocated."""
    file = "qwen4_exp/common/ngram_embedding.py"
    pinned = symbol(common, "Qwen4ExpPLEPinnedHostEmbedding", file)
    if getattr(pinned, PLE_PATCHED, False):
        return
    problem = source_problem(common, ple)
    allocate = symbol(pinned, "allocate_embedding_weight", file)
    load = symbol(pinned, "weight_loader", file)

    def allocate_embedding_weight(self: Any, num_embeddings: int, embedding_dim: int,
                                  dtype: Any) -> Any:
        if problem:
            raise PluginError(problem)
        storage = PLEStorage.allocate(common, self, num_embeddings, embedding_dim, dtype)
        self._numa_ple = storage
        return storage.weight

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

    allocate_embedding_weight.__wrapped__ = allocate  # type: ignore[attr-defined]
    weight_loader.__wrapped__ = load  # type: ignore[attr-defined]
    pinned.allocate_embedding_weight = allocate_embedding_weight
    pinned.weight_loader = weight_loader
    setattr(pinned, PLE_PATCHED, True)
    log.info("numa_engram: vLLM's Qwen4-Exp PLE storage patched%s",
             f" (refused when a table is allocated: {problem})" if problem else "")


def source_problem(common: Any, ple: Any) -> str | None:
    """Why these modules are not the ones the patch was checked against, or None."""
    return sources_problem((("qwen4_exp/common/ngram_embedding.py", common),
                            ("qwen4_exp/common/ple.py", ple)), CHECKED_SOURCES)


def layer_of(prefix: str) -> int:
    """The 1-based PLE layer id of vLLM's module prefix."""
    found = LAYER_PREFIX.search(prefix)
    if found is None:
        raise PluginError(f"vLLM's PLE table {prefix!r} names no decoder layer (layers.N.)")
    return int(found.group(1)) + 1


def model_spec(config: Any) -> PLESpec:
    """The model directory's PLE spec, read once per process."""
    from ...runtime.plemodeldir import PLEModelDirectory

    return directory_spec(config, "config.json", lambda path: PLEModelDirectory.open(path).spec)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}[name]


def check_layer(spec: PLESpec, layer_id: int, emb: Any, rows: int, dim: int,
                dtype: Any) -> None:
    """vLLM's table for the layer is the one the model directory describes:
    same rows, width, dtype and ETP row range."""
    if layer_id not in spec.layer_ids:
        raise PluginError(f"vLLM builds a PLE table for layer {layer_id} ({emb.prefix}); the "
                          f"model directory's ple_layer_ids are {list(spec.layer_ids)}")
    start, end = spec.shard_rows(layer_id, emb.tp_rank, emb.tp_size)
    theirs = (emb.num_embeddings_padded, rows, dim, dtype,
              emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index)
    ours = (spec.rows(layer_id), end - start, spec.head_dim, _torch_dtype(spec.dtype),
            start, end)
    if theirs != ours:
        raise PluginError(f"PLE layer {layer_id} ETP rank {emb.tp_rank} of {emb.tp_size}: vLLM "
                          f"allocates (layer rows, shard rows, width, dtype, start, end) "
                          f"{theirs}, the model directory's spec gives {ours}: another "
                          "config.json than the one vLLM loaded")


class PLEStorage:
    """One rank's PLE layer table under vLLM's ``weight`` parameter: the
    table, whether this rank writes it, the group that meets once it is
    loaded, and how many checkpoint parts cover its rows."""

    def __init__(self, table: SharedPLETable, dtype: Any, *, writer: bool, group: Any,
                 filled: bool) -> None:
        import torch

        self.table, self.writer, self.group, self.filled = table, writer, group, filled
        with warnings.catch_warnings():  # a read-only mapping: vLLM never writes it here
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(table.weights)
        self.weight = raw.view(dtype)
        spec, layer = table.spec, table.layer_id
        self.parts_expected = sum(1 for p in range(spec.split_ngram_parts)
                                  if self._covers(*spec.part_rows(layer, p)))
        self.parts_loaded = 0

    def _covers(self, first: int, end: int) -> bool:
        """Whether layer rows ``[first, end)`` overlap this table's."""
        return max(self.table.shard.row_start, first) < min(self.table.shard.row_end, end)

    @classmethod
    def allocate(cls, common: Any, emb: Any, rows: int, dim: int, dtype: Any) -> PLEStorage:
        """Make or attach the table of ``emb``'s layer and ETP shard
        (``common``: vLLM's module, for its DP group), where this engine's
        placement decision says."""
        from vllm.config import get_current_vllm_config  # type: ignore[import-not-found]

        config = get_current_vllm_config()
        refuse_config(config)
        settings = settings_of(config)
        spec = model_spec(config)
        layer = layer_of(emb.prefix)
        check_layer(spec, layer, emb, rows, dim, dtype)
        storage = cls._tables(config, settings, spec, layer, common.get_dp_group(), emb, dtype,
                              shared_asked=_shared_asked(config, emb, common.get_tp_group()))
        table = storage.table
        TABLES.append(table)
        serve_metrics(settings)
        log.info("numa_engram: PLE layer %d rows [%d, %d) of ETP rank %d/%d: %s", layer,
                 table.shard.row_start, table.shard.row_end, emb.tp_rank, emb.tp_size,
                 table.mode)
        return storage

    @classmethod
    def _tables(cls, config: Any, settings: PluginSettings, spec: PLESpec, layer: int, dp: Any,
                emb: Any, dtype: Any, *, shared_asked: bool) -> PLEStorage:
        device = placement.device()
        decision = placement.decide(config, settings, dp, shared_asked=shared_asked,
                                    one_place=False)
        shard_args = dict(etp_rank=emb.tp_rank, etp_size=emb.tp_size)
        options = TableOptions(placement=settings.placement, page_size=settings.page_size,
                               register_device=device, load_threads=settings.load_threads)
        if decision.source == "service":
            refuse_load(config, read_only=True)
            assert decision.service is not None
            table = SharedPLETable.attach(spec, layer, service=decision.service,
                                          register_device=device, page_size=settings.page_size,
                                          service_uids=settings.service_uids or None,
                                          allow_unsealed=settings.allow_unsealed or None,
                                          **shard_args)
            return cls(table, dtype, writer=False, group=None, filled=True)
        if decision.source == "dp_shared":
            group = placement.sharing_group(config, settings, dp, tp_rank=emb.tp_rank,
                                            device=device)
            if group is not None:
                refuse_load(config, read_only=True)
                table = SharedPLETable.create(
                    spec, layer, group=group, mode="dp_shared", **shard_args,
                    options=replace(options, directory=settings.directory or DEFAULT_DIRECTORY))
                return cls(table, dtype, writer=table.leader, group=group, filled=False)
        table = SharedPLETable.create(spec, layer, mode="independent", **shard_args,
                                      options=replace(options, directory=None))
        return cls(table, dtype, writer=True, group=None, filled=False)

    def load_rows(self, write: Any, loaded_weight: Any, checkpoint_start: int | None) -> None:
        """One checkpoint part from vLLM's loader: written by ``write``
        (vLLM's own copy by overlap) where this rank writes the table; the
        group's barrier after the last part that covers its rows."""
        if checkpoint_start is None:
            raise PluginError("vLLM's loader handed the whole PLE table at once; the numa_engram "
                              "plugin takes the split-parts checkpoint (shard_{i}.weight)")
        covers = self._covers(checkpoint_start, checkpoint_start + loaded_weight.shape[0])
        if self.filled:
            if self.parts_loaded >= self.parts_expected and covers:
                raise PluginError("a weight update would write into a PLE table attached "
                                  "read-only from the table service; restart the service with "
                                  "the new checkpoint, or run without numa_engram.service")
            self._check_width(loaded_weight)
        elif self.writer:
            write()
        if not covers:
            return
        self.parts_loaded += 1
        if self.parts_loaded == self.parts_expected and self.group is not None:
            self.group.barrier(f"numa_engram: PLE layer {self.table.layer_id} loaded")

    def load_scale(self, param: Any) -> None:
        """vLLM loaded the per-tensor scale into its parameter: the writer
        keeps it in the table too; a table from the service must hold the
        same (else it is another checkpoint's)."""
        if self.table.scale is None:
            return
        got = float(param.reshape(-1)[0])
        if not self.filled:
            self.table.store_scale(got, write=self.writer)
            return
        if got != self.table.scale and not (got != got and self.table.scale != self.table.scale):
            raise PluginError(f"PLE layer {self.table.layer_id}: the checkpoint's weight_scale "
                              f"{got!r} is not the served table's {self.table.scale!r}; the table "
                              "service holds another checkpoint (restart it on this model)")

    def _check_width(self, loaded_weight: Any) -> None:
        if tuple(loaded_weight.shape[1:]) != tuple(self.weight.shape[1:]):
            raise PluginError(f"the checkpoint's PLE part {list(loaded_weight.shape)} does not "
                              f"have the served table's row width {list(self.weight.shape[1:])}")


def _shared_asked(config: Any, emb: Any, tp: Any) -> bool:
    """vLLM asks its DP replicas to share the tables and each holds one ETP
    shard (ETP is TP: it does not span DP; the constructor sets
    etp_data_parallel_size only after allocating)."""
    engram = config.engram_config
    return bool(getattr(engram, "dp_shared_memory", False)) and emb.tp_size == tp.world_size
