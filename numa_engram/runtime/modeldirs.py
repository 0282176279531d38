"""A model directory of any family, opened as its config.json says: the
family (``model.families.family_of_config``) names its directory class
(``Family.directory``), so ``serve`` and ``profile`` never sniff a config
themselves."""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..model.families import Family, family_of_config
from .modeldir import read_config


class FamilyModelDirectory(Protocol):
    """What ``serve``, ``profile`` and the table service read of a model
    directory, whatever its family (``ModelDirectory``, ``PLEModelDirectory``)."""

    path: str

    @property
    def spec(self) -> Any: ...

    @property
    def checkpoint(self) -> str: ...

    def checkpoint_plans(self) -> dict[int, Any]: ...


def family_of_directory(path: str) -> Family:
    """The family of the directory's config.json (read as a regular file
    under a bound: a FIFO or device is refused); Engram's for a path that
    is no directory (``ModelDirectory.open`` names what is wrong)."""
    if not os.path.isdir(path):
        return family_of_config(None)
    return family_of_config(read_config(os.path.abspath(path)))


def open_model_directory(path: str, tokenizer: Any = None) -> FamilyModelDirectory:
    """The model directory at ``path``, of the family its config describes
    (``tokenizer``: for a family that maps token ids through one)."""
    directory: FamilyModelDirectory = \
        family_of_directory(path).part("directory").open(path, tokenizer)
    return directory
