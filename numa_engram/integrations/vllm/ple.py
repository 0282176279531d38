"""One Qwen4-Exp PLE layer's table under vLLM's pinned-host embedding
(patch_ple_embedding.py puts it there): made or attached where the engine's
placement decision says, written by vLLM's loader only where this rank
writes it (a private table, a DP group's leader), the group meeting at a
barrier once every checkpoint part that covers its rows is in; a table
from the service only checked (shapes and the scale).  The same refusals
and settings as the Engram part."""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import replace
from typing import Any

from ...literals import DEFAULT_DIRECTORY
from ...model.families import PLE
from ...model.ple import PLESpec
from ...tables.pletable import SharedPLETable
from ...tables.request import TableOptions
from . import mapped, placement
from .layers import TABLES, config_spec, refuse_config, refuse_load, serve_metrics
from .settings import PluginError, PluginSettings, settings_of

log = logging.getLogger("vllm." + __name__)

# vLLM's prefix of a PLE table: the 0-based decoder layer, one less than
# the 1-based ple_layer_ids entry
LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(prefix: str) -> int:
    """The 1-based PLE layer id of vLLM's module prefix."""
    found = LAYER_PREFIX.search(prefix)
    if found is None:
        raise PluginError(f"vLLM's PLE table {prefix!r} names no decoder layer (layers.N.)")
    return int(found.group(1)) + 1


def model_spec(config: Any) -> PLESpec:
    """The PLE tables' spec from vLLM's parsed config (``hf_config``, its
    ``text_config`` where it has one), once per engine."""
    return config_spec(config, PLE)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}[name]


def check_layer(spec: PLESpec, layer_id: int, emb: Any, rows: int, dim: int,
                dtype: Any) -> None:
    """vLLM's table for the layer is the one the model directory describes:
    same rows, width, dtype and ETP row range."""
    if layer_id not in spec.layer_ids:
        raise PluginError(f"vLLM builds a PLE table for layer {layer_id} ({emb.prefix}); the "
                          f"hf_config's ple_layer_ids are {list(spec.layer_ids)}")
    start, end = spec.shard_rows(layer_id, emb.tp_rank, emb.tp_size)
    theirs = (emb.num_embeddings_padded, rows, dim, dtype,
              emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index)
    ours = (spec.rows(layer_id), end - start, spec.head_dim, _torch_dtype(spec.dtype),
            start, end)
    if theirs != ours:
        raise PluginError(f"PLE layer {layer_id} ETP rank {emb.tp_rank} of {emb.tp_size}: vLLM "
                          f"allocates (layer rows, shard rows, width, dtype, start, end) "
                          f"{theirs}, its hf_config's spec gives {ours}: the config's PLE "
                          "fields disagree with the layout vLLM built")


class PLEStorage:
    """One rank's PLE layer table under vLLM's ``weight`` parameter: the
    table, whether this rank writes it, the group that meets once it is
    loaded, and how many checkpoint parts cover its rows."""

    def __init__(self, table: SharedPLETable, dtype: Any, *, writer: bool, group: Any,
                 filled: bool) -> None:
        import torch

        self.table, self.writer, self.group, self.filled = table, writer, group, filled
        # torch has no read-only tensor: a mapping this rank may not write
        # (attached, a DP-shared peer's) is refused by load_rows before any
        # write reaches it
        self.read_only = not table.weights.flags.writeable
        self.dummy_load = False  # vLLM's dummy loader writes every weight itself
        self.service: str | None = None  # the table service's socket, where attached
        self.statuses: dict[str, dict] = {}  # the engine's service statuses (its reports')
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(table.weights)
        self.weight = raw.view(dtype)
        spec, layer = table.spec, table.layer_id
        self.parts_expected = sum(1 for p in range(spec.split_ngram_parts)
                                  if self._covers(*spec.part_rows(layer, p)))
        self.parts_loaded = 0
        self.where = f"rows [{table.shard.row_start}, {table.shard.row_end})"

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
        if settings.tier == "mapped":
            mapped.say_where(config, "PLE")
            placement.agree_mapped(config, settings, common.get_dp_group())
            storage: PLEStorage = MappedPLEStorage.make(config, spec, layer, emb, dtype,
                                                        common.get_tp_group())
        else:
            storage = cls._tables(config, settings, spec, layer, common.get_dp_group(), emb,
                                  dtype, shared_asked=_shared_asked(config, emb,
                                                                    common.get_tp_group()))
        TABLES.append(storage.table)
        serve_metrics(settings)
        storage.dummy_load = str(getattr(config.load_config, "load_format", "auto")) == "dummy"
        storage.statuses = placement.engine(config).statuses
        storage.where = f"rows [{storage.table.shard.row_start}, " \
            f"{storage.table.shard.row_end}) of ETP rank {emb.tp_rank}/{emb.tp_size}"
        if storage.filled:
            storage.report()  # attached: nothing for vLLM's loader to do
        return storage

    def parameter(self) -> Any:
        """What vLLM's ``allocate_embedding_weight`` returns: the table's rows."""
        return self.weight

    @property
    def ready(self) -> bool:
        """The rows are the checkpoint's: attached, every part covering them
        loaded, or written by vLLM's dummy load into a table this rank writes."""
        return self.filled or self.parts_loaded >= self.parts_expected or \
            (self.writer and self.dummy_load)

    def unready(self) -> str | None:
        """Why the table's rows are not the checkpoint's, None when they are."""
        if self.ready:
            return None
        return (f"PLE layer {self.table.layer_id} {self.where}: its table was neither loaded by "
                f"vLLM's loader ({self.parts_loaded} of the {self.parts_expected} checkpoint "
                "parts that cover its rows) nor attached from a table service, so it holds "
                "zeros: the checkpoint lacks parts of this layer's ple_embedding, or the "
                "loader skipped them (check --load-format and numa_engram.service)")

    def report(self) -> dict:
        """The layer's line (report.layer_line), once its rows are in."""
        from .report import layer_line, served_pages_per_node

        served = None if self.service is None else served_pages_per_node(
            self.service, self.table, self.statuses)
        return layer_line("PLE", self.table, self.where,
                          "attached" if self.filled else "built", served=served)

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
            storage = cls(table, dtype, writer=False, group=None, filled=True)
            storage.service = decision.service
            return storage
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
            self._check_served(loaded_weight, checkpoint_start, covers)
        elif self.writer and self.read_only:
            raise PluginError(f"PLE layer {self.table.layer_id}: vLLM's loader would write into "
                              "a table this rank maps read-only; this is a bug of the "
                              "numa_engram plugin, report it")
        elif self.writer:
            write()
        if not covers:
            return
        self.parts_loaded += 1
        if self.parts_loaded != self.parts_expected or self.filled:
            return
        if self.group is not None:
            self.group.barrier(f"numa_engram: PLE layer {self.table.layer_id} loaded")
        self.report()

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

    def _check_served(self, loaded_weight: Any, checkpoint_start: int, covers: bool) -> None:
        """A part handed for a table attached read-only from the service:
        the same bytes as the rows it covers (the service's checkpoint) is
        a check; other bytes, or a part past the checkpoint's, would be a
        write into the service's read-only mapping: a PluginError first."""
        import torch

        update = ("restart the table service with the new checkpoint, or run without "
                  "numa_engram.service")
        if self.parts_loaded >= self.parts_expected and covers:
            raise PluginError(f"a weight update would write into PLE layer "
                              f"{self.table.layer_id}'s table, attached read-only from the "
                              f"table service; {update}")
        self._check_width(loaded_weight)
        first = max(self.table.shard.row_start, checkpoint_start)
        end = min(self.table.shard.row_end, checkpoint_start + loaded_weight.shape[0])
        if first >= end:
            return
        theirs = loaded_weight[first - checkpoint_start:end - checkpoint_start]
        ours = self.weight[first - self.table.shard.row_start:end - self.table.shard.row_start]
        if not torch.equal(theirs.to(ours.dtype).contiguous().view(torch.uint8),
                           ours.view(torch.uint8)):
            raise PluginError(f"vLLM's loader would write other rows into PLE layer "
                              f"{self.table.layer_id}'s table, attached read-only from the "
                              f"table service (another checkpoint than the service's, or a "
                              f"weight update); {update}")

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


class MappedPLEStorage(PLEStorage):
    """A PLE table of tier mapped: the checkpoint's rows, read in place.
    vLLM's ``weight`` is a one-row placeholder (pinned where CUDA runs, as
    vLLM's UVA view asks: the mapping's evictable pages are never
    registered), its ``_lookup`` gathers through fixed staging buffers
    (``mapped.ple_lookup``), and its loader's parts are counted, neither
    written nor compared (they are these very bytes)."""

    def __init__(self, table: SharedPLETable, dtype: Any, *, rows: int,
                 device: int | None) -> None:
        super().__init__(table, dtype, writer=False, group=None, filled=True)
        self.device = device
        self.staging = mapped.Staging(rows, {"rows": (table.spec.row_bytes,)}, (), device)
        self.read_ahead = mapped.ReadAhead()

    @classmethod
    def make(cls, config: Any, spec: PLESpec, layer: int, emb: Any, dtype: Any,
             tp: Any) -> MappedPLEStorage:
        """The layer's ETP row range mapped from the checkpoint vLLM loads;
        staging for vLLM's largest lookup (max_num_batched_tokens tokens of
        every head, of each DP replica sharing the ETP group)."""
        refuse_load(config, read_only=True)
        table = mapped.create(config, f"PLE layer {layer}", lambda path: SharedPLETable.create(
            spec, layer, etp_rank=emb.tp_rank, etp_size=emb.tp_size, mode="independent",
            tier="mapped", checkpoint=path))
        replicas = max(1, emb.tp_size // max(1, tp.world_size))
        rows = int(config.scheduler_config.max_num_batched_tokens) * spec.n_heads * replicas
        return cls(table, dtype, rows=rows, device=placement.device())

    def parameter(self) -> Any:
        import torch

        # one row of zeros, never read: vLLM's constructor takes its UVA
        # view, which an empty tensor (no address) may not have
        return torch.zeros(1, self.weight.shape[1], dtype=self.weight.dtype,
                           pin_memory=self.device is not None)

    def gather(self, ids: Any, output: Any) -> Any:
        """vLLM's ``Qwen4ExpPLEPinnedHostEmbedding._lookup`` on this table."""
        return mapped.ple_lookup(self.table, self.staging, self.read_ahead, ids, output)

    def load_rows(self, write: Any, loaded_weight: Any,  # noqa: ARG002 (nothing written)
                  checkpoint_start: int | None) -> None:
        """A part from vLLM's loader: its width checked and counted; past
        the checkpoint's parts, a weight update, refused (the rows are the
        checkpoint files')."""
        if checkpoint_start is None:
            raise PluginError("vLLM's loader handed the whole PLE table at once; the numa_engram "
                              "plugin takes the split-parts checkpoint (shard_{i}.weight)")
        self._check_width(loaded_weight)
        if not self._covers(checkpoint_start, checkpoint_start + loaded_weight.shape[0]):
            return
        if self.parts_loaded >= self.parts_expected:
            raise PluginError(f"a weight update would write into PLE layer "
                              f"{self.table.layer_id}'s table of tier mapped, whose rows are the "
                              "checkpoint files' (read-only): write a new checkpoint and restart "
                              "on it, or use tier \"resident\"")
        self.parts_loaded += 1

    def report(self) -> dict:
        from .report import layer_line

        return layer_line("PLE", self.table, self.where, "checkpoint",
                          f", rows from {self.table.backing.path}")


class MappedStagedPLE:
    """vLLM 0.34's ``Qwen4ExpPLEDiskOffloadEmbedding`` (``disk_offload``)
    reading a table of tier mapped: vLLM stages each step's rows before the
    forward (``stage_checkpoint_rows``, from its model runner's
    ``prepare_inputs``) into its own fixed pinned and device buffers, and
    its forward reads them; the plugin's part is the read, the rows' pages
    asked for by hash id and the guarded C gather from the mapping, where
    vLLM reads a row at a time with ``preadv``.  Every ETP rank stages full
    rows there, so the table is the layer's whole."""

    def __init__(self, table: SharedPLETable) -> None:
        self.table = table
        self.read_ahead = mapped.ReadAhead()
        self.where = f"rows [0, {table.shard.row_end}) staged by vLLM's disk_offload"

    @classmethod
    def attach(cls, config: Any, emb: Any) -> None:
        """Give ``emb`` (vLLM's disk-offload embedding) its layer's mapped
        table, where the settings ask for tier mapped."""
        from .patches import say_once

        settings = settings_of(config)
        if settings.tier != "mapped":
            return
        refuse_load(config, read_only=True)
        spec, layer = model_spec(config), layer_of(emb.prefix)
        if layer not in spec.layer_ids:
            raise PluginError(f"vLLM builds a PLE table for layer {layer} ({emb.prefix}); the "
                              f"hf_config's ple_layer_ids are {list(spec.layer_ids)}")
        planes = {name: plane[1] for name, plane in emb._planes.items()}
        theirs = (sorted(planes), emb.num_embeddings_padded, planes["weight"].shape[-1],
                  planes["weight"].dtype) if "weight" in planes else (sorted(planes),)
        ours = (["weight"], spec.rows(layer), spec.head_dim, _torch_dtype(spec.dtype))
        if theirs != ours:
            raise PluginError(f"PLE layer {layer}: vLLM's disk_offload stages (planes, rows, "
                              f"width, dtype) {theirs}, its hf_config's spec gives {ours}: "
                              "tier mapped serves FP8 and BF16 tables (not NVFP4)")
        say_once(config, "mapped-staged", mapped.STAGED_034)
        table = mapped.create(config, f"PLE layer {layer}", lambda path: SharedPLETable.create(
            spec, layer, mode="independent", tier="mapped", checkpoint=path))
        storage = cls(table)
        TABLES.append(table)
        serve_metrics(settings)
        emb._numa_ple = storage
        storage.report()

    def stage(self, emb: Any, num_tokens: int) -> None:
        """vLLM's ``stage_rows(num_tokens)``: the rows of its host ids into
        its pinned buffer, then its own copy to its device staging."""
        ids = emb._host_ids[:num_tokens].reshape(-1)
        host = emb._planes["weight"][1][:num_tokens]
        mapped.gather_ple(self.table, self.read_ahead, ids.numpy(),
                          host.view(torch_uint8()).view(ids.numel(), -1))
        for staging, plane, _ in emb._planes.values():
            staging[:num_tokens].copy_(plane[:num_tokens], non_blocking=True)

    def unready(self) -> str | None:
        return None  # the rows are the checkpoint's from the start

    def report(self) -> dict:
        from .report import layer_line

        return layer_line("PLE", self.table, self.where, "checkpoint",
                          f", rows from {self.table.backing.path}")


def torch_uint8() -> Any:
    import torch

    return torch.uint8
