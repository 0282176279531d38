import os

from numa_engram.host import accounting, procfs
from numa_engram.store.fileformat import Layout
from numa_engram.store.storage import BackingFile


def test_pss_counts_a_shared_table_once_rss_per_process():
    size = 32 << 20
    with BackingFile.create(Layout.of([("w", size)]), bytes(32)) as table:
        from numa_engram.bindings import native
        native.madvise(table.mapping, native.MADV_POPULATE_READ)
        peer = BackingFile.attach(table.path)
        native.madvise(peer.mapping, native.MADV_POPULATE_READ)
        me = procfs.smaps_rollup(os.getpid())
        # two mappings of the same pages in one process: RSS twice, PSS once
        assert me.rss >= 2 * size
        assert me.pss_shmem >= size * 0.95
        per_node = procfs.numa_maps(os.getpid(), match="numa-engram-")
        assert sum(per_node.values()) >= 2 * size
        peer.close()


def test_node_shmem_and_tmpfs_usage_see_a_new_table():
    before_used, _ = accounting.tmpfs_usage()
    before_shmem = sum(accounting.node_shmem().values())
    with BackingFile.create(Layout.of([("w", 64 << 20)]), bytes(32)):
        used, total = accounting.tmpfs_usage()
        assert used - before_used >= 60 << 20 and total > used
        assert sum(accounting.node_shmem().values()) - before_shmem >= 60 << 20
