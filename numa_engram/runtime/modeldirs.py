"""A model directory of either family, opened as its config.json says:
the family (``model.families.family_of_config``) picks the directory
class, so ``serve`` and ``profile`` never sniff a config themselves."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..model.families import Family, family_of_config
from .modeldir import ModelDirectory, read_config
from .plemodeldir import PLEModelDirectory

AnyModelDirectory = ModelDirectory | PLEModelDirectory

# (path, tokenizer) -> the directory; PLE hashes raw token ids: no tokenizer
OPENERS: dict[str, Callable[[str, Any], AnyModelDirectory]] = {
    "engram": ModelDirectory.open,
    "ple": lambda path, _tokenizer: PLEModelDirectory.open(path),
}


def family_of_directory(path: str) -> Family:
    """The family of the directory's config.json (read as a regular file
    under a bound: a FIFO or device is refused); Engram's for a path that
    is no directory (``ModelDirectory.open`` names what is wrong)."""
    if not os.path.isdir(path):
        return family_of_config(None)
    return family_of_config(read_config(os.path.abspath(path)))


def open_model_directory(path: str, tokenizer: Any = None) -> AnyModelDirectory:
    """The model directory at ``path``, of the family its config describes."""
    return OPENERS[family_of_directory(path).name](path, tokenizer)
