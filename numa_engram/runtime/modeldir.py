"""A model directory as DeepSeek ships one: ``config.json`` (the Engram
fields at the top level or under ``text_config``), a tokenizer
(``tokenizer.json``), and the checkpoint (``model.safetensors.index.json``
and its files, or plain ``*.safetensors``).

``ModelDirectory.open`` reads and checks the config and the tokenizer;
``checkpoint_plans()`` resolves every layer's tensors in the checkpoint
once, before any table is made (what building the tables needs; a table
service's client does not).  ``write_synthetic_model`` writes a directory
at any size (for tests, the demo and benchmarks).  No torch here except in
the writer, when it is called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoints.checkpoint import CheckpointPlan, resolve_layers
from ..errors import CheckpointError, SpecError
from ..model.spec import EngramSpec, strict_int
from ..model.tokenmap import build_token_map
from ..userfiles import printable, read_regular

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
IMAGE_FIELD = "image_token_id"  # the image placeholder: DEAD in the history
V41_BLOCK = 32  # the ue8m0 scale block V4.1 ships (the config does not carry it)


@dataclass(frozen=True)
class ModelDirectory:
    """What a model directory says about its Engram layers."""

    path: str
    config: dict            # the document the Engram fields are in
    spec: EngramSpec
    token_map: np.ndarray   # tokenizer id -> compressed id (int64)
    dead_ids: tuple[int, ...]  # tokenizer ids that are DEAD wherever they appear
    # checkpoint_plans(), resolved at its first call
    _plans: dict[int, CheckpointPlan] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer: Any = None) -> ModelDirectory:
        """Read ``config.json`` and the tokenizer (``tokenizer``: a
        ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer object;
        None: the directory's ``tokenizer.json``, else the config's
        ``engram_token_map``), and build the spec (``EngramSpec.from_config``:
        sizes checked against ``engram_num_embeddings``)."""
        root = os.path.abspath(os.fspath(path))
        if not os.path.isdir(root):
            raise CheckpointError(f"model directory {root!r} does not exist or is not a "
                                  "directory; pass the directory holding config.json")
        top = read_config(root)
        doc = engram_fields(top)
        table, size = _token_map(root, doc, tokenizer)
        config = os.path.join(root, CONFIG_FILE)
        try:
            spec = EngramSpec.from_config(doc, (table, size))
        except SpecError as exc:  # named by its file (a subclass keeps its own message)
            if type(exc) is not SpecError:
                raise
            raise SpecError(f"{config}: {exc}") from None
        dead = tuple(sorted({token_id(d[IMAGE_FIELD], f"{config}: {IMAGE_FIELD}")
                             for d in (top, doc) if d.get(IMAGE_FIELD) is not None}))
        return cls(root, doc, spec, table, dead)

    @property
    def checkpoint(self) -> str:
        """What ``SharedEngramTable.create(checkpoint=)`` reads: the directory
        (its index, or its .safetensors files)."""
        return self.path

    def checkpoint_plans(self) -> dict[int, CheckpointPlan]:
        """Every Engram layer's two tensors in the checkpoint, resolved once
        (files, offsets, dtypes, shapes and the spec metadata checked: a
        missing or misshapen layer is a CheckpointError naming it before any
        table is made); ``create(checkpoint=plans[layer])`` reads through
        them and refuses a file that changed since."""
        if not self._plans:  # (the index and each file's header read once)
            self._plans.update(resolve_layers(self.path, self.spec, self.spec.layer_ids))
        return dict(self._plans)


MAX_TOKEN_ID = (1 << 31) - 1  # tokenizer ids are int32 in every engine


def token_id(value: Any, name: str) -> int:
    """A tokenizer id: an integer in [0, 2^31)."""
    value = strict_int(value, name)
    if not 0 <= value <= MAX_TOKEN_ID:
        raise SpecError(f"{name} is {value}, not a token id (0 ..= {MAX_TOKEN_ID})")
    return value


def read_config(root: str) -> dict:
    """The model directory's config.json, as a JSON object."""
    return read_config_file(os.path.join(root, CONFIG_FILE))


def read_config_file(path: str) -> dict:
    """A config.json as a JSON object: a regular file (never a FIFO or a
    device) of at most MAX_DOCUMENT_BYTES."""
    root = os.path.dirname(path)
    if not os.path.lexists(path):
        raise CheckpointError(f"{printable(root)} has no {CONFIG_FILE}: a model directory "
                              "holds the model's config.json, tokenizer and checkpoint")
    data = read_regular(path, "the model's config", error=CheckpointError)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise SpecError(f"{printable(path)} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{printable(path)} holds a {type(doc).__name__}, not a JSON object")
    return doc


def engram_fields(config: dict) -> dict:
    """The document holding the Engram fields: the top level, or
    ``text_config`` of a multimodal config."""
    if "engram_layer_ids" in config:
        return config
    text = config.get("text_config")
    if isinstance(text, dict) and "engram_layer_ids" in text:
        return text
    raise SpecError("the config has no engram_layer_ids (neither at the top level nor under "
                    "text_config): is it a DeepSeek V4.1 config.json with Engram layers?")


def _token_map(root: str, doc: dict, tokenizer: Any) -> tuple[np.ndarray, int]:
    if tokenizer is not None:
        return build_token_map(tokenizer)
    path = os.path.join(root, TOKENIZER_FILE)
    if os.path.lexists(path):
        return build_token_map(read_tokenizer(path))
    if "engram_token_map" in doc:  # some test configs carry the map itself
        table = _listed_token_map(doc["engram_token_map"],
                                  f"{os.path.join(root, CONFIG_FILE)}: engram_token_map")
        return table, int(table.max()) + 1 if table.size else 0
    raise SpecError(f"{root} has no {TOKENIZER_FILE} and the config no engram_token_map: the "
                    "token map comes from the model's tokenizer; pass tokenizer= (a "
                    "tokenizers or transformers tokenizer)")


def read_tokenizer(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json (a regular file read
    under a bound: not by Tokenizer.from_file, whose open of a FIFO blocks
    in native code, where no signal ends it)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise SpecError("reading tokenizer.json needs the 'tokenizers' package: pip "
                        "install 'numa_engram[tokenizer]', or pass tokenizer=") from exc
    data = read_regular(path, "the tokenizer", error=SpecError)
    try:
        return Tokenizer.from_str(data.decode())
    except Exception as exc:  # tokenizers raises a bare Exception for any bad file
        raise SpecError(f"{path} is not a tokenizer the 'tokenizers' package can read: "
                        f"{str(exc)[:200]}; pass the model's own tokenizer.json, or "
                        "tokenizer=") from None


def _listed_token_map(value: Any, name: str) -> np.ndarray:
    """A config's own token map: a list of compressed ids (each in [0, 2^31))."""
    if not isinstance(value, list):
        raise SpecError(f"{name} must be a list of compressed ids, got {type(value).__name__}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID:
            raise SpecError(f"{name}[{i}] is {v!r}: each entry is a compressed id, an integer "
                            f"in 0 ..= {MAX_TOKEN_ID}")
    return np.asarray(value, dtype=np.int64)


# ---------------------------------------------------------------- writer --

def synthetic_tokenizer(compressed_vocab_size: int, aliases: int = 0,
                        image_token: str | None = "<|image|>") -> Any:
    """A word-level tokenizer whose V4.1 token map has exactly
    ``compressed_vocab_size`` ids: ids 0..C-1 are distinct words (compressed
    id = tokenizer id; the last one the image token), then ``aliases``
    upper-case spellings of the first words, which share their ids."""
    from tokenizers import Tokenizer, models

    words = [f"w{i}" for i in range(compressed_vocab_size)]
    if image_token is not None:
        words[-1] = image_token
    words += [f"W{i}" for i in range(min(aliases, compressed_vocab_size - 1))]
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))


def model_config(spec: EngramSpec, image_token_id: int | None,
                 vocab_size: int | None = None) -> dict:
    """config.json as V4.1 ships it: the Engram fields under text_config,
    beside the text model's fields vLLM needs to build V4.1 (``vocab_size``:
    the tokenizer's; None: the compressed vocabulary's)."""
    from ..checkpoints.synthetic import V41_ARCHITECTURE, V41_MODEL_TYPE, v41_text_model

    vocab = list(spec.engram_vocab_sizes)
    text = {**v41_text_model(spec, vocab_size or spec.compressed_vocab_size),
            "engram_layer_ids": list(spec.layer_ids),
            "engram_vocab_size": vocab[0] if len(set(vocab)) == 1 else vocab,
            "engram_max_ngram_size": spec.max_ngram_size,
            "engram_n_heads": spec.n_head_per_ngram, "engram_head_dim": spec.head_dim,
            "engram_compressed_vocab_size": spec.compressed_vocab_size,
            "engram_pad_token_id": spec.pad_id,  # tokenizer id = compressed id here
            "engram_num_embeddings": [spec.rows(layer) for layer in spec.layer_ids]}
    doc: dict[str, Any] = {"model_type": V41_MODEL_TYPE, "architectures": [V41_ARCHITECTURE],
                           "text_config": text}
    if image_token_id is not None:
        doc[IMAGE_FIELD] = image_token_id
    return doc


def write_synthetic_model(path: str | os.PathLike, spec: EngramSpec, *, seed: int = 0,
                          shards: int = 2, aliases: int = 16, image_token: bool = True,
                          layers: Sequence[int] | None = None, raw: bool = False) -> Path:
    """A model directory as DeepSeek ships one, for ``spec``: config.json with
    text_config, a tokenizer.json built with ``tokenizers``, and the Engram
    tensors (V4.1 names, FP8 weights and ue8m0 scales) in ``shards``
    safetensors files with model.safetensors.index.json.  The tokenizer's
    ids 0..C-1 are the compressed ids (the last one the image placeholder
    when ``image_token``), then ``aliases`` ids that share compressed ids.
    ``raw``: random bytes streamed into one file without torch (for tables
    of many GiB), instead of quantised normals."""
    from ..checkpoints.synthetic import write_raw_checkpoint, write_synthetic_checkpoint

    if spec.seed != 0 or spec.block != V41_BLOCK:
        raise SpecError(f"a model directory's config carries neither the hash seed nor the "
                        f"scale block: V4.1 uses seed 0 and block {V41_BLOCK}, the spec has "
                        f"seed {spec.seed} and block {spec.block}")
    if image_token and spec.pad_id == spec.compressed_vocab_size - 1:
        raise SpecError("the pad id is the last compressed id, which the image token takes; "
                        "pass image_token=False or another pad_id")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    image_id = spec.compressed_vocab_size - 1 if image_token else None
    tok = synthetic_tokenizer(spec.compressed_vocab_size, aliases,
                              "<|image|>" if image_token else None)
    tok.save(str(root / TOKENIZER_FILE))
    (root / CONFIG_FILE).write_text(json.dumps(
        model_config(spec, image_id, tok.get_vocab_size()), indent=2))
    if raw:
        write_raw_checkpoint(root / "model.safetensors", spec, seed=seed, layers=layers)
    elif shards == 1:
        write_synthetic_checkpoint(root / "model.safetensors", spec, seed=seed, layers=layers)
    else:
        write_synthetic_checkpoint(root, spec, seed=seed, shards=shards, layers=layers)
    return root
