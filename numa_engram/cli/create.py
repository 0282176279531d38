"""numa-engram create: create, place, populate and verify a table file."""

from __future__ import annotations

import argparse
import time

from .args import emit, load_topology, progress_bar


def cmd_create(args: argparse.Namespace) -> int:
    """Create a table file, place it, populate, verify, report; then remove it
    (or keep it mapped for --hold seconds so other tools can look at it)."""
    from ..host import hugepages
    from ..literals import DEFAULT_DIRECTORY
    from ..store.fileformat import Layout
    from ..store.placement import Region, plan_placement, verify
    from ..store.storage import BackingFile
    from ..units import fmt_bytes

    topo = load_topology(None)
    page = args.page_size
    directory = hugepages.resolve_directory(args.directory, page, DEFAULT_DIRECTORY)
    share = args.size // args.regions
    layout = Layout.of([(f"shard{i}", share) for i in range(args.regions)], page)
    regions = [Region(r.name, r.offset, r.length, (topo.node_ids[i % len(topo.node_ids)],))
               for i, r in enumerate(layout.regions)]
    plan = plan_placement(args.policy, regions, topo)
    t0 = time.perf_counter()
    with BackingFile.create(layout, bytes(32), directory=directory, placement=plan,
                            progress=progress_bar(args, "populate"),
                            threads=args.threads) as f:
        created = time.perf_counter() - t0
        f.mark_ready()  # made and placed: what verify then reports (it holds no rows)
        report = verify(f.mapping, plan)
        doc = {"path": f.path, "bytes": layout.file_size, "page_size": page,
               "create_s": created, "plan": plan.to_dict(), "report": report.to_dict()}
        emit(args, doc, f"{f.path}: {fmt_bytes(layout.file_size)} on "
                        f"{hugepages.name_of(page)} pages, policy {args.policy}, created in "
                        f"{created:.3f} s\n{report.format()}")
        if args.hold:
            time.sleep(args.hold)
    return 0 if report.ok else 1
