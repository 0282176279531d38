"""A Qwen4-Exp model directory as the table service reads it: its
``config.json`` (the PLE fields, read as vLLM reads them) and its
safetensors checkpoint (vLLM's split parts).  No tokenizer: PLE hashes raw
token ids."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..checkpoints.plecheckpoint import PLECheckpointPlan, resolve_ple_layers
from ..errors import SpecError
from ..model.ple import PLESpec
from .modeldir import CONFIG_FILE, read_config_file


@dataclass(frozen=True)
class PLEModelDirectory:
    path: str
    spec: PLESpec

    @property
    def checkpoint(self) -> str:
        """The safetensors files: the directory itself."""
        return self.path

    def checkpoint_plans(self) -> dict[int, PLECheckpointPlan]:
        """Every PLE layer's parts and scale in the checkpoint, resolved once
        (the index and each file's header read once; a missing or misshapen
        layer is a CheckpointError naming it before any table is made);
        ``create(checkpoint=plans[layer])`` reads through them and refuses a
        file that changed since."""
        return resolve_ple_layers(self.path, self.spec, self.spec.layer_ids)

    @classmethod
    def open(cls, path: str | os.PathLike,
             tokenizer: Any = None) -> PLEModelDirectory:  # noqa: ARG003 (raw token ids)
        """The directory at ``path`` (``tokenizer``: Engram's, unused here)."""
        root = os.path.abspath(os.fspath(path))
        config = os.path.join(root, CONFIG_FILE)
        doc = read_config_file(config)  # a regular file under a bound, or an error naming it
        try:
            return cls(root, PLESpec.from_config(doc))
        except SpecError as exc:
            raise SpecError(f"{config}: {exc}") from None
