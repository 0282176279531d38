"""The table families as objects: everything that differs between Engram and
PLE above storage geometry (``family.TableFamily``), so the layers above ask
the family and never test a spec's type or attributes.  A family here owns
its spec type and config detection, which rows a rank holds, its tables'
names in a service, a plan's notes and exchange bytes, and how a document's
tokens become table rows.  Its parts above ``model/`` (checkpoint reader,
table class, model directory class) it names as ``"module:attribute"``
references, imported on first use (``Family.part``), so ``model/`` imports
nothing above it and a new family edits no module above it: it is listed
here, registered (``register_family``) or found through the
``numa_engram.families`` entry point group."""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any, Literal

import numpy as np

from ..errors import SpecError
from ..units import fmt_bytes, node_list
from .ple import PLESpec
from .sharding import ShardInfo, WorldLayout, shard_heads, valid_head_shard_counts
from .spec import EngramSpec

CHUNK_TOKENS = 1 << 16  # tokens hashed per HashState call in document_rows
ENTRY_POINTS = "numa_engram.families"  # where installed packages add a family
Part = Literal["reader", "table", "directory"]


class Family:
    """One table family; the subclasses below are the two there are."""

    name: str         # the key of every per-family registry ("engram", "ple")
    title: str        # how log lines and errors name its tables
    spec_type: type
    # whether its hashing maps token ids through the tokenizer first
    # (Engram's compressed ids: a spec for hashing needs the tokenizer)
    needs_token_map: bool
    # its parts above model/ ("module:attribute", imported by ``part``): the
    # checkpoint reader (a ``checkpoints.familyreaders.CheckpointReader``),
    # the table class (a ``tables.familytable.FamilyTable``), the model
    # directory class (``open(path, tokenizer)``, ``spec``, ``checkpoint``,
    # ``checkpoint_plans()``)
    reader: str
    table: str
    directory: str

    def part(self, kind: Part) -> Any:
        """The family's ``reader``, ``table`` or ``directory``, imported."""
        return load_reference(getattr(self, kind), f"the {self.title} family's {kind}")

    def matches_config(self, doc: object) -> bool:
        """Whether a config.json document describes this family's tables."""
        raise NotImplementedError

    def spec_of_config(self, doc: dict) -> Any:
        """The tables' spec from a config document alone (no tokenizer)."""
        raise NotImplementedError

    def shard(self, spec: Any, layer_id: int, rank: int, tp: int) -> ShardInfo:
        """The rows TP rank ``rank`` of ``tp`` holds of the layer's table."""
        raise NotImplementedError

    def table_name(self, fingerprint: bytes, layer_id: int, shard: ShardInfo,
                   page_size: int, node: str) -> str:
        """A service's name for one held table (printable, no ':')."""
        raise NotImplementedError

    def sharding_notes(self, spec: Any, world: WorldLayout) -> list[str]:
        """A plan's lines on how the tables split over TP."""
        raise NotImplementedError

    def dp_sharded_exchange_bytes(self, spec: Any, world: WorldLayout, batch: int) -> int:
        """Bytes one member exchanges per step of ``batch`` tokens, DP-sharded."""
        raise NotImplementedError

    def document_rows(self, model: Any, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(layer, rows of its whole table) a document's token ids read, as
        serving hashes them (``model``: the model directory)."""
        raise NotImplementedError


class EngramFamily(Family):
    name, title, spec_type, needs_token_map = "engram", "Engram", EngramSpec, True
    reader = "numa_engram.checkpoints.checkpoint:READER"
    table = "numa_engram.tables.table:SharedEngramTable"
    directory = "numa_engram.runtime.modeldir:ModelDirectory"

    def matches_config(self, doc: object) -> bool:
        return _has_field(doc, "engram_layer_ids")

    def spec_of_config(self, doc: dict) -> EngramSpec:
        return EngramSpec.storage_of_config(doc)

    def shard(self, spec: Any, layer_id: int, rank: int, tp: int) -> ShardInfo:
        return shard_heads(spec.bucket_sizes(layer_id), tp, rank)

    def table_name(self, fingerprint: bytes, layer_id: int, shard: ShardInfo,
                   page_size: int, node: str) -> str:
        return (f"engram-{fingerprint.hex()[:16]}-l{layer_id}-h{shard.head_start}-"
                f"{shard.head_end}-p{page_size}-n{node}")

    def sharding_notes(self, spec: Any, world: WorldLayout) -> list[str]:
        valid = valid_head_shard_counts(spec.n_hash_cols, max(world.tp, 64))
        part = -(-spec.n_hash_cols // world.tp)
        heads = [min(part, spec.n_hash_cols - r * part) for r in range(world.tp)]
        return [f"TP {world.tp}: heads per rank {heads} (create accepts it; head-wise TP sizes "
                f"for {spec.n_hash_cols} heads: {node_list(valid)})"]

    def dp_sharded_exchange_bytes(self, spec: Any, world: WorldLayout, batch: int) -> int:
        edp = world.edp_size()
        own = -(-spec.n_hash_cols // (world.tp * edp))  # heads of one slice
        return (edp - 1) * batch * own * spec.head_dim * 2 * len(spec.layer_ids)

    def document_rows(self, model: Any, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        from .hashstate import HashState  # the compiled hash kernels: only when hashing

        spec = model.spec
        state = HashState(spec, 1, model.token_map, model.dead_ids)
        for start in range(0, len(ids), CHUNK_TOKENS):
            chunk = ids[start:start + CHUNK_TOKENS]
            out = state.hash(chunk, np.zeros(len(chunk), np.int64),
                             np.arange(start, start + len(chunk), dtype=np.int64),
                             id_format="global")
            for i, layer in enumerate(spec.layer_ids):
                yield layer, out[:, i].reshape(-1).copy()


class PLEFamily(Family):
    name, title, spec_type, needs_token_map = "ple", "PLE", PLESpec, False  # raw token ids
    reader = "numa_engram.checkpoints.plecheckpoint:READER"
    table = "numa_engram.tables.pletable:SharedPLETable"
    directory = "numa_engram.runtime.plemodeldir:PLEModelDirectory"

    def matches_config(self, doc: object) -> bool:
        return _has_field(doc, "ple_layer_ids")

    def spec_of_config(self, doc: dict) -> PLESpec:
        return PLESpec.from_config(doc)

    def shard(self, spec: Any, layer_id: int, rank: int, tp: int) -> ShardInfo:
        return spec.shard(layer_id, rank, tp)  # a row range of every head

    def table_name(self, fingerprint: bytes, layer_id: int, shard: ShardInfo,
                   page_size: int, node: str) -> str:
        return (f"ple-{fingerprint.hex()[:16]}-l{layer_id}-r{shard.row_start}-"
                f"{shard.row_end}-p{page_size}-n{node}")

    def sharding_notes(self, spec: Any, world: WorldLayout) -> list[str]:
        layer = spec.layer_ids[0]
        per_rank = spec.shard_bytes(layer, world.tp, 0) * len(spec.layer_ids)
        vllm = per_rank * min(world.world_size, world.gpus_per_host)
        return [f"TP {world.tp}: PLE row ranges of {spec.rows(layer) // world.tp:,} rows per "
                f"rank and layer ({spec.head_dim}-wide {spec.dtype} rows)",
                f"vLLM 0.31.0 holds PLE tables per rank (pinned, no sharing): "
                f"{fmt_bytes(per_rank)} per rank, {fmt_bytes(vllm)} per host"]

    def dp_sharded_exchange_bytes(self, spec: Any, world: WorldLayout, batch: int) -> int:
        # row ranges over TP x EDP: each member's ids gathered, every token's
        # rows all-reduced (FP8 or BF16 bytes) across the EDP members
        return world.edp_size() * batch * spec.n_hash_cols * spec.row_bytes * len(spec.layer_ids)

    def document_rows(self, model: Any, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        from .plehashing import ple_ids

        spec = model.spec
        for layer in spec.layer_ids:
            yield layer, ple_ids(spec, [layer], ids)[:, 0].reshape(-1)


ENGRAM = EngramFamily()
PLE = PLEFamily()
# detection order: the first that matches; Engram last, the fallback whose
# own checks name what a config lacks
_FAMILIES: list[Family] = [PLE, ENGRAM]
_LOCK = threading.Lock()
_LOADED: list[bool] = []  # the entry points read (once, on first ask)


def families() -> tuple[Family, ...]:
    """Every family: the two here, those registered and those installed
    packages name in the ``numa_engram.families`` entry point group."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(True)
            for point in entry_points(group=ENTRY_POINTS):
                _add(point.load(), f"entry point {point.name!r} of {ENTRY_POINTS}")
        return tuple(_FAMILIES)


def register_family(family: Family) -> Family:
    """Add a family (an instance of a ``Family`` subclass) ahead of Engram in
    detection; refused when its name or spec type is another's."""
    with _LOCK:
        _add(family, f"{type(family).__name__}")
    return family


def _add(family: Any, source: str) -> None:
    if not isinstance(family, Family):
        raise SpecError(f"{source} is {type(family).__name__}, not a numa_engram Family "
                        "instance; register an instance of a Family subclass")
    for known in _FAMILIES:
        if known.name == family.name or known.spec_type is family.spec_type:
            if known is family:
                return
            raise SpecError(f"{source}: a family named {known.name!r} (spec "
                            f"{known.spec_type.__name__}) is already registered; give the "
                            "new family its own name and spec type")
    _FAMILIES.insert(len(_FAMILIES) - 1, family)


@functools.cache
def load_reference(ref: str, what: str) -> Any:
    """``"module:attribute"`` imported (a family's part), or SpecError naming it."""
    module, _, attribute = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SpecError(f"{what} {ref!r} cannot be imported ({exc}); name it as "
                        "'package.module:attribute'") from None


def _has_field(doc: object, name: str) -> bool:
    """Whether a config document has ``name`` at its top level or under
    ``text_config`` (where vLLM's multimodal configs keep the text fields)."""
    if not isinstance(doc, dict):
        return False
    text = doc.get("text_config")
    return name in doc or isinstance(text, dict) and name in text


def family_of(spec: object) -> Family:
    """The family of a spec (EngramSpec, PLESpec)."""
    for family in families():
        if isinstance(spec, family.spec_type):
            return family
    raise SpecError(f"{type(spec).__name__} is no table family's spec; pass one of "
                    f"{[f.spec_type.__name__ for f in families()]}")


def family_of_config(doc: object) -> Family:
    """The family a config.json document describes (Engram when no
    family's fields are there: its own checks then name what is missing)."""
    return next((f for f in families() if f.matches_config(doc)), ENGRAM)


def has_tables(doc: object) -> bool:
    """Whether a config.json document has some family's table fields."""
    return any(f.matches_config(doc) for f in families())


def family_named(name: str) -> Family:
    """The family of ``Family.name``."""
    known = families()
    for family in known:
        if family.name == name:
            return family
    raise SpecError(f"no table family is named {name!r}; the families are "
                    f"{[f.name for f in known]}")
