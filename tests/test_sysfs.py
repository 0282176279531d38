"""host/sysfs.py against a sysfs tree of our own (root=), and against this
machine's /sys."""

from numa_engram.host import sysfs
from numa_engram.host.topology import Topology, read_nvidia_gpus


def _tree(root):
    node = root / "devices" / "system" / "node"
    (node / "node1" / "hugepages" / "hugepages-2048kB").mkdir(parents=True)
    (node / "online").write_text("0-1\n")
    (node / "node1" / "cpulist").write_text("4-5,7\n")
    (node / "node1" / "distance").write_text("21 10\n")
    (node / "node1" / "meminfo").write_text("Node 1 MemTotal:  2048 kB\nNode 1 HugePages_Free:"
                                           "     3\n")
    (node / "node1" / "hugepages" / "hugepages-2048kB" / "free_hugepages").write_text("3\n")
    gpu = root / "bus" / "pci" / "devices" / "0000:3b:00.0"
    gpu.mkdir(parents=True)
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "class").write_text("0x030200\n")
    (gpu / "numa_node").write_text("1\n")
    nic = root / "bus" / "pci" / "devices" / "0000:01:00.0"
    nic.mkdir()
    (nic / "vendor").write_text("0x15b3\n")
    (nic / "class").write_text("0x020000\n")
    return str(root)


def test_every_reader_reads_the_tree_it_is_given(tmp_path):
    root = _tree(tmp_path)
    assert sysfs.online_nodes(root) == (0, 1)
    assert sysfs.node_exists(1, root) and not sysfs.node_exists(0, root)
    assert sysfs.node_cpus(1, root) == (4, 5, 7)
    assert sysfs.node_distances(1, root) == (21, 10)
    assert sysfs.node_meminfo(1, root) == {"MemTotal": 2048 << 10, "HugePages_Free": 3}
    assert sysfs.hugepage_pool(2 << 20, node=1, root=root) == 3
    assert sysfs.hugepage_pool(1 << 30, node=1, root=root) == 0  # no such pool
    assert sysfs.nvidia_gpus(root) == ("0000:3b:00.0",)  # the NIC is not a GPU
    assert sysfs.pci_numa_node("0000:3B:00.0", root) == 1
    assert sysfs.pci_numa_node("0000:99:00.0", root) == -1
    assert [(g.index, g.numa_node) for g in read_nvidia_gpus(root)] == [(0, 1)]
    assert sysfs.shmem_thp(root) is None


def test_a_tree_without_numa_is_one_node(tmp_path):
    assert sysfs.online_nodes(str(tmp_path)) == (0,)
    assert sysfs.nvidia_gpus(str(tmp_path)) == ()


def test_this_machines_sysfs_agrees_with_the_topology():
    topo = Topology.detect()
    assert tuple(n.id for n in topo.nodes) == sysfs.online_nodes()
