"""PLESpec: what decides the bytes and the hashes of Qwen4-Exp's n-gram
per-layer-embedding (PLE) tables, as vLLM 0.31.0's ``qwen4_exp`` code
derives them from ``config.json``.

Per PLE layer (``dense``: its index among the sorted, 1-based
``ple_layer_ids``) there are ``(ngram_size - 1) * heads_per_ngram`` hash
heads; head h's bucket count is the ``(dense * n_heads + h + 1)``-th prime
above ``ngram_vocab_size_base - 1``, the heads laid end to end and the
layer's rows padded to a multiple of ``make_ngram_vocab_size_divisible_by``.
A row is ``ple_embed_dim / n_heads`` values: FP8 (e4m3) with one fp32
scale for the whole table, or BF16.  The rows are sharded by row ranges
(vLLM's ``VocabParallelEmbedding`` over the ETP group), not by heads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import SpecError, TopologyError
from ..userfiles import read_regular
from .sharding import ShardInfo
from .spec import _check_range, _int_tuple, is_prime, strict_int

PLEDtype = Literal["float8_e4m3fn", "bfloat16"]
PLE_DTYPES: tuple[PLEDtype, ...] = ("float8_e4m3fn", "bfloat16")
LAYER_SEED_PRIME = 10007
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
DEFAULT_SEED = 1234           # vLLM's value when the config has none
DEFAULT_SPLIT_PARTS = 512     # likewise for split_ngram_parts
FINGERPRINT_VERSION = 1
MAX_NGRAM_SIZE = 64
MAX_HEADS = 1024
MAX_PRIMES = 1 << 16          # the sequential prime search costs ~20 us a prime
MAX_VOCAB = 2**40


def splitmix64(value: int) -> int:
    """One splitmix64 step of ``value`` (unsigned 64-bit arithmetic)."""
    value = (value + SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def primes_above(start: int, count: int) -> tuple[int, ...]:
    """The ``count`` smallest primes strictly greater than ``start``."""
    out: list[int] = []
    candidate = max(start + 1, 2)
    if candidate > 2 and candidate % 2 == 0:
        candidate += 1
    while len(out) < count:
        if is_prime(candidate):
            out.append(candidate)
        candidate += 1 if candidate == 2 else 2
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PLESpec:
    """Fields named as in Qwen4-Exp's ``config.json``; ``layer_ids`` are its
    1-based ``ple_layer_ids``, stored sorted and distinct."""

    layer_ids: Sequence[int]
    ple_embed_dim: int
    vocab_size: int
    eos_token_id: int
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = DEFAULT_SEED
    split_ngram_parts: int = DEFAULT_SPLIT_PARTS
    dtype: PLEDtype = "float8_e4m3fn"

    def __post_init__(self) -> None:
        ids = _int_tuple(self.layer_ids, "ple_layer_ids")
        object.__setattr__(self, "layer_ids", tuple(sorted(set(ids))))
        for name in ("ple_embed_dim", "vocab_size", "eos_token_id", "ngram_size",
                     "heads_per_ngram", "ngram_vocab_size_base",
                     "make_ngram_vocab_size_divisible_by", "seed", "split_ngram_parts"):
            object.__setattr__(self, name, strict_int(getattr(self, name), name))
        self._validate()

    def _validate(self) -> None:
        if not self.layer_ids or self.layer_ids[0] < 1:
            raise SpecError(f"ple_layer_ids must be 1-based layer numbers, got {self.layer_ids}")
        _check_range("ngram_size", self.ngram_size, 2, MAX_NGRAM_SIZE)
        _check_range("heads_per_ngram", self.heads_per_ngram, 1, MAX_HEADS)
        _check_range("vocab_size", self.vocab_size, 1, 2**31)
        _check_range("eos_token_id", self.eos_token_id, 0, self.vocab_size - 1)
        _check_range("ngram_vocab_size_base", self.ngram_vocab_size_base, 2, MAX_VOCAB)
        _check_range("make_ngram_vocab_size_divisible_by",
                     self.make_ngram_vocab_size_divisible_by, 1, 1 << 20)
        _check_range("split_ngram_parts", self.split_ngram_parts, 1, 1 << 24)
        _check_range("seed", self.seed, 0, 2**63 - 1)
        if self.ple_embed_dim <= 0 or self.ple_embed_dim % self.n_heads:
            raise SpecError(f"ple_embed_dim {self.ple_embed_dim} must be a positive multiple of "
                            f"the {self.n_heads} n-gram heads ((ngram_size - 1) x "
                            "heads_per_ngram)")
        if len(self.layer_ids) * self.n_heads > MAX_PRIMES:
            raise SpecError(f"{len(self.layer_ids)} PLE layers x {self.n_heads} heads need more "
                            f"than {MAX_PRIMES} primes")
        if self.dtype not in PLE_DTYPES:
            raise SpecError(f"dtype must be one of {PLE_DTYPES}, got {self.dtype!r}")

    # ------------------------------------------------------------ derived --
    @property
    def n_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        """Values in a row: a head's slice of ``ple_embed_dim``."""
        return self.ple_embed_dim // self.n_heads

    @property
    def n_hash_cols(self) -> int:
        """Ids per token and layer: one per head."""
        return self.n_heads

    @property
    def row_bytes(self) -> int:
        return self.head_dim * (1 if self.dtype == "float8_e4m3fn" else 2)

    def dense_index(self, layer_id: int) -> int:
        """The layer's index among the sorted PLE layers (vLLM's
        ``ple_dense_layer_id``)."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise SpecError(f"layer {layer_id} has no PLE table; PLE layers are "
                            f"{self.layer_ids}") from None

    @cached_property
    def _primes(self) -> tuple[int, ...]:
        return primes_above(self.ngram_vocab_size_base - 1, len(self.layer_ids) * self.n_heads)

    def bucket_sizes(self, layer_id: int) -> tuple[int, ...]:
        """Prime bucket count of each head of the layer, in column order."""
        first = self.dense_index(layer_id) * self.n_heads
        return self._primes[first:first + self.n_heads]

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """First table row of each head."""
        sizes = np.asarray(self.bucket_sizes(layer_id), dtype=np.int64)
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

    def rows(self, layer_id: int) -> int:
        """The layer's table rows, padded as vLLM pads them."""
        pad = self.make_ngram_vocab_size_divisible_by
        return -(-sum(self.bucket_sizes(layer_id)) // pad) * pad

    def table_bytes(self, layer_id: int | None = None) -> int:
        layers = self.layer_ids if layer_id is None else (layer_id,)
        return sum(self.rows(layer) for layer in layers) * self.row_bytes

    def multipliers(self, layer_id: int) -> np.ndarray:
        """The layer's odd int64 multipliers, one per n-gram position."""
        half_bound = max(1, (((1 << 63) - 1) // self.vocab_size) // 2)
        base = self.seed + LAYER_SEED_PRIME * self.dense_index(layer_id)
        return np.array([2 * (splitmix64(base + SPLITMIX_GAMMA * (i + 1)) % half_bound) + 1
                         for i in range(self.ngram_size)], dtype=np.int64)

    def row_regions(self) -> tuple[tuple[str, int], ...]:
        """The rows (the ``TableFamily`` view)."""
        return (("weights", self.row_bytes),)

    def fixed_regions(self) -> tuple[tuple[str, int], ...]:
        """FP8: the table's fp32 scale (4 bytes); BF16: none."""
        return (("scale", 4),) if self.dtype == "float8_e4m3fn" else ()

    def shard(self, layer_id: int, rank: int, world: int) -> ShardInfo:
        """ETP rank ``rank``'s rows as a ShardInfo (every head: a PLE shard
        is a row range)."""
        start, end = self.shard_rows(layer_id, rank, world)
        return ShardInfo(0, self.n_heads, start, end, end - start)

    def shard_bytes(self, layer_id: int, num_shards: int, index: int) -> int:
        """Bytes of ETP row range ``index`` of ``num_shards``, its scale with it."""
        start, end = self.shard_rows(layer_id, index, num_shards)
        return (end - start) * self.row_bytes + sum(n for _, n in self.fixed_regions())

    def check_shard(self, layer_id: int, shard: ShardInfo) -> None:
        rows = self.rows(layer_id)
        if (shard.head_start, shard.head_end) != (0, self.n_heads) or not (
                0 <= shard.row_start < shard.row_end <= rows
                and shard.num_rows == shard.row_end - shard.row_start):
            raise TopologyError(f"{shard} is not a row range of PLE layer {layer_id} (0..{rows} "
                                "rows, every head); build it with PLESpec.shard()")

    def shard_rows(self, layer_id: int, rank: int, world: int) -> tuple[int, int]:
        """Rows ``[start, end)`` that ETP rank ``rank`` of ``world`` owns, as
        vLLM's ``VocabParallelEmbedding`` splits the padded table."""
        rows = self.rows(layer_id)
        if world < 1 or not 0 <= rank < world:
            raise TopologyError(f"rank {rank} is not in an ETP group of {world}")
        if rows % world:
            raise TopologyError(f"layer {layer_id}'s {rows} rows do not split evenly over {world} "
                            "ETP ranks (vLLM refuses it too)")
        per = rows // world
        return rank * per, (rank + 1) * per

    def part_rows(self, layer_id: int, part: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of checkpoint tensor ``shard_{part}``."""
        if not 0 <= part < self.split_ngram_parts:
            raise SpecError(f"checkpoint part {part} is outside 0..{self.split_ngram_parts - 1}")
        rows = self.rows(layer_id)
        size = -(-rows // self.split_ngram_parts)
        start = min(part * size, rows)
        return start, min(start + size, rows)

    def to_dict(self) -> dict:
        return {"layer_ids": list(self.layer_ids), "ple_embed_dim": self.ple_embed_dim,
                "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id,
                "ngram_size": self.ngram_size, "heads_per_ngram": self.heads_per_ngram,
                "ngram_vocab_size_base": self.ngram_vocab_size_base,
                "make_ngram_vocab_size_divisible_by": self.make_ngram_vocab_size_divisible_by,
                "seed": self.seed, "split_ngram_parts": self.split_ngram_parts,
                "dtype": self.dtype}

    @classmethod
    def from_dict(cls, doc: dict) -> PLESpec:
        if not isinstance(doc, dict):
            raise SpecError(f"a PLE spec is a JSON object of its fields, got "
                            f"{type(doc).__name__}")
        try:
            return cls(**doc)
        except TypeError as exc:
            raise SpecError(f"bad PLE spec {doc!r}: {exc}") from exc

    @property
    def fingerprint(self) -> bytes:
        """32 bytes that change when anything deciding the tables' bytes
        changes (not the hashing's: eos, vocab size and seed are left out,
        so a consumer that hashes itself needs none of them)."""
        doc = self.to_dict()
        for hashing_only in ("eos_token_id", "vocab_size", "seed"):
            del doc[hashing_only]
        text = json.dumps({"family": "ple", "v": FINGERPRINT_VERSION, **doc}, sort_keys=True)
        return hashlib.sha256(text.encode()).digest()

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike, *,
                    dtype: PLEDtype | None = None) -> PLESpec:
        """The spec of a Qwen4-Exp ``config.json`` (a dict or its path), read
        as vLLM reads it: fields under ``text_config`` or at the top level
        (never both), ``seed`` 1234 and ``split_ngram_parts`` 512 when absent.  ``dtype``
        defaults to ``ple_embedding_dtype``, else FP8 when the config has an
        FP8 ``quantization_config``, else BF16."""
        doc = config if isinstance(config, dict) else _read_json(Path(config))
        text = doc.get("text_config")
        fields = text if isinstance(text, dict) and "ple_layer_ids" in text else doc
        if "ple_layer_ids" not in fields or not fields["ple_layer_ids"]:
            raise SpecError("the config has no 'ple_layer_ids': is it a Qwen4-Exp config.json "
                            "with PLE layers?")
        # (Qwen4ExpConfig drops a top-level split_ngram_parts beside a
        # text_config: vLLM reads the text config's, 512 when it has none)
        known = {"ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000,
                 "make_ngram_vocab_size_divisible_by": 128, "seed": DEFAULT_SEED,
                 "split_ngram_parts": DEFAULT_SPLIT_PARTS}
        args: dict[str, Any] = {k: fields.get(k, v) for k, v in known.items()}
        for name in ("vocab_size", "eos_token_id"):
            if name not in fields:
                raise SpecError(f"the config has no {name!r} (PLE hashing needs it)")
            args[name] = fields[name]
        eos = args["eos_token_id"]
        if isinstance(eos, list):  # vLLM takes int(config.eos_token_id): one id
            raise SpecError(f"eos_token_id must be one integer, got the list {eos!r}")
        embed = fields.get("ple_embed_dim", fields.get("hidden_size"))
        if embed is None:
            raise SpecError("the config has neither 'ple_embed_dim' nor 'hidden_size'")
        return cls(layer_ids=_int_tuple(fields["ple_layer_ids"], "ple_layer_ids"),
                   ple_embed_dim=embed, dtype=dtype or _dtype_of(fields, doc), **args)


def _read_json(path: Path) -> dict:
    data = read_regular(path, "the model's config", error=SpecError)  # never a FIFO or device
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise SpecError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{path} is not a JSON object")
    return doc


def _dtype_of(fields: dict, doc: dict) -> PLEDtype:
    named = fields.get("ple_embedding_dtype", doc.get("ple_embedding_dtype"))
    if named is not None:
        if named not in PLE_DTYPES:
            raise SpecError(f"ple_embedding_dtype must be one of {PLE_DTYPES}, got {named!r}")
        return named
    quant = doc.get("quantization_config") or fields.get("quantization_config") or {}
    fp8 = isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8"
    return "float8_e4m3fn" if fp8 else "bfloat16"
