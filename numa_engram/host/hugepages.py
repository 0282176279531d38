"""Page sizes a table can live on: 4 KiB shmem pages (tmpfs, memfd) or 2 MiB
and 1 GiB hugetlb pages (a hugetlbfs mount, or an MFD_HUGETLB memfd).

What the kernel gives huge pages from is a pool reserved per node ahead of
time (``nr_hugepages``); a table that does not fit the pool would fail to
populate and SIGBUS on a later touch, so ``check_pool`` compares each
node's planned pages with its free ones before anything is allocated.
No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping as MappingType

from ..bindings import native
from ..errors import CapacityError, StorageError
from ..units import fmt_bytes, parse_bytes
from . import procfs, sysfs

SIZES = {"4K": 4 << 10, "2M": 2 << 20, "1G": 1 << 30}
# bytes of page table (last level) per mapped page: 8-byte entries, and a
# 2 MiB page is one PMD entry, a 1 GiB page one PUD entry
_ENTRY = 8


def parse_page_size(text: str | int) -> int:
    """'4K' | '2M' | '1G' (or the byte count) -> bytes."""
    try:
        size: int | None = text if isinstance(text, int) else parse_bytes(str(text))
    except ValueError:
        size = None
    if size is not None and size in SIZES.values():
        return size
    raise StorageError(f"page size {text!r} is not one of {list(SIZES)}; use 4K for ordinary "
                       "shared memory, 2M or 1G for hugetlb pages")


def name_of(page_size: int) -> str:
    for name, size in SIZES.items():
        if size == page_size:
            return name
    return f"{page_size}B"


def is_huge(page_size: int) -> bool:
    return page_size > native.PAGE_SIZE


def find_mount(page_size: int, root: str = procfs.PROC) -> str:
    """The hugetlbfs mount point serving ``page_size`` pages (from
    /proc/self/mounts; the first one if several)."""
    for _, mount_point, fstype, options in procfs.mounts(root):
        if fstype != "hugetlbfs":
            continue
        size = options.get("pagesize")
        if (parse_bytes(size) if size else _default_huge_size(root)) == page_size:
            return mount_point
    name = name_of(page_size)
    raise StorageError(
        f"no hugetlbfs mount for {name} pages in /proc/self/mounts; mount one as root: "
        f"mkdir -p /dev/hugepages{name} && mount -t hugetlbfs -o pagesize={name} none "
        f"/dev/hugepages{name} (and reserve pages per node: echo N > /sys/devices/system/node/"
        f"nodeK/hugepages/hugepages-{page_size >> 10}kB/nr_hugepages), or use 4K pages")


def _default_huge_size(root: str = procfs.PROC) -> int:
    return procfs.meminfo(root).get("Hugepagesize", 2 << 20)


def mount_page_size(directory: str) -> int:
    """The page size of the file system holding ``directory`` (statvfs's
    block size is the huge page size on hugetlbfs)."""
    return os.statvfs(directory).f_bsize if native.statfs_type(directory) == \
        native.HUGETLBFS_MAGIC else native.PAGE_SIZE


def resolve_directory(directory: str | None, page_size: int, default: str) -> str | None:
    """Where a table with these pages lives: tmpfs for 4 KiB pages, else a
    hugetlbfs mount of that page size (``default``, the tmpfs default, is
    replaced by the mount found; a directory given must be such a mount)."""
    if directory is None or not is_huge(page_size):
        return directory
    if directory == default:
        return find_mount(page_size)
    check_mount(directory, page_size)
    return directory


def check_mount(directory: str, page_size: int) -> None:
    """``directory`` is a hugetlbfs mount serving ``page_size`` pages."""
    if not os.path.isdir(directory) or mount_page_size(directory) != page_size:
        raise StorageError(f"directory {directory!r} is not a hugetlbfs mount of "
                           f"{name_of(page_size)} pages; pass one (e.g. /dev/hugepages) or "
                           "leave the default and let the mount be found")


def check_mount_room(directory: str, size: int, page_size: int) -> None:
    """A hugetlbfs mount with ``size=`` holds at most that many bytes of
    pages (statvfs reports it; 0 blocks: no limit): CapacityError naming the
    limit and the remount that lifts it."""
    free, total = native.statvfs(directory)
    need = -(-size // page_size) * page_size
    if total and need > free:
        raise CapacityError(
            f"the hugetlbfs mount {directory} is limited to {fmt_bytes(total)} (size=) "
            f"with {fmt_bytes(free)} free, but the table needs {fmt_bytes(need)}; "
            f"raise it: mount -o remount,size={-(-(total - free + need) // 2**20)}M {directory}")


def out_of_pages(size: int, page_size: int, directory: str | None, call: str) -> CapacityError:
    """What ENOMEM from mapping or populating a hugetlb table means: the pool
    (or the mount's size= limit) ran out after the up-front checks, e.g.
    another process took pages meanwhile."""
    name = name_of(page_size)
    pages = -(-size // page_size)
    total = pool_pages(page_size, what="nr_hugepages")
    where = (f" or the hugetlbfs mount {directory} (size=) is full" if directory else "")
    return CapacityError(
        f"{call}: the {name} huge page pool ran out ({pool_pages(page_size)} of {total} free, "
        f"{pages} needed){where}: another process may have taken pages since the check; "
        f"reserve more ({_fix(page_size, None, total + pages)}) and retry")


MFD_ALLOW_SEALING = 0x0002  # linux/memfd.h


def memfd_flags(page_size: int) -> int:
    """memfd_create flags for a private table on these pages (sealing
    allowed: the table service seals what it hands out)."""
    flags = native.MFD_CLOEXEC | MFD_ALLOW_SEALING
    if is_huge(page_size):
        flags |= native.MFD_HUGETLB | (page_size.bit_length() - 1) << native.MFD_HUGE_SHIFT
    return flags


def pool_pages(page_size: int, node: int | None = None, what: str = "free_hugepages") -> int:
    """Pages of the pool, host-wide or on one node (0 if none reserved)."""
    return sysfs.hugepage_pool(page_size, node, what)


def bytes_in_use(node: int | None = None) -> int:
    """Bytes of huge pages (every size) handed out from the pools, host-wide
    or on one node: reserved (nr_hugepages) less free."""
    return sum((pool_pages(size, node, "nr_hugepages") - pool_pages(size, node)) * size
               for size in SIZES.values() if is_huge(size))


def _fix(page_size: int, node: int | None, pages: int) -> str:
    return f"echo {pages} > {sysfs.hugepage_pool_dir(page_size, node) / 'nr_hugepages'}"


def check_pool(size: int, page_size: int, bytes_per_node: MappingType[int, int] | None = None,
               what: str = "the table") -> None:
    """CapacityError (naming the node, the pages needed and free, and the
    command that reserves them) when the pool cannot hold ``size`` bytes,
    or a node cannot hold what the plan puts on it.  Free pages less the
    reserved ones (promised to mappings that have not faulted yet)."""
    pages = -(-size // page_size)
    reserved = pool_pages(page_size, what="resv_hugepages")
    free = pool_pages(page_size) - reserved
    name = name_of(page_size)
    if pages > free:
        total = pool_pages(page_size, what="nr_hugepages")
        raise CapacityError(
            f"{what} needs {pages} {name} huge pages but the pool has {max(free, 0)} free "
            f"({reserved} reserved); reserve more: {_fix(page_size, None, total + pages - free)}")
    for node, planned in sorted((bytes_per_node or {}).items()):
        need = -(-planned // page_size)
        node_free = pool_pages(page_size, node) - reserved
        if need > node_free:
            total = pool_pages(page_size, node, "nr_hugepages")
            raise CapacityError(
                f"{what} puts {need} {name} huge pages on NUMA node {node}, which has "
                f"{max(node_free, 0)} free ({reserved} reserved host-wide); reserve more: "
                f"{_fix(page_size, node, total + need - node_free)}")


def page_table_bytes(mapped_bytes: int, page_size: int) -> int:
    """Last-level page-table bytes one process needs to map ``mapped_bytes``
    on pages of ``page_size`` (4 KiB: 8 bytes per page, so ~0.2% of the
    table, per process; 2 MiB: 512x less)."""
    return -(-mapped_bytes // page_size) * _ENTRY
