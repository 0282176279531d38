"""EngramSpec: the configuration that decides a table's bytes.

Prime bucket sizes and multipliers are chosen exactly as DeepSeek's
reference demo chooses them (docs/design.md, "Hashes"): primes distinct across
the whole model, searched upwards from each order's engram vocab size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import SpecError, SpecMismatchError, TopologyError
from ..userfiles import read_regular
from .sharding import ShardInfo, prefix_offsets

LAYER_SEED_PRIME = 10007
FINGERPRINT_VERSION = 2  # 2: the pad id (the tokenizer's map) left out
# the fields a table's fingerprint covers: all but pad_id, which is the pad
# token's compressed id (the tokenizer's map) and decides no table byte
FINGERPRINT_FIELDS = ("layer_ids", "engram_vocab_sizes", "max_ngram_size", "n_head_per_ngram",
                      "head_dim", "compressed_vocab_size", "seed", "block")
STORAGE_PAD_ID = 0  # a storage spec's pad id: not the model's (it hashes nothing)
PAD_FIELDS = ("engram_pad_token_id", "engram_pad_id")  # as V4.1 ships it; DeepSeek's args
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact below 3.3e24
# Bounds on a spec, each checked at construction (SpecError, within a second):
MAX_NGRAM_SIZE = 64          # the native window hash keeps at most 64 ids per token
MAX_HEADS_PER_NGRAM = 1024   # far above any model's (V4.1: 8)
MAX_PRIMES = 4096            # the prime search costs ~85 us a prime: < 0.4 s at start-up
MAX_VOCAB_SIZE = 2**40       # per order; beyond it the table could not exist in memory
MAX_HEAD_DIM = 1 << 16
MAX_LAYER_ID = 2**31 - 1
MAX_COMPRESSED_VOCAB = 2**31  # ids and the multipliers' bound (int64 max // vocab) stay sane
MAX_LAYER_BYTES = 2**62       # row and byte offsets of a layer are int64


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for every n < 3.3e24."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, used: set[int]) -> int:
    """Smallest prime strictly above start that is not in used."""
    candidate = start + 1
    while not is_prime(candidate) or candidate in used:
        candidate += 1
    return candidate


@dataclass(frozen=True, kw_only=True)
class EngramSpec:
    """Keyword arguments named as in DeepSeek's config.

    ``engram_vocab_sizes[i]`` is for n-gram order i+2; ``pad_id`` is already
    a compressed id; ``head_dim`` is the width of one hash head's row;
    ``block`` is the number of values one ue8m0 scale covers."""

    layer_ids: Sequence[int]  # any sequence; stored as a tuple
    engram_vocab_sizes: Sequence[int]  # any sequence; stored as a tuple
    max_ngram_size: int
    n_head_per_ngram: int
    head_dim: int
    compressed_vocab_size: int
    pad_id: int
    seed: int = 0
    block: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", _int_tuple(self.layer_ids, "layer_ids"))
        object.__setattr__(self, "engram_vocab_sizes",
                           _int_tuple(self.engram_vocab_sizes, "engram_vocab_sizes"))
        for name in ("max_ngram_size", "n_head_per_ngram", "head_dim", "compressed_vocab_size",
                     "pad_id", "seed", "block"):
            object.__setattr__(self, name, strict_int(getattr(self, name), name))
        self._validate()

    def _validate(self) -> None:
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise SpecError(f"layer_ids must be non-empty and distinct, got {self.layer_ids}")
        _check_range("layer ids", min(self.layer_ids), 0, MAX_LAYER_ID)
        _check_range("layer ids", max(self.layer_ids), 0, MAX_LAYER_ID)
        _check_range("max_ngram_size", self.max_ngram_size, 2, MAX_NGRAM_SIZE)
        if len(self.engram_vocab_sizes) != self.max_ngram_size - 1:
            raise SpecError(f"engram_vocab_sizes needs one size per order 2..{self.max_ngram_size}"
                            f" ({self.max_ngram_size - 1}), got {len(self.engram_vocab_sizes)}")
        _check_range("n_head_per_ngram", self.n_head_per_ngram, 1, MAX_HEADS_PER_NGRAM)
        primes = len(self.layer_ids) * (self.max_ngram_size - 1) * self.n_head_per_ngram
        if primes > MAX_PRIMES:
            raise SpecError(f"{len(self.layer_ids)} layers x {self.max_ngram_size - 1} orders x "
                            f"{self.n_head_per_ngram} heads need {primes} distinct primes, above "
                            f"{MAX_PRIMES} (each is searched for at start-up: keep it under a "
                            "second); use fewer layers, orders or heads")
        for size in self.engram_vocab_sizes:
            _check_range("engram vocab sizes", size, 2, MAX_VOCAB_SIZE)
        _check_range("block", self.block, 1, MAX_HEAD_DIM)
        _check_range("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        if self.head_dim % self.block:
            raise SpecError(f"head_dim {self.head_dim} must be a positive multiple of the scale "
                            f"block {self.block}")
        # primes sit just above each vocab size; the slack covers the search
        rows = self.n_head_per_ngram * sum(self.engram_vocab_sizes) * 2
        if rows * self.row_bytes >= MAX_LAYER_BYTES:
            raise SpecError(f"a layer of about {rows // 2} rows of {self.row_bytes} bytes is "
                            f"beyond {MAX_LAYER_BYTES} bytes: its byte offsets would not fit "
                            "int64; check engram_vocab_sizes and head_dim")
        _check_range("compressed_vocab_size", self.compressed_vocab_size, 1, MAX_COMPRESSED_VOCAB)
        if not 0 <= self.pad_id < self.compressed_vocab_size:
            raise SpecError(f"pad_id {self.pad_id} is not a compressed id (0.."
                            f"{self.compressed_vocab_size - 1}); pass the pad token's "
                            "compressed id (token_map[pad token id])")
        _check_range("seed", self.seed, 0, 2**63 - 1)

    # ------------------------------------------------------- named configs --
    @classmethod
    def demo(cls) -> EngramSpec:
        """DeepSeek's engram_demo_v1 configuration (compressed vocab of its tokenizer)."""
        return cls(layer_ids=(1, 15), engram_vocab_sizes=(129280 * 5, 129280 * 5),
                   max_ngram_size=3, n_head_per_ngram=8, head_dim=64,
                   compressed_vocab_size=99092, pad_id=2, seed=0)

    @classmethod
    def small(cls, rows_per_head: int = 1000, n_head_per_ngram: int = 4, head_dim: int = 64,
              layer_ids: tuple[int, ...] = (1, 14), max_ngram_size: int = 3,
              compressed_vocab_size: int = 1000, seed: int = 0) -> EngramSpec:
        """A small table for demos and tests, same shape rules as the real one."""
        return cls(layer_ids=layer_ids, engram_vocab_sizes=(rows_per_head,) * (max_ngram_size - 1),
                   max_ngram_size=max_ngram_size, n_head_per_ngram=n_head_per_ngram,
                   head_dim=head_dim, compressed_vocab_size=compressed_vocab_size, pad_id=0,
                   seed=seed)

    @classmethod
    def named(cls, name: str) -> EngramSpec:
        """A named configuration (demo, v4-flash, small, tiny) or a JSON file."""
        named = {
            "demo": cls.demo,
            "v4-flash": lambda: cls(layer_ids=(1, 14), engram_vocab_sizes=(16_000_000,) * 3,
                                    max_ngram_size=4, n_head_per_ngram=8, head_dim=256,
                                    compressed_vocab_size=99092, pad_id=2),
            "small": lambda: cls.small(rows_per_head=50_000, n_head_per_ngram=8, head_dim=256),
            "tiny": cls.small,
        }
        if name in named:
            return named[name]()
        if not os.path.lexists(name):
            raise SpecError(f"{name!r} is neither one of {sorted(named)} nor a readable JSON "
                            f"spec file (no such file)")
        # a regular file under a bound: a FIFO or /dev/zero is refused by name
        data = read_regular(name, "the spec file", error=SpecError)
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise SpecError(f"spec file {name!r} is not JSON; write the spec as a JSON object "
                            "(EngramSpec.to_dict()) or name one of "
                            f"{sorted(named)}") from None
        return cls.from_dict(doc)

    # ------------------------------------------------------------ derived --
    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def row_bytes(self) -> int:
        """FP8 weights plus one ue8m0 scale byte per block."""
        return self.head_dim + self.head_dim // self.block

    @property
    def scales_per_row(self) -> int:
        return self.head_dim // self.block

    @cached_property
    def _primes(self) -> dict[int, tuple[int, ...]]:
        used: set[int] = set()
        out = {}
        for layer in self.layer_ids:
            heads = []
            for order_size in self.engram_vocab_sizes:
                search = order_size - 1
                for _ in range(self.n_head_per_ngram):
                    prime = next_unused_prime(search, used)
                    used.add(prime)
                    heads.append(prime)
                    search = prime
            out[layer] = tuple(heads)
        return out

    def row_regions(self) -> tuple[tuple[str, int], ...]:
        """FP8 rows, then their ue8m0 scales (the ``TableFamily`` view)."""
        return (("weights", self.head_dim), ("scales", self.scales_per_row))

    def fixed_regions(self) -> tuple[tuple[str, int], ...]:
        return ()

    def check_shard(self, layer_id: int, shard: ShardInfo) -> None:
        """TopologyError unless ``shard`` is whole heads of the layer with
        their rows (``shard_heads``)."""
        sizes = self.bucket_sizes(layer_id)
        if not 0 <= shard.head_start < shard.head_end <= len(sizes):
            raise TopologyError(f"shard heads [{shard.head_start}, {shard.head_end}) are not "
                                f"heads of layer {layer_id} (0..{len(sizes)})")
        if (shard.row_start, shard.row_end) != (sum(sizes[:shard.head_start]),
                                                sum(sizes[:shard.head_end])):
            raise TopologyError(f"shard rows [{shard.row_start}, {shard.row_end}) are not the "
                                "rows of its heads; build it with shard_heads()")

    def shard_bytes(self, layer_id: int, num_shards: int, index: int) -> int:
        """Bytes of shard ``index`` of ``num_shards`` head-wise shards."""
        from .sharding import shard_heads

        return shard_heads(self.bucket_sizes(layer_id), num_shards, index).num_rows * \
            self.row_bytes

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.layer_ids:
            raise SpecError(f"layer {layer_id} has no Engram table; layers are {self.layer_ids}")

    def bucket_sizes(self, layer_id: int) -> tuple[int, ...]:
        """Prime bucket count of each hash head of the layer, in column order."""
        self._check_layer(layer_id)
        return self._primes[layer_id]

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """First table row of each head (prefix sums of the bucket sizes)."""
        return prefix_offsets(self.bucket_sizes(layer_id))

    def rows(self, layer_id: int) -> int:
        return int(sum(self.bucket_sizes(layer_id)))

    def table_bytes(self, layer_id: int | None = None) -> int:
        layers = self.layer_ids if layer_id is None else (layer_id,)
        return sum(self.rows(layer) for layer in layers) * self.row_bytes

    def multipliers(self, layer_id: int) -> np.ndarray:
        """The layer's odd int64 multipliers, one per n-gram position."""
        self._check_layer(layer_id)
        half_bound = max(1, (np.iinfo(np.int64).max // self.compressed_vocab_size) // 2)
        rng = np.random.default_rng(self.seed + LAYER_SEED_PRIME * layer_id)
        r = rng.integers(0, half_bound, size=self.max_ngram_size, dtype=np.int64)
        return r * 2 + 1

    def to_dict(self) -> dict:
        return {"layer_ids": list(self.layer_ids),
                "engram_vocab_sizes": list(self.engram_vocab_sizes),
                "max_ngram_size": self.max_ngram_size, "n_head_per_ngram": self.n_head_per_ngram,
                "head_dim": self.head_dim, "compressed_vocab_size": self.compressed_vocab_size,
                "pad_id": self.pad_id, "seed": self.seed, "block": self.block}

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike, token_map: Any) -> EngramSpec:
        """The spec of a DeepSeek V4.1 ``config.json`` (a dict or its path):
        engram fields at the top level or under ``text_config``.  The pad id
        is mapped through ``token_map`` (``build_token_map``'s result, or the
        map array), whose compressed size must equal the config's; each
        layer's ``engram_num_embeddings`` must equal the sum of its primes
        (else SpecMismatchError: the vocab size is wrong and every hash
        would be)."""
        doc = _engram_document(config)
        if token_map is None:
            raise SpecError("from_config needs token_map (build_token_map(tokenizer)): the "
                            "config's pad id is a tokenizer id and must be mapped")
        table, size = token_map if isinstance(token_map, tuple) else (
            token_map, int(np.max(token_map)) + 1)
        table = np.asarray(table, dtype=np.int64)
        field = _config_field(doc)
        compressed = field("engram_compressed_vocab_size")
        if size != compressed:
            raise SpecMismatchError(f"the token map has {size} compressed ids, the config's "
                                    f"engram_compressed_vocab_size is {compressed}: another "
                                    "tokenizer or normaliser")
        # vLLM 0.31.0 reads V4.1's shipped name; DeepSeek's model args call it engram_pad_id
        pad_name = next((n for n in PAD_FIELDS if n in doc), PAD_FIELDS[0])
        pad = field(pad_name)
        if not 0 <= pad < len(table):
            raise SpecError(f"{pad_name} {pad} is outside the token map of {len(table)} ids")
        return cls._of_fields(doc, int(table[pad]))

    @classmethod
    def storage_of_config(cls, config: dict | str | os.PathLike) -> EngramSpec:
        """The spec of a V4.1 config's tables, from the config alone (no
        tokenizer): every field as ``from_config`` reads it but the pad id,
        which is the pad token's compressed id through the tokenizer's map
        and decides no table byte (set to STORAGE_PAD_ID; the fingerprint
        leaves it out).  For storing and attaching tables, never for
        hashing token ids: that needs ``from_config``'s spec."""
        return cls._of_fields(_engram_document(config), STORAGE_PAD_ID)

    @classmethod
    def _of_fields(cls, doc: dict, pad_id: int) -> EngramSpec:
        """The spec of a config's Engram fields with the compressed
        ``pad_id``; each layer's ``engram_num_embeddings`` checked against
        its primes."""
        field = _config_field(doc)
        max_ngram = field("engram_max_ngram_size")
        vocab = field("engram_vocab_size", list_ok=True)
        vocab = vocab if isinstance(vocab, list) else [vocab] * (max_ngram - 1)
        spec = cls(layer_ids=field("engram_layer_ids", list_ok=True),
                   engram_vocab_sizes=vocab, max_ngram_size=max_ngram,
                   n_head_per_ngram=field("engram_n_heads"), head_dim=field("engram_head_dim"),
                   compressed_vocab_size=field("engram_compressed_vocab_size"), pad_id=pad_id)
        if "engram_num_embeddings" in doc:
            rows = field("engram_num_embeddings", list_ok=True)
            rows = rows if isinstance(rows, list) else [rows] * len(spec.layer_ids)
            if len(rows) != len(spec.layer_ids):
                raise SpecMismatchError(f"engram_num_embeddings has {len(rows)} entries, "
                                        f"engram_layer_ids {len(spec.layer_ids)}: one per layer")
            for layer, want in zip(spec.layer_ids, rows):
                if spec.rows(layer) != want:
                    raise SpecMismatchError(
                        f"layer {layer}: engram_num_embeddings is {want} but its primes "
                        f"sum to {spec.rows(layer)}: the config's engram_vocab_size does not "
                        "describe this checkpoint's table")
        return spec

    @classmethod
    def from_dict(cls, doc: dict) -> EngramSpec:
        if not isinstance(doc, dict):
            raise SpecError(f"an Engram spec is a JSON object of its fields, got "
                            f"{type(doc).__name__}")
        try:
            return cls(**doc)
        except TypeError as exc:
            raise SpecError(f"bad Engram spec {doc!r}: {exc}") from exc

    @property
    def fingerprint(self) -> bytes:
        """32 bytes that change when any config field of FINGERPRINT_FIELDS
        changes (the table's shape, rows and hashing parameters), computable
        from the config alone: the pad id, which needs the tokenizer's map
        and decides no table byte, is left out."""
        fields = self.to_dict()
        doc = json.dumps({"v": FINGERPRINT_VERSION, **{k: fields[k] for k in FINGERPRINT_FIELDS}},
                         sort_keys=True)
        return hashlib.sha256(doc.encode()).digest()


def _engram_document(config: dict | str | os.PathLike) -> dict:
    """The document holding a config's Engram fields (a dict or a
    config.json's path): the top level, or its ``text_config``."""
    doc = config if isinstance(config, dict) else _read_config(config)
    if not isinstance(doc, dict):
        raise SpecError(f"a config is a JSON object, got {type(doc).__name__}")
    if "engram_layer_ids" not in doc and isinstance(doc.get("text_config"), dict):
        return doc["text_config"]
    return doc


def _config_field(doc: dict) -> Callable[..., Any]:
    """A reader of the config's integer fields (a list of them where
    ``list_ok``), each type-checked: a null, float or string is a SpecError
    naming the field."""
    def field(name: str, list_ok: bool = False) -> Any:
        if name not in doc:
            raise SpecError(f"the config has no {name!r}; is it a DeepSeek V4.1 config.json "
                            "with Engram layers?")
        value = doc[name]
        if list_ok and isinstance(value, (list, tuple)):
            return [strict_int(v, f"config field {name!r} entry") for v in value]
        return strict_int(value, f"config field {name!r}")
    return field


def strict_int(value: Any, name: str) -> int:
    """An int (Python or numpy), never a float, bool, string or None, which
    int() would silently truncate or parse."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise SpecError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _int_tuple(values: Any, name: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise SpecError(f"{name} must be a sequence of integers, got {type(values).__name__} "
                        f"{values!r}")
    return tuple(strict_int(v, f"{name} entry") for v in values)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SpecError(f"{name} must be in {low}..{high}, got {value}")


def _read_config(path: str | os.PathLike) -> Any:
    """A config.json's document, read as a regular file under a bound."""
    data = read_regular(path, "the model's config", error=SpecError)
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise SpecError(f"{os.fspath(path)!r} is not JSON; pass the model's config.json") from None
