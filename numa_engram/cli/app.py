"""numa-engram: plan, place, verify and measure Engram tables.

Every sub-command prints a table an operator can read (numactl/numastat
style) or, with --json, a document for scripts.  The placement tools do not
import torch, so they start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from ..errors import NumaEngramError, StorageError, TopologyError

SIMULATE = re.compile(r"^(\d+)x(\d+)$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain numbers are bytes; > 0."""
    from ..units import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0 (e.g. 64M)")
    return value


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else a message naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value
    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def non_negative_seconds(text: str) -> float:
    """An argparse type: seconds >= 0 (checked before anything is created)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


# plan lays out every rank of the world; beyond this many GPUs the answer
# takes seconds and megabytes, and no deployment is that large
MAX_PLAN_WORLD = 4096


def page_size_arg(text: str) -> int:
    from ..host import hugepages

    try:
        return hugepages.parse_page_size(text)
    except NumaEngramError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def simulate_arg(text: str) -> str:
    """'2x4' (sockets x GPUs per socket) or an existing topology JSON file."""
    m = SIMULATE.match(text)
    if os.path.exists(text) or (m and int(m[1]) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"--simulate {text!r}: write SOCKETSxGPUS_PER_SOCKET with sockets >= 1 and GPUs >= 0 "
        "(e.g. 2x4), or the path of a topology JSON file")


def load_topology(simulate: str | None):
    from ..host.topology import Topology

    if not simulate:
        return Topology.detect()
    if os.path.exists(simulate):
        with open(simulate) as fh:
            return Topology.from_dict(json.load(fh))
    sockets, _, gpus = simulate.lower().partition("x")
    return Topology.from_dict({"sockets": int(sockets), "gpus_per_socket": int(gpus or 0)})


def emit(args: argparse.Namespace, doc: object, text: str) -> None:
    print(json.dumps(doc, indent=2, default=str) if args.json else text)


# ------------------------------------------------------------- commands --

def cmd_topo(args: argparse.Namespace) -> int:
    from ..units import node_list

    topo = load_topology(args.simulate)
    ids = topo.node_ids
    lines = [f"available: {len(ids)} nodes ({node_list(ids)})"
             + ("  [simulated]" if topo.simulated else "")]
    for n in topo.nodes:
        lines.append(f"node {n.id} cpus: {' '.join(map(str, n.cpus))}")
        # numactl --hardware's own lines and unit
        lines.append(f"node {n.id} size: {n.mem_total >> 20} MB")
        lines.append(f"node {n.id} free: {n.mem_free >> 20} MB")
    lines.append("node distances:")
    lines.append("node " + "".join(f"{i:>5}" for i in ids))
    for n in topo.nodes:
        lines.append(f"{n.id:>4}:" + "".join(f"{topo.distance(n.id, o):>5}" for o in ids))
    lines.append("GPUs:" if topo.gpus else "GPUs: none found (sysfs)")
    for g in topo.gpus:
        lines.append(f"  GPU{g.index}  {g.pci_bus_id}  NUMA node {g.numa_node}")
    lines.extend(f"note: {note}" for note in topo.notes)
    emit(args, topo.to_dict(), "\n".join(lines))
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    """Create a table file, place it, populate, verify, report; then remove it
    (or keep it mapped for --hold seconds so other tools can look at it)."""
    from ..host import hugepages
    from ..store.fileformat import DEFAULT_DIRECTORY, Layout
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
        report = verify(f.mapping, plan)
        doc = {"path": f.path, "bytes": layout.file_size, "page_size": page,
               "create_s": created, "plan": plan.to_dict(), "report": report.to_dict()}
        emit(args, doc, f"{f.path}: {fmt_bytes(layout.file_size)} on "
                        f"{hugepages.name_of(page)} pages, policy {args.policy}, created in "
                        f"{created:.3f} s\n{report.format()}")
        if args.hold:
            time.sleep(args.hold)
    return 0 if report.ok else 1


def progress_bar(args: argparse.Namespace, label: str):
    """A progress(done, total) bar on stderr, or None: only for a terminal,
    never with --json."""
    from .. import progress

    return progress.terminal_bar(label) if progress.wanted(args.json) else None


def cmd_verify(args: argparse.Namespace) -> int:
    """Where the pages of table files are, against the policy stored on each:
    a file by path, or every table a running process holds (--pid), unlinked
    and memfd ones included."""
    from ..host import procfs
    from ..store.fileformat import PREFIX

    if args.pid is not None:
        targets: list[tuple[str, int | None]] = [
            (f"pid {args.pid} fd {fd} ({name})", procfs.open_fd(args.pid, fd))
                   for fd, name in procfs.fd_targets(procfs.check_pid(args.pid))
                   if PREFIX in name]
        if not targets:
            raise StorageError(f"pid {args.pid} holds no numa_engram table")
    elif args.path:
        targets = [(args.path, None)]
    else:
        raise StorageError("give a table file PATH or --pid PID")
    docs, texts, ok = [], [], True
    for label, fd in targets:
        doc, text = _verify_one(label, args.path if fd is None else None, fd)
        docs.append(doc)
        texts.append(text)
        ok &= doc["report"]["ok"]
    emit(args, docs if args.pid is not None else docs[0], "\n".join(texts))
    return 0 if ok else 1


def _verify_one(label: str, path: str | None, fd: int | None) -> tuple[dict, str]:
    from ..store.fileformat import STATE_NAMES
    from ..store.placement import PlacementPlan, plan_of_mapping, verify
    from ..store.storage import BackingFile

    holder = "in use by that process" if fd is not None else _holder_status(path)
    try:
        with BackingFile.attach(path, fd=fd) as f:
            # the creator's plan from the header (a hugetlb file keeps no policy
            # of its own); else the policy the kernel stores on the file
            ranges = [(r.name, r.offset, r.length) for r in f.layout.regions]
            plan = (PlacementPlan.from_dict(f.header.plan) if f.header.plan
                    else plan_of_mapping(f.mapping, ranges))
            report = verify(f.mapping, plan)
            state = STATE_NAMES.get(f.state, "?")
    finally:
        if fd is not None:
            os.close(fd)
    return ({"table": label, "state": state, "holder": holder, "report": report.to_dict()},
            f"{label} [{state}; {holder}]\n{report.format()}")


def _holder_status(path: str | None) -> str:
    """Whether a live process holds the table (each holder keeps a lock on
    it for its life, whatever pid namespace it runs in)."""
    from ..store.gc import OPEN_TO_INSPECT, holders_alive

    if path is None:
        return "holder unknown"
    try:
        fd = os.open(path, OPEN_TO_INSPECT)
    except OSError:
        return "holder unknown"
    try:
        alive = holders_alive(fd)
    finally:
        os.close(fd)
    return {True: "in use", None: "liveness unknown",
            False: "creator dead: no process holds it (numa-engram gc removes it)"}[alive]


def cmd_mem(args: argparse.Namespace) -> int:
    """numastat -p style: per process RSS, PSS and the table mappings' bytes
    per node (hugetlb ones counted in their own page size), a Total row;
    then Shmem and huge pages in use per node."""
    from ..host import accounting, hugepages, procfs
    from ..units import text_table, unit_for

    pids = ([procfs.check_pid(p) for p in args.pids]
            or procfs.pids_with_cmdline(args.match))
    rows: list[dict[str, Any]] = []
    for pid in pids:
        try:
            m = procfs.smaps_rollup(pid)
            per_node = procfs.numa_maps(pid, match=args.file_match)
        except procfs.NoSuchProcess:
            continue  # exited since it was listed
        rows.append({"pid": pid, "rss": m.rss, "pss": m.pss, "pss_shmem": m.pss_shmem,
                     "bytes_per_node": per_node})
    shmem = accounting.node_shmem()
    huge = {n: hugepages.bytes_in_use(n) for n in shmem}
    used, total = accounting.tmpfs_usage(args.directory)
    nodes = sorted(shmem)
    name, scale = unit_for(*(r["rss"] for r in rows), *shmem.values(), *huge.values())
    header = ["pid", "RSS", "PSS", "PSS shmem"] + [f"Node {n}" for n in nodes]
    table: list[list[Any]] = [
        [r["pid"]] + [f"{r[k] / scale:.2f}" for k in ("rss", "pss", "pss_shmem")]
        + [f"{r['bytes_per_node'].get(n, 0) / scale:.2f}" for n in nodes] for r in rows]
    table.append(["Total"] + [f"{sum(r[k] for r in rows) / scale:.2f}"
                              for k in ("rss", "pss", "pss_shmem")]
                 + [f"{sum(r['bytes_per_node'].get(n, 0) for r in rows) / scale:.2f}"
                    for n in nodes])
    table.append(["Shmem", "", "", ""] + [f"{shmem[n] / scale:.2f}" for n in nodes])
    table.append(["Hugetlb", "", "", ""] + [f"{huge[n] / scale:.2f}" for n in nodes])
    text = (f"memory in {name} (table mappings per node: --file-match {args.file_match!r})\n"
            + text_table(header, table)
            + f"\n{args.directory}: {used / scale:.2f} of {total / scale:.2f} {name} used")
    emit(args, {"processes": rows, "node_shmem": shmem, "node_hugetlb": huge,
                "tmpfs_used": used, "tmpfs_total": total}, text)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from ..store.gc import gc_stale_files
    from ..units import text_table, unit_for

    entries = gc_stale_files(args.directory, dry_run=args.dry_run, all_users=args.all_users)

    def verdict(e) -> str:
        if e.removed:
            return "removed"
        return "would remove" if e.reason.startswith("stale") else e.reason.split(":")[0]

    unit = unit_for(*(e.size for e in entries))
    table = text_table(["verdict", "file", unit[0], "why"],
                       [[verdict(e), e.path, f"{e.size / unit[1]:.2f}", e.reason]
                        for e in entries], left=2)
    emit(args, [vars(e) for e in entries], table if entries else "no numa_engram files")
    return 0


def load_spec(name: str):
    from ..model.spec import EngramSpec

    return EngramSpec.named(name)


def cmd_plan(args: argparse.Namespace) -> int:
    """Bytes per node and expected remote reads of a table under a policy and
    mode, on this host or a simulated one; page tables per process for each
    page size."""
    from ..host import hugepages
    from ..host.accounting import mode_memory
    from ..model.sharding import WorldLayout
    from ..store.placement import (
        expected_remote_fraction,
        host_regions,
        plan_placement,
        planned_bytes_per_node,
    )
    from ..units import fmt_bytes, node_list, text_table, unit_for

    if args.tp * args.dp > MAX_PLAN_WORLD:
        raise TopologyError(f"--tp {args.tp} x --dp {args.dp} is {args.tp * args.dp} GPUs, above "
                            f"the {MAX_PLAN_WORLD} a plan lays out; plan the hosts one "
                            "deployment really has")
    spec, topo = load_spec(args.spec), load_topology(args.simulate)
    per_host = args.gpus_per_host or max(1, len(topo.gpus)) or args.tp * args.dp
    world = WorldLayout(args.tp, args.dp, per_host)
    regions = host_regions(spec, world, args.mode, topo)
    plan = plan_placement(args.policy, regions, topo)
    per_node = planned_bytes_per_node(plan, regions, topo)
    remote = expected_remote_fraction(plan, regions)
    modes = {m: mode_memory(spec, m, world).per_host
             for m in ("independent", "dp_shared", "dp_sharded")}
    mapped = sum(r.length for r in regions)
    tables = {name: hugepages.page_table_bytes(mapped, size)
              for name, size in hugepages.SIZES.items()}
    unit = unit_for(*(r.length for r in regions), *per_node.values())
    rows = [[r.name, f"{r.length / unit[1]:.2f}", node_list(r.reader_nodes),
             f"{pr.memory_policy} {node_list(pr.nodes)}"] for r, pr in zip(regions, plan.ranges)]
    host_unit = unit_for(*(b for nodes in modes.values() for b in nodes.values()))
    lines = [f"spec {args.spec}: {len(spec.layer_ids)} layers, {spec.n_hash_cols} heads, "
             f"{fmt_bytes(spec.table_bytes())} in all; TP{args.tp} x DP{args.dp}, "
             f"{per_host} GPUs per host, mode {args.mode}, policy {args.policy}",
             text_table(["region", unit[0], "readers on nodes", "placed"], rows),
             "bytes per NUMA node (one host's tables): " + ", ".join(
                 f"node {n} {b / unit[1]:.2f} {unit[0]}" for n, b in per_node.items()),
             f"expected fraction of remote row reads: {remote:.1%}",
             "page tables per process mapping them: " + ", ".join(
                 f"{fmt_bytes(hugepages.SIZES[name], digits=0)} pages {fmt_bytes(b)}"
                 for name, b in tables.items())]
    for m, hosts in modes.items():
        lines.append(f"memory per host, {m:<12}: " + ", ".join(
            f"host {h} {b / host_unit[1]:.2f} {host_unit[0]}" for h, b in hosts.items()))
    emit(args, {"plan": plan.to_dict(), "bytes_per_node": per_node, "remote_fraction": remote,
                "mode_memory": modes, "page_table_bytes": tables}, "\n".join(lines))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Lookup rows/s on a placed table, read by threads pinned to each node:
    the local/remote cost an operator pays for a placement."""
    import numpy as np

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


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on a default table: write a synthetic checkpoint, start
    --procs DP replicas over gloo that share one placed copy, look rows up,
    check them bit-exact, and show placement and memory."""
    from .. import progress
    from .demo import run_demo

    doc = run_demo(spec_name=args.spec, procs=args.procs, directory=args.directory,
                   tokens=args.tokens, policy=args.policy,
                   show_progress=progress.wanted(args.json))
    emit(args, doc, doc["text"])
    return 0 if doc["ok"] else 1


# ---------------------------------------------------------------- main --

def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = OneLineParser(prog="numa-engram", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"numa-engram {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what the library does (-vv: debug); errors then show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        # every option's help ends with its default, from the default itself
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sp.add_argument("--json", action="store_true", help="print JSON for scripts")
        sp.set_defaults(func=func)
        return sp

    sp = add("topo", cmd_topo, "NUMA nodes, cpus, memory, distances and GPUs")
    sp.add_argument("--simulate", type=simulate_arg,
                    help="'2x4' (sockets x GPUs per socket) or a topology JSON file")
    sp = add("create", cmd_create, "create, place, populate and verify a table file")
    sp.add_argument("--size", type=parse_size, default="64M",
                    help="bytes, with K, M, G or T")
    sp.add_argument("--regions", type=positive_int, default=2,
                    help="equal regions, region i read from node i mod nodes")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default="/dev/shm",
                    help="a tmpfs, or a hugetlbfs mount for --page-size 2M/1G (the default "
                         "then means: the mount of that page size found in /proc/self/mounts)")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K (shmem), 2M or 1G (hugetlb: needs a reserved pool per node)")
    sp.add_argument("--threads", type=positive_int, default=1,
                    help="threads populating huge pages")
    sp.add_argument("--hold", type=non_negative_seconds, default=0,
                    help="seconds to keep it before removing")
    sp = add("verify", cmd_verify, "report where a table's pages are (file or live process)")
    sp.add_argument("path", nargs="?", help="a table file")
    sp.add_argument("--pid", type=positive_int, help="every table this process holds")
    sp = add("mem", cmd_mem, "PSS/RSS per process and Shmem per node")
    sp.add_argument("pids", nargs="*", type=positive_int,
                    help="processes (none given: those whose command line has --match)")
    sp.add_argument("--match", default="numa_engram",
                    help="pick pids by command line")
    sp.add_argument("--file-match", default="numa-engram-",
                    help="mappings counted per node")
    sp.add_argument("--directory", default="/dev/shm", help="the tmpfs")
    sp = add("plan", cmd_plan, "bytes per node and remote reads of a placement plan")
    sp.add_argument("--spec", default="v4-flash",
                    help="demo, v4-flash, small, tiny or a JSON file")
    sp.add_argument("--tp", type=positive_int, default=2, help="tensor parallel")
    sp.add_argument("--dp", type=positive_int, default=4, help="data parallel")
    sp.add_argument("--gpus-per-host", "--gpus-per-node", dest="gpus_per_host",
                    type=non_negative_int, default=0,
                    help="GPUs per host (0: from the topology); --gpus-per-node is an alias")
    sp.add_argument("--mode", default="dp_shared", choices=["independent", "dp_shared",
                                                            "dp_sharded"],
                    help="who holds rows")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--simulate", type=simulate_arg, help="'2x4' or a topology JSON file")
    sp = add("bench", cmd_bench, "lookup rows/s on a placed table, per reader node")
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
    sp = add("demo", cmd_demo, "share, place, load and look up a default table")
    sp.add_argument("--spec", default="small",
                    help="demo, v4-flash, small, tiny or a JSON file")
    sp.add_argument("--procs", type=positive_int, default=2,
                    help="DP replicas sharing the table")
    sp.add_argument("--tokens", type=positive_int, default=4096,
                    help="tokens per lookup")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default="/dev/shm",
                    help="a tmpfs directory")
    sp = add("gc", cmd_gc, "remove table files no live process holds")
    sp.add_argument("--directory", default="/dev/shm", help="where to look")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    sp.add_argument("--all-users", action="store_true",
                    help="root only: include other users' files (else only your own)")
    return p


class OneLineParser(argparse.ArgumentParser):
    """A wrong command line is one line on stderr and status 2 (argparse
    would print the usage too)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


POLICY_HELP = ("gpu-local, node:N, bind:NODES (e.g. 0-1), preferred:N, interleave, "
               "interleave:NODES (e.g. 0,2), replicate-per-node or none")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the command is, so every ``with`` and
    ``finally`` on the way out cleans up (as KeyboardInterrupt does for SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    # (only the main thread may set handlers: an embedding caller's thread keeps its own)
    handled = {sig: signal.signal(sig, _raise_terminated)
               for sig in (signal.SIGTERM, signal.SIGHUP)
               if threading.current_thread() is threading.main_thread()}
    try:
        return args.func(args)
    except (KeyboardInterrupt, Terminated) as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        print(f"numa-engram {args.command}: stopped by {signal.Signals(signum).name}; what it "
              "had created is removed", file=sys.stderr)
        return 128 + signum
    except (NumaEngramError, OSError, ValueError) as exc:
        if args.verbose:
            raise
        print(f"numa-engram {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.verbose:
            raise
        print(f"numa-engram {args.command}: unexpected {type(exc).__name__}: {_one_line(exc)}; "
              "run with -v for the traceback", file=sys.stderr)
        return 2
    finally:
        for sig, previous in handled.items():
            signal.signal(sig, previous)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
