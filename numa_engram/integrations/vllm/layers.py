"""One vLLM Engram layer's table: which of vLLM's branches it is (a table
service's, DP-shared, DP-sharded slice, private per rank), the table made
or attached for it, and ``TableStorage``, the object vLLM's embedding
calls for its views and its checkpoint load."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from ...literals import DEFAULT_DIRECTORY
from ...model.families import ENGRAM, Family
from ...model.sharding import ShardInfo, shard_heads
from ...model.spec import EngramSpec
from ...tables.request import TableOptions
from ...tables.table import SharedEngramTable
from . import mapped, placement
from .settings import PluginError, PluginSettings, settings_of

log = logging.getLogger("vllm." + __name__)

REFUSED_LOADS = ("dummy", "sharded_state", "ipc_cache")
# this process's tables (Engram and PLE), for its metrics endpoint: vLLM's
# Prometheus multiprocess mode runs no custom collector, so each worker
# serves its own registry on metrics_port + its global rank
TABLES: list[Any] = []
_METRICS: list[Any] = []


def build_embedding(nv: ModuleType, common: ModuleType, embedding: type, layout: Any,
                    layer_hash_index: int) -> Any:
    """What ``Engram._create_embedding`` returns: our subclass of vLLM's
    embedding for the layer ``layout.layer_ids[layer_hash_index]``."""
    config = nv.get_current_vllm_config()
    engram = config.engram_config
    refuse_config(config)
    settings = settings_of(config)
    if settings.tier == "mapped":
        mapped.say_where(config, "Engram")
    layer = LayerTables(nv, common, config, settings, layout.layer_ids[layer_hash_index])
    return embedding(layout.num_embeddings[layer_hash_index], layout.head_dim,
                     tuple(size for order in layout.primes[layer_hash_index] for size in order),
                     cpu_offload=True, dp_shared_memory=bool(engram.dp_shared_memory),
                     use_thp=False, numa_layer=layer)


def refuse_config(config: Any) -> None:
    """What the plugin cannot serve, each named with what to change."""
    engram = config.engram_config
    if engram is None:
        raise PluginError("vLLM made no engram_config for this model (a platform vLLM 0.31 "
                          "gives no Engram offload, or no Engram layers): the numa_engram "
                          "plugin has no table to place; unset VLLM_PLUGINS=numa_engram")
    if engram.use_thp:
        raise PluginError("engram_config.use_thp=True asks vLLM for best-effort THP tables; "
                          "the numa_engram plugin places its own huge pages: drop use_thp and "
                          "set additional_config numa_engram.page_size to 2M or 1G")
    if _is_rocm():
        raise PluginError("the numa_engram vLLM plugin patches the NVIDIA Engram path; on ROCm"
                          " unset VLLM_PLUGINS=numa_engram")


def refuse_load(config: Any, read_only: bool) -> None:
    """A load that writes every parameter (dummy weights, a sharded state,
    vLLM's ipc_cache by value) or a weight update, into a table this engine
    only reads (attached from a service, or a DP-shared peer's mapping)."""
    load_format = str(getattr(config.load_config, "load_format", "auto"))
    if read_only and load_format in REFUSED_LOADS:
        raise PluginError(f"load_format={load_format} writes every weight, but this engine's "
                          "Engram tables are read-only (attached from the table service, or "
                          "a DP-shared peer's): use load_format=auto (safetensors), or "
                          "additional_config numa_engram.service=null and no DP sharing")


def _is_rocm() -> bool:
    import sys

    platforms = sys.modules.get("vllm.platforms")
    platform = getattr(platforms, "current_platform", None)
    is_rocm = getattr(platform, "is_rocm", None)
    return bool(is_rocm()) if callable(is_rocm) else False


def model_spec(config: Any) -> EngramSpec:
    """The Engram tables' spec from vLLM's parsed config (``hf_config``:
    V4.1's text fields, flattened by vLLM or under ``text_config``), once
    per engine; no tokenizer (``EngramSpec.storage_of_config``: tables
    store no hashing)."""
    return config_spec(config, ENGRAM)


def config_spec(config: Any, family: Family) -> Any:
    """The family's spec of vLLM's ``model_config.hf_config`` as a document
    (``Family.spec_of_config``), once per engine and family; the model
    directory is never read (a hub id not yet downloaded, ``--tokenizer``
    elsewhere: the same)."""
    from ...errors import NumaEngramError

    specs = placement.engine(config).specs
    if family.name not in specs:
        model_config = config.model_config
        hf = getattr(model_config, "hf_config", None)
        if hf is None:
            raise PluginError(f"vLLM's model_config of {getattr(model_config, 'model', None)!r} "
                              "has no hf_config: the numa_engram plugin takes the "
                              f"{family.title} tables' layout from it")
        try:
            specs[family.name] = family.spec_of_config(hf_document(hf))
        except NumaEngramError as exc:
            raise PluginError(f"{family.title} tables of "
                              f"{getattr(model_config, 'model', None)!r}: vLLM's hf_config: "
                              f"{exc}") from None
    return specs[family.name]


def hf_document(hf: Any) -> dict:
    """vLLM's parsed config (a transformers ``PretrainedConfig``, its
    ``to_dict``; or any object of attributes) as a JSON-like document, its
    ``text_config`` too."""
    if isinstance(hf, dict):
        doc = dict(hf)
    elif callable(getattr(hf, "to_dict", None)):
        doc = dict(hf.to_dict())
    else:
        doc = dict(vars(hf))
    text = doc.get("text_config")
    if text is not None and not isinstance(text, dict):
        doc["text_config"] = hf_document(text)
    return doc


@dataclass
class LayerTables:
    """One Engram layer of this rank: makes (or attaches) its table when
    vLLM's embedding allocates its weights."""

    nv: ModuleType
    common: ModuleType
    config: Any
    settings: PluginSettings
    layer_id: int

    def allocate(self, emb: Any) -> TableStorage:
        storage = self._tables(emb)
        TABLES.append(storage.table)
        serve_metrics(self.settings)
        if storage.filled:
            storage.report()  # attached: nothing for vLLM's loader to do
        return storage

    def _tables(self, emb: Any) -> TableStorage:
        spec = model_spec(self.config)
        shard = vllm_shard(spec, self.layer_id, emb)
        device = placement.device()
        edp = self.nv.get_engram_dp_group()
        if self.settings.tier == "mapped":
            return self._mapped(spec, shard, emb, edp, device)
        decision = placement.decide(self.config, self.settings, edp,
                                    shared_asked=bool(emb.dp_shared_memory))
        if decision.source == "service":
            return self._attach(spec, shard, emb, decision.service, device)
        options = TableOptions(placement=self.settings.placement,
                               page_size=self.settings.page_size, register_device=device,
                               load_threads=self.settings.load_threads)
        if decision.source == "dp_shared" and emb.dp_shared_memory:
            tp_rank = self.nv.get_tensor_model_parallel_rank()
            group = placement.sharing_group(self.config, self.settings, edp, tp_rank=tp_rank,
                                            device=device)
            if group is not None:
                refuse_load(self.config, read_only=True)
                table = SharedEngramTable.create(
                    spec, self.layer_id, shard, group=group, mode="dp_shared",
                    options=replace(options, directory=self.settings.directory
                                    or DEFAULT_DIRECTORY))
                return TableStorage(self.nv, self.common, table, writer=table.leader,
                                    group=group, filled=False, config=self.config)
        table = SharedEngramTable.create(spec, self.layer_id, shard, mode="independent",
                                         options=replace(options, directory=None))
        return TableStorage(self.nv, self.common, table, writer=True, group=None, filled=False,
                            config=self.config)

    def _mapped(self, spec: EngramSpec, shard: ShardInfo, emb: Any, edp: Any,
                device: int | None) -> TableStorage:
        """The layer's TP slice mapped from the checkpoint vLLM loads (no
        service, no group: every rank maps the files, the page cache holds
        them once); the weights mapper drops its tensors, as an attached
        table's."""
        edp_size = self.nv.get_engram_dp_size()
        if edp_size > 1 and not emb.dp_shared_memory:
            raise PluginError(f"Engram layer {self.layer_id}: tier mapped maps each TP rank's "
                              f"heads of the checkpoint (the page cache holds one copy for "
                              f"every replica), but with engram_config.dp_shared_memory=False "
                              f"vLLM splits them across its {edp_size} Engram DP replicas and "
                              "exchanges rows between them (from 0.32 on, its peer exchange "
                              "reads the tables' memory from the device: deepseek_v41/nvidia/"
                              "ops/engram_peer.py:107): set dp_shared_memory=True, or use "
                              "tier \"resident\"")
        placement.agree_mapped(self.config, self.settings, edp)
        refuse_load(self.config, read_only=True)
        table = mapped.create(self.config, f"Engram layer {self.layer_id}", lambda path:
                              SharedEngramTable.create(spec, self.layer_id, shard,
                                                       mode="independent", checkpoint=path,
                                                       tier="mapped"))
        placement.engine(self.config).attached.add(self.layer_id)
        rows = int(self.config.scheduler_config.max_num_batched_tokens)
        return MappedTableStorage(self.nv, self.common, table, config=self.config, rows=rows,
                                  device=device)

    def _attach(self, spec: EngramSpec, shard: ShardInfo, emb: Any, service: str | None,
                device: int | None) -> TableStorage:
        """The layer's TP slice from the table service (it holds TP slices:
        vLLM must not shard the heads across its Engram DP group too)."""
        edp_size = self.nv.get_engram_dp_size()
        if edp_size > 1 and not emb.dp_shared_memory:
            raise PluginError(f"Engram layer {self.layer_id}: the table service holds each TP "
                              f"rank's heads, but with engram_config.dp_shared_memory=False "
                              f"vLLM splits them across its {edp_size} Engram DP replicas: "
                              "set dp_shared_memory=True (the replicas attach one copy), or "
                              "run without numa_engram.service")
        refuse_load(self.config, read_only=True)
        assert service is not None
        table = SharedEngramTable.attach(
            spec, self.layer_id, shard, service=service, page_size=self.settings.page_size,
            register_device=device, service_uids=self.settings.service_uids or None,
            allow_unsealed=self.settings.allow_unsealed or None)
        placement.engine(self.config).attached.add(self.layer_id)
        storage = TableStorage(self.nv, self.common, table, writer=False, group=None,
                               filled=True, config=self.config)
        storage.service = service
        return storage


def serve_metrics(settings: PluginSettings) -> None:
    """This worker's metrics endpoint on ``metrics_port`` + its rank, once:
    every table in TABLES, those made later too."""
    port = settings.metrics_port
    if port is None or _METRICS:
        return
    import torch.distributed as dist

    from ...metrics import EngramCollector
    from ...metrics import serve_metrics as serve

    rank = dist.get_rank() if dist.is_initialized() else 0
    collector = EngramCollector(labels={"rank": str(rank)})
    collector.tables = TABLES  # the same list: later layers' tables are scraped too
    _METRICS.append(serve(collector, port + rank))
    log.info("numa_engram: Engram table metrics of rank %d on 127.0.0.1:%d", rank, port + rank)


def vllm_shard(spec: EngramSpec, layer_id: int, emb: Any) -> ShardInfo:
    """The rows vLLM's embedding numbered (``head_start``,
    ``part_n_hash_cols``, ``vocab_start_idx`` .. ``vocab_end_idx``), checked
    against our head-wise sharding of the same layer."""
    num_shards, head_rank = emb._get_shard_info()
    if spec.rows(layer_id) != emb.num_embeddings or spec.head_dim != emb.dim or \
            spec.block != emb.block_size:
        raise PluginError(f"layer {layer_id}: vLLM's table is {emb.num_embeddings} rows of "
                          f"{emb.dim} (block {emb.block_size}), its hf_config's spec "
                          f"{spec.rows(layer_id)} of {spec.head_dim} (block {spec.block}): "
                          "the config's Engram fields disagree with the layout vLLM built")
    head_end = min(emb.head_start + emb.part_n_hash_cols, emb.n_hash_cols)
    theirs = ShardInfo(emb.head_start, head_end, emb.vocab_start_idx, emb.vocab_end_idx,
                       emb.vocab_end_idx - emb.vocab_start_idx)
    ours = shard_heads(spec.bucket_sizes(layer_id), num_shards, head_rank)
    if ours != theirs:
        raise PluginError(f"layer {layer_id} shard {head_rank} of {num_shards}: vLLM holds "
                          f"{theirs}, numa_engram's head-wise sharding {ours}")
    return theirs


class TableStorage:
    """vLLM's ``DPSharedEngramStorage`` contract over one of our tables:
    ``weight`` (``float8_e4m3fn [rows, dim]``) and ``scales`` (``uint8
    [rows, dim / block]``), contiguous CPU views of the table; ``get_views``
    the views vLLM's kernel reads (cached; the table's CUDA views when it is
    registered); ``load_weight`` what vLLM's loader calls per tensor."""

    def __init__(self, nv: ModuleType, common: ModuleType, table: SharedEngramTable, *,
                 writer: bool, group: Any, filled: bool, config: Any) -> None:
        import torch

        self._nv, self._common, self._config = nv, common, config
        # (group: the sharing group, a Group whose collectives are bounded)
        self.table, self.writer, self.group, self.filled = table, writer, group, filled
        # torch has no read-only tensor: a mapping this rank may not write
        # (attached, a DP-shared peer's) is refused by load_weight before
        # any write reaches it
        self.read_only = not table.weights.flags.writeable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.weight = torch.from_numpy(table.weights).view(torch.float8_e4m3fn)
            self.scales = torch.from_numpy(table.scales)
        self._views: tuple[Any, Any] | None = None
        self._loads = 0
        self.service: str | None = None  # the table service's socket, where attached

    def load_weight(self, param: Any, loaded_weight: Any) -> None:
        """vLLM's loader hands one tensor: the writer copies this rank's rows
        (through vLLM's own head-shard loader: the scale arrives as
        float8_e8m0fnu and must keep its bytes), then the group's members
        meet at a barrier; a table already filled (attached) checks shapes."""
        if self.filled:
            self._check_served(param, loaded_weight)
            return
        if self.writer and self.read_only:
            raise PluginError(f"Engram layer {self.table.layer_id}: vLLM's loader would write "
                              "into a table this rank maps read-only; this is a bug of the "
                              "numa_engram plugin, report it")
        if self.writer:
            self._common._engram_head_shard_weight_loader(param, loaded_weight)
        if self.group is not None:
            self.group.barrier(f"numa_engram: layer {self.table.layer_id} loaded")
        self._loads += 1
        if self._loads == 2:  # weights and scales: the table is loaded
            self.report()

    def _check_served(self, param: Any, loaded_weight: Any) -> None:
        """A tensor handed for a table attached read-only from the service:
        the same bytes as its rows (the checkpoint the service holds) is a
        check; anything else, or past the checkpoint's two tensors, would be
        a write into the service's read-only mapping: a PluginError, before
        any byte is written."""
        import torch

        layer = self.table.layer_id
        update = ("restart the table service with the new checkpoint, or run without "
                  "numa_engram.service")
        if self._loads >= 2:  # past the checkpoint's two tensors: an update
            raise PluginError(f"a weight update would write into Engram layer {layer}'s table, "
                              f"attached read-only from the table service; {update}")
        rows, start = param.shape[0], param.engram_vocab_start
        if loaded_weight.shape[0] < start + rows or \
                tuple(loaded_weight.shape[1:]) != tuple(param.shape[1:]):
            raise PluginError(f"the checkpoint's tensor of {list(loaded_weight.shape)} "
                              f"does not hold rows {start}..{start + rows} of "
                              f"{list(param.shape[1:])}")
        theirs = loaded_weight[start:start + rows].contiguous().view(torch.uint8)
        if not torch.equal(theirs, param.data.view(torch.uint8)):
            raise PluginError(f"vLLM's loader would write other rows into Engram layer {layer}'s "
                              f"table, attached read-only from the table service (another "
                              f"checkpoint than the service's, or a weight update); {update}")
        self._loads += 1

    def unready(self) -> str | None:
        """Why the table's rows are not the checkpoint's, None when they are."""
        if self.ready:
            return None
        return (f"Engram layer {self.table.layer_id}: its table was neither loaded by vLLM's "
                f"loader ({self._loads} of its 2 tensors) nor attached from a table service, so "
                "it holds zeros: the checkpoint lacks this layer's engram.embed tensors, or "
                "the loader skipped them (check --load-format and numa_engram.service)")

    @property
    def huge_pages(self) -> bool:
        """What vLLM 0.34 reads of its own storage (its constructor's log,
        and every lookup: small host pages sort their rows first): whether
        the table's pages are huge (2M or 1G)."""
        from .report import page_size

        return page_size(self.table) > 4096

    def report(self) -> dict:
        """The layer's line (report.layer_line), with its sharing group, the
        PSS of the group's members as copies of the table and the startup
        phases; logged once per table."""
        from ...host.procfs import smaps
        from .report import layer_line, served_pages_per_node

        doc = dict(self.table.mode_report())
        name = os.path.basename(self.table.path).removeprefix("memfd:")
        if self.group is not None:  # a member holding a handed-over memfd: the leader's name
            names = self.group.all_gather(name, "numa_engram: the table's name")
            name = next((n for n in names if n.startswith("numa-engram-")), name)
        # (PSS counts no hugetlb page: a huge-page table's copies show in its
        # pool; an attached table has no page mapped here before its first read)
        pss = smaps("self", name).pss if name.startswith("numa-engram-") and \
            not self.huge_pages and not self.filled else None
        if self.group is not None:  # (every member gathers: a collective)
            every = self.group.all_gather(pss, "numa_engram: the copies' PSS")
            pss = None if None in every else sum(every)
        doc["pss_copies"] = None if pss is None else round(pss / self.table.backing_bytes, 3)
        copies = "copies by PSS not measured (attached: its pages map at their first read)" \
            if self.filled else f"{doc['pss_copies']} copies by PSS"
        doc.update(layer_line(
            "Engram", self.table, f"heads [{doc['head_start']}, {doc['head_end']})",
            "attached" if self.filled else "built", f", group {doc['sharing_group']}, "
            f"{copies}, startup {doc['startup_s']}",
            served=self._served(served_pages_per_node)))
        return doc

    def _served(self, measure: Callable[..., Any]) -> dict[int, int] | None:
        """An attached table's pages per node, as its service measured them."""
        if self.service is None:
            return None
        return measure(self.service, self.table, placement.engine(self._config).statuses)

    @property
    def ready(self) -> bool:
        """The rows are the checkpoint's: attached, loaded (both tensors),
        or written by vLLM's dummy load into a table this rank writes."""
        load_format = str(getattr(self._config.load_config, "load_format", "auto"))
        return self.filled or self._loads >= 2 or (self.writer and load_format == "dummy")

    def get_views(self, weight: Any, scales: Any) -> tuple[Any, Any]:
        if (weight.data_ptr(), scales.data_ptr()) != (self.weight.data_ptr(),
                                                       self.scales.data_ptr()):
            raise RuntimeError("the Engram parameters' storage was replaced; numa_engram's "
                               "tables must stay under them")
        problem = self.unready()
        if problem:
            raise PluginError(problem)
        if self._views is None:
            self._views = self._device_views()
        return self._views

    def _device_views(self) -> tuple[Any, Any]:
        import torch

        if self.table.registration is not None:
            shard = self.table.device_view()
            return shard.weights.view(torch.float8_e4m3fn), shard.scales
        # no registering device (CPU-only checks): vLLM's own helper, found now
        accelerator_view = self._nv.get_accelerator_view_from_cpu_tensor
        return accelerator_view(self.weight), accelerator_view(self.scales)


class MappedTableStorage(TableStorage):
    """A table of tier mapped under vLLM's embedding: its rows are the
    checkpoint's (read-only; vLLM's loader is dropped by the weights mapper,
    or only checked), and vLLM's lookup gathers them through fixed staging
    buffers (``mapped.engram_lookup``) instead of reading the table from the
    device: CUDA never maps the evictable pages."""

    def __init__(self, nv: ModuleType, common: ModuleType, table: SharedEngramTable, *,
                 config: Any, rows: int, device: int | None) -> None:
        super().__init__(nv, common, table, writer=False, group=None, filled=True,
                         config=config)
        spec, shard = table.spec, table.shard
        heads = shard.head_end - shard.head_start
        self.staging = mapped.Staging(rows, {"weights": (heads, spec.head_dim),
                                             "scales": (heads, spec.scales_per_row)},
                                      (spec.n_hash_cols,), device)
        self.read_ahead = mapped.ReadAhead()

    def load_weight(self, param: Any, loaded_weight: Any) -> None:  # noqa: ARG002 (vLLM's)
        """A tensor from vLLM's loader (a model whose weights mapper keeps
        the Engram tensors): the rows are this table's own bytes, so
        nothing is written or compared; past the checkpoint's two tensors,
        a weight update, refused."""
        if self._loads >= 2:
            raise PluginError(f"a weight update would write into Engram layer "
                              f"{self.table.layer_id}'s table of tier mapped, whose rows are the "
                              "checkpoint files' (read-only): write a new checkpoint and restart "
                              "on it, or use tier \"resident\"")
        self._loads += 1

    def gather(self, indices: Any, out: Any) -> None:
        """vLLM's ``ParallelEngramEmbedding.lookup`` on this table."""
        mapped.engram_lookup(self.table, self.staging, self.read_ahead, indices, out)

    def get_views(self, weight: Any, scales: Any) -> tuple[Any, Any]:  # noqa: ARG002 (vLLM's)
        raise PluginError(f"Engram layer {self.table.layer_id} is tier mapped: its pages are "
                          "the page cache's, which the kernel may evict, so they are never "
                          "registered for the GPU to read; vLLM asked for the table's device "
                          "views outside ParallelEngramEmbedding.lookup, a path tier mapped "
                          "does not serve: use tier \"resident\"")

    def report(self) -> dict:
        """The layer's line (report.layer_line, source checkpoint)."""
        from .report import layer_line

        shard = self.table.shard
        return layer_line("Engram", self.table, f"heads [{shard.head_start}, {shard.head_end})",
                          "checkpoint", f", rows from {self.table.path}")


def check_loaded(model: Any) -> None:
    """At the end of vLLM's load (the model's ``load_weights``, or a PLE
    layer's post-load hook): every numa_engram table under ``model`` holds
    the checkpoint's rows (loaded or attached), else one PluginError naming
    each layer that would serve zeros, before any forward."""
    problems = []
    for module in model.modules():
        for storage in (getattr(module, "_shared_memory", None),
                        getattr(module, "_numa_ple", None)):
            unready = getattr(storage, "unready", None)  # (vLLM's own storage has none)
            problem = unready() if callable(unready) else None
            if problem:
                problems.append(problem)
    if problems:
        raise PluginError("; ".join(problems))


def can_share(nv: ModuleType, layout: Any,  # noqa: ARG001 (vLLM's signature)
              block_size: int) -> bool:  # noqa: ARG001
    """vLLM's ``can_share_engram_tables`` from this engine's decision (made
    alike on every EDP peer): the tables of a table service (each rank's
    TP slice, so vLLM's EDP must not split them further) or one shared copy
    per host (the peers on one host and user, one table directory; the
    copy's memory is checked by the table's create, every member alike)."""
    if nv.get_engram_dp_size() <= 1:
        log.warning("numa_engram: Engram DP replicas are not co-located on one node; one "
                    "table per rank")
        return False
    config = nv.get_current_vllm_config()
    settings = settings_of(config)
    if settings.tier == "mapped":  # every replica maps its TP slice: the page cache's one copy
        placement.agree_mapped(config, settings, nv.get_engram_dp_group())
        return True
    decision = placement.decide(config, settings, nv.get_engram_dp_group(),
                                shared_asked=True)
    return decision.source != "independent"
