"""Readers of /sys, the twin of ``procfs``: NUMA nodes (cpus, meminfo,
distances), PCI devices (their NUMA node, NVIDIA GPUs), the huge-page pools
and the shared-memory THP knob.  Every reader takes ``root=`` (the sysfs
mount, ``/sys`` by default) so a test can hand it a tree of its own.  No
torch here: the operator tools import this.
"""

from __future__ import annotations

from pathlib import Path

from ..units import parse_cpulist

SYS = "/sys"
NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers


def _node_dir(root: str) -> Path:
    return Path(root) / "devices" / "system" / "node"


def _pci_dir(root: str) -> Path:
    return Path(root) / "bus" / "pci" / "devices"


def online_nodes(root: str = SYS) -> tuple[int, ...]:
    path = _node_dir(root) / "online"
    if not path.exists():  # kernel without NUMA support: one node
        return (0,)
    return parse_cpulist(path.read_text())


def node_exists(node: int, root: str = SYS) -> bool:
    return (_node_dir(root) / f"node{node}").exists()


def node_cpus(node: int, root: str = SYS) -> tuple[int, ...]:
    return parse_cpulist((_node_dir(root) / f"node{node}" / "cpulist").read_text())


def node_meminfo(node: int, root: str = SYS) -> dict[str, int]:
    """nodeN/meminfo as bytes: {'MemTotal': ..., 'MemFree': ..., 'Shmem': ...}."""
    out: dict[str, int] = {}
    for line in (_node_dir(root) / f"node{node}" / "meminfo").read_text().splitlines():
        # "Node 0 MemTotal:       24576 kB" or "Node 0 HugePages_Total:     0"
        parts = line.split()
        if len(parts) >= 4:
            scale = 1024 if parts[-1] == "kB" else 1
            out[parts[2].rstrip(":")] = int(parts[3]) * scale
    return out


def node_distances(node: int, root: str = SYS) -> tuple[int, ...]:
    return tuple(int(x) for x in (_node_dir(root) / f"node{node}" / "distance").read_text()
                 .split())


def pci_numa_node(bus_id: str, root: str = SYS) -> int:
    """The NUMA node sysfs gives a PCI device; -1 when it says none."""
    try:
        return int((_pci_dir(root) / bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return -1


def nvidia_gpus(root: str = SYS) -> tuple[str, ...]:
    """PCI addresses of NVIDIA display/3D controllers, in bus order (= CUDA
    order with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    base = _pci_dir(root)
    if not base.exists():
        return ()
    found = []
    for dev in sorted(base.iterdir()):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass[:6] in DISPLAY_CLASSES:
            found.append(dev.name)
    return tuple(found)


def hugepage_pool_dir(page_size: int, node: int | None = None, root: str = SYS) -> Path:
    """The sysfs directory of the pool of ``page_size`` pages, host-wide or of one node."""
    base = (Path(root) / "kernel" / "mm" / "hugepages" if node is None
            else _node_dir(root) / f"node{node}" / "hugepages")
    return base / f"hugepages-{page_size >> 10}kB"


def hugepage_pool(page_size: int, node: int | None = None, what: str = "free_hugepages",
                  root: str = SYS) -> int:
    """A counter of the pool of ``page_size`` pages, host-wide or of one node
    (0 when that pool does not exist)."""
    try:
        return int((hugepage_pool_dir(page_size, node, root) / what).read_text())
    except (OSError, ValueError):
        return 0


def shmem_thp_path(root: str = SYS) -> Path:
    return Path(root) / "kernel" / "mm" / "transparent_hugepage" / "shmem_enabled"


def shmem_thp(root: str = SYS) -> str | None:
    """The shared-memory THP setting's line ('always ... [never] ...'), or
    None where the kernel has no such knob."""
    try:
        return shmem_thp_path(root).read_text()
    except OSError:
        return None
