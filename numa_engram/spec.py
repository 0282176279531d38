"""EngramSpec: the configuration that decides a table's bytes.

Prime bucket sizes and multipliers are chosen exactly as DeepSeek's
reference demo chooses them (REFERENCE.md section 1): primes distinct across
the whole model, searched upwards from each order's engram vocab size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SpecError, SpecMismatchError

LAYER_SEED_PRIME = 10007
FINGERPRINT_VERSION = 1
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact below 3.3e24


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

    layer_ids: tuple[int, ...]
    engram_vocab_sizes: tuple[int, ...]
    max_ngram_size: int
    n_head_per_ngram: int
    head_dim: int
    compressed_vocab_size: int
    pad_id: int
    seed: int = 0
    block: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(x) for x in self.layer_ids))
        object.__setattr__(self, "engram_vocab_sizes",
                           tuple(int(x) for x in self.engram_vocab_sizes))
        self._validate()

    def _validate(self) -> None:
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise SpecError(f"layer_ids must be non-empty and distinct, got {self.layer_ids}")
        if min(self.layer_ids) < 0:
            raise SpecError(f"layer ids must be >= 0, got {self.layer_ids}")
        if self.max_ngram_size < 2:
            raise SpecError(f"max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if len(self.engram_vocab_sizes) != self.max_ngram_size - 1:
            raise SpecError(f"engram_vocab_sizes needs one size per order 2..{self.max_ngram_size}"
                            f" ({self.max_ngram_size - 1}), got {len(self.engram_vocab_sizes)}")
        if min(self.engram_vocab_sizes) < 2:
            raise SpecError(f"engram vocab sizes must be >= 2, got {self.engram_vocab_sizes}")
        if self.n_head_per_ngram < 1:
            raise SpecError(f"n_head_per_ngram must be >= 1, got {self.n_head_per_ngram}")
        if self.block < 1 or self.head_dim < 1 or self.head_dim % self.block:
            raise SpecError(f"head_dim {self.head_dim} must be a positive multiple of the scale "
                            f"block {self.block}")
        if self.compressed_vocab_size < 1:
            raise SpecError(f"compressed_vocab_size must be >= 1, got "
                            f"{self.compressed_vocab_size}")

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
        try:
            with open(name) as fh:
                return cls.from_dict(json.load(fh))
        except OSError as exc:
            raise SpecError(f"{name!r} is neither one of {sorted(named)} nor a readable JSON "
                            f"spec file ({exc.strerror})") from exc

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

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.layer_ids:
            raise SpecError(f"layer {layer_id} has no Engram table; layers are {self.layer_ids}")

    def bucket_sizes(self, layer_id: int) -> tuple[int, ...]:
        """Prime bucket count of each hash head of the layer, in column order."""
        self._check_layer(layer_id)
        return self._primes[layer_id]

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """First table row of each head (prefix sums of the bucket sizes)."""
        sizes = np.asarray(self.bucket_sizes(layer_id), dtype=np.int64)
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

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
        doc = config if isinstance(config, dict) else json.loads(Path(config).read_text())
        if "engram_layer_ids" not in doc and isinstance(doc.get("text_config"), dict):
            doc = doc["text_config"]
        if token_map is None:
            raise SpecError("from_config needs token_map (build_token_map(tokenizer)): the "
                            "config's pad id is a tokenizer id and must be mapped")
        table, size = token_map if isinstance(token_map, tuple) else (
            token_map, int(np.max(token_map)) + 1)
        table = np.asarray(table, dtype=np.int64)
        field = _config_field(doc)
        compressed = int(field("engram_compressed_vocab_size"))
        if size != compressed:
            raise SpecMismatchError(f"the token map has {size} compressed ids, the config's "
                                    f"engram_compressed_vocab_size is {compressed}: another "
                                    "tokenizer or normaliser")
        pad = int(field("engram_pad_id"))
        if not 0 <= pad < len(table):
            raise SpecError(f"engram_pad_id {pad} is outside the token map of {len(table)} ids")
        max_ngram = int(field("engram_max_ngram_size"))
        vocab = field("engram_vocab_size")
        vocab = [int(v) for v in vocab] if isinstance(vocab, (list, tuple)) else \
            [int(vocab)] * (max_ngram - 1)
        spec = cls(layer_ids=tuple(field("engram_layer_ids")), engram_vocab_sizes=tuple(vocab),
                   max_ngram_size=max_ngram, n_head_per_ngram=int(field("engram_n_heads")),
                   head_dim=int(field("engram_head_dim")), compressed_vocab_size=compressed,
                   pad_id=int(table[pad]))
        rows = doc.get("engram_num_embeddings")
        if rows is not None:
            rows = list(rows) if isinstance(rows, (list, tuple)) else [rows] * len(spec.layer_ids)
            for layer, want in zip(spec.layer_ids, rows):
                if spec.rows(layer) != int(want):
                    raise SpecMismatchError(
                        f"layer {layer}: engram_num_embeddings is {int(want)} but its primes "
                        f"sum to {spec.rows(layer)}: the config's engram_vocab_size does not "
                        "describe this checkpoint's table")
        return spec

    @classmethod
    def from_dict(cls, doc: dict) -> EngramSpec:
        try:
            return cls(**doc)
        except TypeError as exc:
            raise SpecError(f"bad Engram spec {doc!r}: {exc}") from exc

    @property
    def fingerprint(self) -> bytes:
        """32 bytes that change when anything deciding the table's bytes changes."""
        doc = json.dumps({"v": FINGERPRINT_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(doc.encode()).digest()


def _config_field(doc: dict):
    def field(name: str):
        if name not in doc:
            raise SpecError(f"the config has no {name!r}; is it a DeepSeek V4.1 config.json "
                            "with Engram layers?")
        return doc[name]
    return field
