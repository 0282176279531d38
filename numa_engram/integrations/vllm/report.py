"""The per-layer line the plugin logs at INFO under vLLM's ``vllm`` logger,
one per table once its rows are in: family, layer and rows, mode, source
(built: loaded by vLLM's loader into a table made here; attached: from
the table service; checkpoint: read in place from it, tier mapped), page
size, bytes, pages per NUMA node and tier."""

from __future__ import annotations

import logging
import mmap
from typing import Any

log = logging.getLogger("vllm." + __name__)


def page_size(table: Any) -> int:
    """The table's page size in bytes (its backing file's; a mapped
    table's: the page cache's)."""
    if getattr(table, "tier", "resident") == "mapped":
        return mmap.PAGESIZE
    backing = getattr(table, "_backing", None) or table.backing
    return int(backing.layout.page_size)


def layer_line(family: str, table: Any, where: str, source: str, extra: str = "",
               served: dict[int, int] | None = None) -> dict:
    """Log the layer's line; what it says, as a dict (``served``: the pages
    per node of a table attached from the service, which has no placement
    plan here: ``served_pages_per_node``)."""
    from ...host.hugepages import name_of

    report = table.placement_report(refresh=False)
    per_node = report.pages_per_node() if report is not None else served
    doc = {"family": family, "layer": table.layer_id, "where": where, "mode": table.mode,
           "source": source, "page_size": name_of(page_size(table)),
           "bytes": table.backing_bytes,
           "pages_per_node": per_node, "tier": getattr(table, "tier", "resident")}
    log.info("numa_engram: %s layer %d %s: %s, source %s, %s pages, %d bytes, pages per node "
             "%s, tier=%s%s", family, doc["layer"], where, doc["mode"], source, doc["page_size"],
             doc["bytes"], doc["pages_per_node"], doc["tier"], extra)
    return doc


def served_pages_per_node(service: str, table: Any, statuses: dict[str, dict]) -> \
        dict[int, int] | None:
    """Pages per NUMA node of a table attached from the service at
    ``service``, as the service measured them (move_pages, page by page)
    when it loaded them: the same physical pages.  Measured again here it
    would populate and query every page on the restart path (~0.3 s a GiB
    on a 2-core host).  ``statuses``: the engine's cache, one status call
    per service; None where the service lists no such table."""
    from ...store import serviceclient

    if service not in statuses:
        statuses[service] = serviceclient.status(service)
    rows = [table.shard.row_start, table.shard.row_end]
    held = [t for t in statuses[service].get("tables", [])
            if t.get("layer") == table.layer_id and t.get("rows") == rows]
    node = getattr(table, "node", None)  # replicate-per-node: the copy of this rank's node
    entry = next((t for t in held if t.get("node") in (None, node)), held[0] if held else None)
    if entry is None or not entry.get("bytes_per_node"):
        return None
    size = page_size(table)
    return {int(n): -(-int(b) // size) for n, b in sorted(entry["bytes_per_node"].items(),
                                                         key=lambda item: int(item[0]))}
