"""numa-engram create: create, place, populate and verify a table file."""

from __future__ import annotations

import argparse
import time

from ..literals import DEFAULT_DIRECTORY
from .args import (
    POLICY_HELP,
    emit,
    load_topology,
    non_negative_seconds,
    page_size_arg,
    parse_size,
    positive_int,
    progress_bar,
)


def cmd_create(args: argparse.Namespace) -> int:
    """Create a table file, place it, populate, verify, report; then remove it
    (or keep it mapped for --hold seconds so other tools can look at it)."""
    from ..host import hugepages
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


HELP = "create, place, populate and verify a table file"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram create``'s arguments."""
    sp.add_argument("--size", type=parse_size, default="64M",
                    help="bytes, with K, M, G or T")
    sp.add_argument("--regions", type=positive_int, default=2,
                    help="equal regions, region i read from node i mod nodes")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY,
                    help="a tmpfs, or a hugetlbfs mount for --page-size 2M/1G (the default "
                         "then means: the mount of that page size found in /proc/self/mounts)")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K (shmem), 2M or 1G (hugetlb: needs a reserved pool per node)")
    sp.add_argument("--threads", type=positive_int, default=1,
                    help="threads populating huge pages")
    sp.add_argument("--hold", type=non_negative_seconds, default=0,
                    help="seconds to keep it before removing")
