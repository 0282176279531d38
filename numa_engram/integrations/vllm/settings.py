"""The plugin's settings: ``--additional-config '{"numa_engram": {...}}'``,
checked at model construction (a bad key or value names the key and what
it accepts)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from ...errors import NumaEngramError
from ...literals import PageSize

PAGE_SIZES = ("4K", "2M", "1G")
COPIES = ("node", "socket")
PLACEMENTS = ("gpu-local", "interleave", "node:N")
KEYS = ("page_size", "placement", "copies", "service", "load_threads", "metrics_port",
        "directory", "service_uids", "allow_unsealed", "tier")
TIERS = ("resident", "mapped")
# what tier "mapped" has no use for, each with why: its rows are the
# checkpoint files' pages, which every rank maps itself and the page cache
# holds once per host (docs/design.md, "Tiers")
MAPPED_CONFLICTS = {
    "service": "a table service hands out resident tables it loaded; a mapped table needs "
               "none (every rank maps the checkpoint itself)",
    "service_uids": "it names the table service's uids, and a mapped table has no service",
    "allow_unsealed": "it is a table service's setting, and a mapped table has no service",
    "placement": "the page cache places a file's pages, no NUMA policy of the plugin does",
    "page_size": "the page cache's pages are 4 KiB (huge pages are the resident tier's)",
    "copies": "it chooses dp_shared copies, and the page cache already holds one copy per "
              "host for every rank",
    "directory": "it is dp_shared's table directory, and a mapped table makes no table file",
    "load_threads": "a mapped table loads nothing (its rows are read in place)",
}


class PluginError(NumaEngramError, RuntimeError):
    """The vLLM plugin cannot serve this configuration: what to change."""


@dataclass(frozen=True)
class PluginSettings:
    page_size: PageSize = "4K"
    placement: str = "gpu-local"
    copies: str = "node"            # DP-shared: one copy per node, or one per GPU socket
    service: str | None = None      # a table service's socket, "auto", or None
    load_threads: int | None = None
    metrics_port: int | None = None
    directory: str | None = None    # dp_shared's directory (None: /dev/shm or hugetlbfs)
    service_uids: tuple[int, ...] = ()
    allow_unsealed: bool = False
    tier: str = "resident"          # "mapped": rows read in place from vLLM's checkpoint files

    @classmethod
    def of(cls, additional_config: Any) -> PluginSettings:
        doc = (additional_config or {}).get("numa_engram", {}) \
            if isinstance(additional_config, dict) else {}
        if not isinstance(doc, dict):
            raise PluginError(f"additional_config numa_engram must be an object of "
                              f"{', '.join(KEYS)}, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(KEYS))
        if unknown:
            raise PluginError(f"additional_config numa_engram: unknown key(s) {unknown}; "
                              f"the keys are {', '.join(KEYS)}")
        out = cls(**doc)
        out.check(given=set(doc))
        return out

    def check(self, given: set[str] | None = None) -> None:
        """Each value, and the keys ``given`` (default: those not at their
        default) against the tier."""
        _one_of("tier", self.tier, TIERS)
        if self.tier == "mapped":
            self._check_mapped(self._given() if given is None else given)
        _one_of("page_size", self.page_size, PAGE_SIZES)
        _one_of("copies", self.copies, COPIES)
        if not (self.placement in PLACEMENTS[:2] or (
                isinstance(self.placement, str) and re.fullmatch(r"node:\d+", self.placement))):
            raise PluginError(f"additional_config numa_engram.placement is {self.placement!r};"
                              f" accepted: {', '.join(PLACEMENTS)}")
        if self.service is not None and not (isinstance(self.service, str) and self.service):
            raise PluginError(f"additional_config numa_engram.service is {self.service!r}; "
                              "accepted: a table service's socket path, \"auto\", or null")
        if self.directory is not None and not (isinstance(self.directory, str)
                                               and self.directory):
            raise PluginError(f"additional_config numa_engram.directory is {self.directory!r}; "
                              "accepted: one directory's path (a tmpfs or hugetlbfs mount), "
                              "or null")
        for key in ("load_threads", "metrics_port"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= 65535):
                raise PluginError(f"additional_config numa_engram.{key} is {value!r}; "
                                  "accepted: an integer from 1 to 65535, or null")
        if not isinstance(self.allow_unsealed, bool):
            raise PluginError("additional_config numa_engram.allow_unsealed must be true or "
                              "false")
        if not isinstance(self.service_uids, (list, tuple)) or not all(
                isinstance(u, int) and not isinstance(u, bool) and u >= 0
                for u in self.service_uids):
            raise PluginError("additional_config numa_engram.service_uids must be a list of "
                              "uids")

    def _given(self) -> set[str]:
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}

    def _check_mapped(self, given: set[str]) -> None:
        """Tier "mapped" with a key it has no use for (given, and not null,
        empty or false; page_size other than 4K): a PluginError naming each
        such key, why, and what to do."""
        clash = [key for key in MAPPED_CONFLICTS if key in given
                 and getattr(self, key) not in (None, (), [], False)
                 and not (key == "page_size" and self.page_size == "4K")]
        if clash:
            why = "; ".join(f"{key}: {MAPPED_CONFLICTS[key]}" for key in clash)
            raise PluginError(f"additional_config numa_engram.tier is \"mapped\" with "
                              f"{', '.join(clash)}, which it has no use for ({why}): drop "
                              f"{', '.join(clash)}, or use tier \"resident\" (the default) "
                              "for a table service, dp_shared copies, a placement or huge "
                              "pages")

    def check_metrics_port(self, ranks: int) -> None:
        """Each of ``ranks`` workers serves ``metrics_port`` + its global
        rank: every one of those ports must be a port."""
        port = self.metrics_port
        if port is not None and port + ranks - 1 > 65535:
            raise PluginError(f"additional_config numa_engram.metrics_port is {port}; the "
                              f"{ranks} workers serve metrics_port + their rank, up to "
                              f"{port + ranks - 1}, past 65535: choose a port from 1 to "
                              f"{65536 - ranks}")


def settings_of(config: Any) -> PluginSettings:
    """The settings of vLLM's ``config``, checked (the metrics ports
    against this world's size)."""
    import torch.distributed as dist

    settings = PluginSettings.of(getattr(config, "additional_config", None))
    settings.check_metrics_port(dist.get_world_size() if dist.is_initialized() else 1)
    return settings


def _one_of(key: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise PluginError(f"additional_config numa_engram.{key} is {value!r}; accepted: "
                          f"{', '.join(accepted)}")
