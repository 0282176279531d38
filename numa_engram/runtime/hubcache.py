"""A model named by its Hugging Face hub id (``ORG/NAME``), found in the
local hub cache as ``huggingface_hub`` lays it out: ``models--ORG--NAME/
snapshots/<revision>/`` under ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
``~/.cache/huggingface/hub``, the revision read from ``refs/main``.  Nothing
is downloaded: a model not in the cache is an error saying how to get it."""

from __future__ import annotations

import os
import re

from ..errors import CheckpointError
from ..userfiles import printable, read_regular

# huggingface_hub's repo id: an optional namespace, a name of [\w.-]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
REVISION = re.compile(r"[0-9a-f]{40}")
MAX_REF_BYTES = 4096


def hub_caches() -> list[str]:
    """The hub cache directories, in huggingface_hub's order of precedence."""
    if os.environ.get("HF_HUB_CACHE"):
        return [os.environ["HF_HUB_CACHE"]]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return [os.path.join(home, "hub")]


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id (and not as a path: no leading
    dot or slash, one slash)."""
    return HUB_ID.fullmatch(name) is not None and ".." not in name


def model_path(name: str) -> str:
    """``name`` itself where it exists (a local directory, or what the
    caller then names as missing); a hub id's cached snapshot directory;
    else a CheckpointError naming the caches looked in and the download
    command."""
    if os.path.lexists(name) or not is_hub_id(name):
        return name
    org, repo = name.split("/")
    looked = []
    for cache in hub_caches():
        root = os.path.join(cache, f"models--{org}--{repo}")
        looked.append(root)
        snapshot = _snapshot(root)
        if snapshot is not None:
            return snapshot
    where = ", ".join(map(printable, looked))
    raise CheckpointError(f"{printable(name)} is neither a local directory nor a model in the "
                          f"local Hugging Face cache (looked for {where} with a snapshot "
                          "named by refs/main); numa-engram downloads nothing: "
                          f"run `huggingface-cli download {printable(name)}` first, or pass the "
                          "model's directory")


def _snapshot(root: str) -> str | None:
    """The snapshot ``refs/main`` names under a cached repo ``root``, None
    where the cache lacks it."""
    ref = os.path.join(root, "refs", "main")
    if not os.path.isfile(ref):
        return None
    revision = read_regular(ref, "the hub cache's refs/main", limit=MAX_REF_BYTES,
                            error=CheckpointError).decode(errors="replace").strip()
    if REVISION.fullmatch(revision) is None:
        raise CheckpointError(f"{printable(ref)} holds {printable(revision[:80])!s}, not a "
                              "commit hash: a damaged hub cache; download the model again")
    snapshot = os.path.join(root, "snapshots", revision)
    return snapshot if os.path.isdir(snapshot) else None
