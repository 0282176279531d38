"""What every patch shares: which of vLLM's modules were patched (and what
was wrong with each), the settings' presence, and a line logged once per
engine."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm." + __name__)

# module name -> None (patched as checked) or why it was left unpatched
FIRED: dict[str, str | None] = {}


def settings_given(config: Any) -> bool:
    """Whether the operator asked for the plugin (--additional-config
    '{"numa_engram": ...}'): an unpatched vLLM is then an error, else vLLM
    runs as it would without the plugin."""
    extra = getattr(config, "additional_config", None)
    return isinstance(extra, dict) and "numa_engram" in extra


def fired(module: str) -> tuple[bool, str | None]:
    """(whether the hook ran for ``module``, why it left it unpatched)."""
    return module in FIRED, FIRED.get(module)


def say_once(config: Any, key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    """A line (INFO unless ``level``), once per engine."""
    from .placement import engine

    said = engine(config).said
    if key not in said:
        said.add(key)
        log.log(level, message, *args)
