"""The per-layer line the plugin logs at INFO under vLLM's ``vllm`` logger,
one per table once its rows are in: family, layer and rows, mode, source
(built: loaded by vLLM's loader into a table made here; attached: from
the table service), page size, bytes and pages per NUMA node."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm." + __name__)


def page_size(table: Any) -> int:
    """The table's page size in bytes (its backing file's)."""
    backing = getattr(table, "_backing", None) or table.backing
    return int(backing.layout.page_size)


def layer_line(family: str, table: Any, where: str, source: str, extra: str = "") -> dict:
    """Log the layer's line; what it says, as a dict."""
    from ...host.hugepages import name_of

    report = table.placement_report(refresh=False)
    doc = {"family": family, "layer": table.layer_id, "where": where, "mode": table.mode,
           "source": source, "page_size": name_of(page_size(table)),
           "bytes": table.backing_bytes,
           "pages_per_node": None if report is None else report.pages_per_node()}
    log.info("numa_engram: %s layer %d %s: %s, source %s, %s pages, %d bytes, pages per node "
             "%s%s", family, doc["layer"], where, doc["mode"], source, doc["page_size"],
             doc["bytes"], doc["pages_per_node"], extra)
    return doc
