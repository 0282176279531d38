"""numa-engram mem: numastat -p style memory per process and per node."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..literals import DEFAULT_DIRECTORY
from .args import emit, positive_int


def cmd_mem(args: argparse.Namespace) -> int:
    """numastat -p style: per process RSS, PSS and the table mappings' bytes
    per node (hugetlb ones counted in their own page size), a Total row;
    then Shmem and huge pages in use per node."""
    from ..host import accounting, hugepages, procfs
    from ..units import text_table, unit_for

    if not os.path.isdir(args.directory):
        raise ValueError(f"--directory {args.directory}: no such directory; pass the tmpfs "
                         "the tables live in (default /dev/shm)")
    pids = [procfs.check_pid(p) for p in args.pids]
    if not pids:  # every process that maps a table (any launcher, unlinked or memfd)
        pids = procfs.pids_mapping(args.file_match)
        if args.match:
            pids = sorted(set(pids) | set(procfs.pids_with_cmdline(args.match)))
    rows: list[dict[str, Any]] = []
    for pid in pids:
        try:
            m = procfs.smaps_rollup(pid)
            per_node = procfs.numa_maps(pid, match=args.file_match)
            tables = procfs.smaps(pid, args.file_match)
        except procfs.NoSuchProcess:
            continue  # exited since it was listed
        rows.append({"pid": pid, "rss": m.rss, "pss": m.pss, "pss_shmem": m.pss_shmem,
                     "bytes_per_node": per_node, "table_pss": tables.pss,
                     "table_rss": tables.rss})
    shmem = accounting.node_shmem()
    huge = {n: hugepages.bytes_in_use(n) for n in shmem}
    used, total = accounting.tmpfs_usage(args.directory)
    nodes = sorted(shmem)
    name, scale = unit_for(*(r["rss"] for r in rows), *shmem.values(), *huge.values())
    header = ["pid", "RSS", "PSS", "PSS shmem"] + [f"Node {n}" for n in nodes]
    table: list[list[Any]] = [
        [r["pid"]] + [f"{r[k] / scale:.2f}" for k in ("rss", "pss", "pss_shmem")]
        + [f"{r['bytes_per_node'].get(n, 0) / scale:.2f}" for n in nodes] for r in rows]
    table.append(["Sum"] + [f"{sum(r[k] for r in rows) / scale:.2f}"
                              for k in ("rss", "pss", "pss_shmem")]
                 + [f"{sum(r['bytes_per_node'].get(n, 0) for r in rows) / scale:.2f}"
                    for n in nodes])
    table.append(["Shmem", "", "", ""] + [f"{shmem[n] / scale:.2f}" for n in nodes])
    table.append(["Hugetlb", "", "", ""] + [f"{huge[n] / scale:.2f}" for n in nodes])
    table_pss = sum(r["table_pss"] for r in rows)
    text = (f"memory in {name} (table mappings per node: --file-match {args.file_match!r})\n"
            + text_table(header, table)
            + "\nrows: per process, its table mappings' pages per node (a page it maps, shared or"
            " not); Sum: over the processes, so a shared page counts once per process that maps"
            " it; Shmem and Hugetlb: each node's pages, each once"
            + f"\ntables: PSS over these processes {table_pss / scale:.2f} {name} (each shared "
            "page once: the tables' real memory)"
            + f"\n{args.directory}: {used / scale:.2f} of {total / scale:.2f} {name} used")
    emit(args, {"processes": rows, "node_shmem": shmem, "node_hugetlb": huge,
                "table_pss_total": table_pss, "tmpfs_used": used, "tmpfs_total": total}, text)
    return 0


HELP = "PSS/RSS per process and Shmem per node"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram mem``'s arguments."""
    sp.add_argument("pids", nargs="*", type=positive_int,
                    help="processes (none given: every process that maps a table, and those "
                    "whose command line has --match)")
    sp.add_argument("--match", default="",
                    help="also pick pids by command line (e.g. 'vllm serve')")
    sp.add_argument("--file-match", default="numa-engram-",
                    help="mappings counted per node")
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY, help="the tmpfs")
