"""NUMA nodes, their cpus, memory and distances; GPUs and their nearest node.

Read from sysfs (one small reader per file) and cross-checked with libnuma
through py-libnuma when it loads.  ``Topology.from_dict`` builds a simulated
host (e.g. 2 sockets x 4 GPUs) so plans can be made without the hardware.
No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from ..errors import NumaEngramError, TopologyError
from ..units import node_list
from . import procfs, sysfs


@dataclass(frozen=True)
class NodeInfo:
    id: int
    cpus: tuple[int, ...]
    mem_total: int
    mem_free: int
    distances: tuple[int, ...]


@dataclass(frozen=True)
class GpuInfo:
    index: int
    pci_bus_id: str
    numa_node: int  # -1 when the platform does not say
    name: str = ""


def read_online_nodes(root: str = sysfs.SYS) -> tuple[int, ...]:
    return sysfs.online_nodes(root)


def read_node_meminfo(node: int, root: str = sysfs.SYS) -> dict[str, int]:
    return sysfs.node_meminfo(node, root)


def gpu_node(device: int | None, root: str = sysfs.SYS) -> int | None:
    """The NUMA node of a CUDA device (by the PCI bus id the CUDA runtime
    reports: CUDA and PCI order may differ), or None when it cannot be told
    (no device given, no runtime or GPU, no NUMA affinity in sysfs)."""
    if device is None:
        return None
    from ..bindings import cudart

    try:
        bus_id = cudart.pci_bus_id(device)
    except NumaEngramError:  # no runtime, no GPU, or no such device
        return None
    node = sysfs.pci_numa_node(bus_id, root)
    return node if node >= 0 else None


def read_nvidia_gpus(root: str = sysfs.SYS) -> tuple[GpuInfo, ...]:
    """NVIDIA GPUs in PCI bus order (= CUDA order with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    return tuple(GpuInfo(i, bus, sysfs.pci_numa_node(bus, root))
                 for i, bus in enumerate(sysfs.nvidia_gpus(root)))


def libnuma_view() -> dict | None:
    """What libnuma says (max node, distances), or None when it does not load.

    py-libnuma crashes on nodes that do not exist, so it is only asked about
    nodes that sysfs lists."""
    try:
        from numa import info  # py-libnuma; loads libnuma.so.1
    except (ImportError, OSError):
        return None
    if not info.numa_available():
        return None
    nodes = read_online_nodes()
    return {
        "max_node": info.get_max_node(),
        "distances": {a: tuple(info.numa_distance(a, b) for b in nodes) for a in nodes},
    }


def _read_node(n: int) -> NodeInfo:
    """One node from sysfs; a kernel without NUMA sysfs is one node holding every cpu."""
    if not sysfs.node_exists(n):
        return NodeInfo(n, tuple(range(os.cpu_count() or 1)), 0, 0, (10,))
    mem = sysfs.node_meminfo(n)
    return NodeInfo(n, sysfs.node_cpus(n), mem.get("MemTotal", 0), mem.get("MemFree", 0),
                    sysfs.node_distances(n))


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeInfo, ...]
    gpus: tuple[GpuInfo, ...] = ()
    simulated: bool = False
    notes: tuple[str, ...] = field(default=())

    # ---------------------------------------------------------- builders --
    @classmethod
    def detect(cls) -> Topology:
        """The host's topology from sysfs, cross-checked with libnuma."""
        nodes = tuple(_read_node(n) for n in read_online_nodes())
        notes = []
        view = libnuma_view()
        if view is None:
            notes.append("libnuma unavailable: topology from sysfs only")
        else:
            for node in nodes:
                if view["distances"].get(node.id) != node.distances:
                    notes.append(f"libnuma and sysfs disagree on node {node.id} distances: "
                                 f"{view['distances'].get(node.id)} vs {node.distances}")
        return cls(nodes, read_nvidia_gpus(), False, tuple(notes))

    @classmethod
    def from_dict(cls, spec: dict) -> Topology:
        """A simulated host.  Either explicit::

            {"nodes": [{"id": 0, "cpus": [0, 1], "mem_total": ..., "distances": [10, 20]}, ...],
             "gpus": [{"index": 0, "numa_node": 0}, ...]}

        or the short form ``{"sockets": 2, "gpus_per_socket": 4,
        "cpus_per_socket": 32, "mem_per_socket": 1 << 40}``.
        """
        if "sockets" in spec:
            return cls._from_short(spec)
        try:
            nodes = tuple(
                NodeInfo(int(n["id"]), tuple(n.get("cpus", ())), int(n.get("mem_total", 0)),
                         int(n.get("mem_free", n.get("mem_total", 0))),
                         tuple(n.get("distances", ())))
                for n in spec["nodes"])
            gpus = tuple(
                GpuInfo(int(g.get("index", i)), g.get("pci_bus_id", f"sim:{i:02x}"),
                        int(g["numa_node"]), g.get("name", ""))
                for i, g in enumerate(spec.get("gpus", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"bad simulated topology {spec!r}: {exc}") from exc
        topo = cls(nodes, gpus, True)
        topo.validate()
        return topo

    @classmethod
    def _from_short(cls, spec: dict) -> Topology:
        sockets = int(spec["sockets"])
        if sockets < 1:
            raise TopologyError(f"sockets must be >= 1, got {sockets}")
        per_gpu = int(spec.get("gpus_per_socket", 0))
        per_cpu = int(spec.get("cpus_per_socket", 1))
        mem = int(spec.get("mem_per_socket", 1 << 40))
        nodes = [{"id": s, "cpus": list(range(s * per_cpu, (s + 1) * per_cpu)), "mem_total": mem,
                  "distances": [10 if s == o else 21 for o in range(sockets)]}
                 for s in range(sockets)]
        gpus = [{"index": s * per_gpu + g, "numa_node": s}
                for s in range(sockets) for g in range(per_gpu)]
        return cls.from_dict({"nodes": nodes, "gpus": gpus})

    # ----------------------------------------------------------- queries --
    def validate(self) -> None:
        ids = [n.id for n in self.nodes]
        if not ids or len(set(ids)) != len(ids):
            raise TopologyError(f"node ids must be present and unique, got {ids}")
        for node in self.nodes:
            if node.distances and len(node.distances) != len(ids):
                raise TopologyError(f"node {node.id} has {len(node.distances)} distances "
                                    f"for {len(ids)} nodes")
        for gpu in self.gpus:
            if gpu.numa_node not in ids and gpu.numa_node != -1:
                raise TopologyError(f"GPU {gpu.index} is on node {gpu.numa_node}, "
                                    f"which is not one of {ids}")

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    def node(self, node_id: int) -> NodeInfo:
        """The node, or TopologyError naming the nodes that exist."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise TopologyError(f"NUMA node {node_id} does not exist on this host; "
                            f"nodes are {node_list(self.node_ids)}")

    def check_nodes(self, nodes: Iterable[int]) -> tuple[int, ...]:
        nodes = tuple(nodes)
        if not nodes:
            raise TopologyError("empty NUMA node set: name at least one of "
                                f"{node_list(self.node_ids)}")
        for n in nodes:
            self.node(n)
        return nodes

    def gpu(self, index: int) -> GpuInfo:
        for g in self.gpus:
            if g.index == index:
                return g
        raise TopologyError(f"GPU {index} not found; GPUs are {[g.index for g in self.gpus]}")

    def nearest_node(self, gpu_index: int) -> int:
        """NUMA node nearest to a GPU; node 0's socket when the platform does not say."""
        node = self.gpu(gpu_index).numa_node
        return node if node >= 0 else self.nodes[0].id

    def node_of_cpu(self, cpu: int) -> int:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        return self.nodes[0].id

    def distance(self, a: int, b: int) -> int:
        na = self.node(a)
        idx = self.node_ids.index(b)
        return na.distances[idx] if na.distances else (10 if a == b else 20)

    def to_dict(self) -> dict:
        return {"nodes": [asdict(n) for n in self.nodes], "gpus": [asdict(g) for g in self.gpus],
                "simulated": self.simulated, "notes": list(self.notes)}


def current_node(topology: Topology | None = None) -> int:
    """Node of the CPU this process runs on now."""
    topo = topology or Topology.detect()
    return topo.node_of_cpu(procfs.current_cpu())


