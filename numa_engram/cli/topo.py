"""numa-engram topo: NUMA nodes, CPUs, memory, distances and GPUs."""

from __future__ import annotations

import argparse

from .args import emit, load_topology, simulate_arg


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


HELP = "NUMA nodes, cpus, memory, distances and GPUs"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram topo``'s arguments."""
    sp.add_argument("--simulate", type=simulate_arg,
                    help="'2x4' (sockets x GPUs per socket) or a topology JSON file")
