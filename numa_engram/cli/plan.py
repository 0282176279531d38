"""numa-engram plan: a deployment's placement, memory per node and remote-read fraction."""

from __future__ import annotations

import argparse

from ..errors import TopologyError
from .args import MAX_PLAN_WORLD, emit, load_spec, load_topology


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
