"""Patch of V4.1's VL model module (``nvidia/vl_model.py``, 0.31-0.34).

Replaces: ``_make_deepseek_v4_vl_weights_mapper``; wraps
``DeepseekV41ForCausalLM.load_weights`` (the end of vLLM's load).

Why: an engine whose Engram tables came from a table service has their
rows already; vLLM's loader would read every Engram tensor of the
checkpoint again (gigabytes per layer) only to check its shape.

How: the mapper the VL model makes (after its language model, so after
every Engram layer is built) gets one more rule first: the Engram tensors
of exactly the layers this engine attached map to None, which vLLM's
``WeightsMapper`` drops.  It is also the model's construction point where
the plugin checks that the Engram hook fired: a vLLM whose Engram module
the plugin did not patch (a moved module, an unknown release) is a
PluginError there when the plugin's settings were given.

Mirrors: vLLM's own "maps to None: dropped" rule (``WeightsMapper``,
``model_executor/models/utils.py``).

Removable: when vLLM skips loading a parameter its storage reports as
already filled (no release up to 0.34 has such a flag).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable
from typing import Any

from . import manifest
from .patches import FIRED, fired, settings_given
from .settings import PluginError

log = logging.getLogger("vllm." + __name__)

PATCHED = "_numa_engram_patched"


def engram_tensors(layers: Iterable[int]) -> re.Pattern[str]:
    """V4.1's index names of the Engram tensors of ``layers`` (with or
    without "model."): what the mapper drops for the layers attached."""
    ids = "|".join(str(layer) for layer in sorted(layers))
    return re.compile(rf"^(model\.)?layers\.({ids})\.engram\.embed\.(weight|scale)$")


def patch(vl: Any) -> None:
    """Patch ``vl`` in place; idempotent."""
    if getattr(vl, PATCHED, False):
        return
    setattr(vl, PATCHED, True)
    problem = manifest.module_problem(vl, manifest.VL) if hasattr(vl, "__file__") else None
    FIRED[getattr(vl, "__name__", manifest.VL)] = problem
    if manifest.missing_symbols(vl, manifest.VL):
        log.warning("numa_engram: %s", problem)
        return
    make = vl._make_deepseek_v4_vl_weights_mapper

    def mapper(*args: Any, **kwargs: Any) -> Any:
        from .placement import current_attached

        check_engram_hook()
        base = make(*args, **kwargs)
        attached = current_attached()
        if not attached:
            return base
        return type(base)(orig_to_new_regex={engram_tensors(attached): None}) | base

    mapper.__wrapped__ = make  # type: ignore[attr-defined]
    vl._make_deepseek_v4_vl_weights_mapper = mapper
    model = getattr(vl, "DeepseekV41ForCausalLM", None)
    if isinstance(model, type) and hasattr(model, "load_weights"):
        model.load_weights = _checked_load(model.load_weights)


def _checked_load(load_weights: Any) -> Any:
    """The VL model's ``load_weights`` (every checkpoint tensor of the model
    goes through it, in every release), then a check that each Engram table
    of ours under it holds the checkpoint's rows: a table neither loaded nor
    attached is a PluginError at the end of the load, never zeros at the
    first forward (vLLM's dummy load writes every table itself and skips
    this; TableStorage.get_views checks again at the first forward)."""
    def load(self: Any, weights: Any) -> Any:
        from .layers import check_loaded

        loaded = load_weights(self, weights)
        check_loaded(self)
        return loaded

    load.__wrapped__ = load_weights  # type: ignore[attr-defined]
    return load


def check_engram_hook() -> None:
    """At the V4.1 model's construction: where the plugin's settings were
    given, its Engram hook fired and patched the module as checked."""
    config = importlib.import_module("vllm.config").get_current_vllm_config()
    if not settings_given(config):
        return
    rel = manifest.release()
    name = manifest.module_name("engram", rel)
    ran, problem = fired(name)
    if not ran:
        others = sorted(m for m in FIRED if "deepseek_v41" in m)
        raise PluginError(f"the numa_engram plugin's hook for vLLM "
                          f"{manifest.vllm_version()}'s {name} never fired (patched: "
                          f"{others or 'none'}): the model's Engram tables are vLLM's own, "
                          f"not the plugin's; {manifest.INSTALL}")
    if problem:
        raise PluginError(problem)
    vl_problem = FIRED.get(manifest.VL)
    if vl_problem:
        raise PluginError(vl_problem)
