"""The plugin's settings: ``--additional-config '{"numa_engram": {...}}'``,
checked at model construction (a bad key or value names the key and what
it accepts)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import NumaEngramError
from ...literals import PageSize

PAGE_SIZES = ("4K", "2M", "1G")
COPIES = ("node", "socket")
PLACEMENTS = ("gpu-local", "interleave", "node:N")
KEYS = ("page_size", "placement", "copies", "service", "load_threads", "metrics_port",
        "directory", "service_uids", "allow_unsealed")


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
        out.check()
        return out

    def check(self) -> None:
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
