"""numa-engram bench: lookup throughput on a placed table."""

from __future__ import annotations

import argparse
import time

from ..errors import StorageError
from .args import (
    POLICY_HELP,
    emit,
    load_spec,
    load_topology,
    page_size_arg,
    parse_size,
    positive_int,
    progress_bar,
)


def cmd_bench(args: argparse.Namespace) -> int:
    """Lookup rows/s on a placed table, read by threads pinned to each node:
    the local/remote cost an operator pays for a placement."""
    import numpy as np

    # before the table exists: torch's import runs C++ that calls back into
    # Python, where a signal's Terminated would abort the process (no
    # cleanup) instead of unwinding to main()
    import torch  # noqa: F401

    from ..host import hugepages
    from ..lookup.cpu import lookup_rows
    from ..store.fileformat import Layout
    from ..store.placement import Region, plan_placement, verify
    from ..store.storage import BackingFile
    from ..units import fmt_bytes

    topo = load_topology(None)
    spec = load_spec(args.spec)  # rows shaped as the model's: head_dim bytes + scales
    dim, n_scales = spec.head_dim, spec.scales_per_row
    rows = args.size // spec.row_bytes
    if rows < 1:
        raise StorageError(f"--size {args.size} holds no row of {spec.row_bytes} bytes")
    layout = Layout.of([("weights", rows * dim), ("scales", rows * n_scales)], args.page_size)
    plan = plan_placement(args.policy, [Region(r.name, r.offset, r.length)
                                        for r in layout.regions], topo)
    results = []
    with BackingFile.create(layout, bytes(32), directory=None, placement=plan,
                            progress=progress_bar(args, "populate"), threads=2) as f:
        w = f.region("weights").reshape(rows, dim)
        s = f.region("scales").reshape(rows, n_scales)
        w[:] = np.random.default_rng(0).integers(0, 256, size=w.shape, dtype=np.uint8)
        s[:] = 127
        ids = np.random.default_rng(1).integers(0, rows, size=(args.tokens, 1))
        out = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[rows],
                          block=spec.block)  # touch the output
        for node in topo.nodes:
            threads = min(args.threads, len(node.cpus)) or 1
            best = min(_timed(lambda n=node, t=threads: lookup_rows(
                w, s, ids, head_start=0, bucket_sizes=[rows], threads=t, cpus=n.cpus, out=out,
                block=spec.block)) for _ in range(args.repeat))
            results.append({"reader_node": node.id, "threads": threads,
                            "rows_per_s": args.tokens / best})
        report = verify(f.mapping, plan)
    base = max(r["rows_per_s"] for r in results)
    lines = [f"table {fmt_bytes(layout.file_size)} of {spec.row_bytes}-byte rows (spec "
             f"{args.spec}) on {hugepages.name_of(args.page_size)} pages, policy {args.policy}",
             report.format()]
    lines += [f"  readers on node {r['reader_node']} ({r['threads']} threads): "
              f"{r['rows_per_s'] / 1e6:7.2f} M rows/s  ({r['rows_per_s'] / base:.2f} of best)"
              for r in results]
    emit(args, {"results": results, "placement": report.to_dict()}, "\n".join(lines))
    return 0



def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


HELP = "lookup rows/s on a placed table, per reader node"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram bench``'s arguments."""
    sp.add_argument("--size", type=parse_size, default="1G", help="table bytes")
    sp.add_argument("--policy", default="node:0", help=POLICY_HELP)
    sp.add_argument("--tokens", type=positive_int, default=100_000,
                    help="tokens per lookup")
    sp.add_argument("--threads", type=positive_int, default=2,
                    help="lookup threads")
    sp.add_argument("--repeat", type=positive_int, default=3, help="runs per node")
    sp.add_argument("--spec", default="v4-flash",
                    help="row shape from this spec: demo, v4-flash, small, tiny or a JSON file")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K, 2M or 1G (hugetlb: needs a reserved pool)")
