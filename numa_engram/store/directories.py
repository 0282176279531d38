"""Table directories: where a table file may live (a real directory on
tmpfs or hugetlbfs, never a disk), whether it has room for a layout, and
the (device, inode) identity that says whether processes can share a file
there.  No torch here."""

from __future__ import annotations

import os

from ..bindings import native
from ..errors import CapacityError, StorageError
from ..host import hugepages, sysfs
from .fileformat import Layout


def directory_id(directory: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a table directory, None where it does not exist:
    processes can share a table file iff this (and host and uid) are equal."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def describe_device(dir_id: tuple[int, int] | None) -> str:
    """'dev 0:39 inode 5' for a ``directory_id`` (the inode of a mount's
    root, 1 or 2, is left out)."""
    if dir_id is None:
        return "none: it does not exist there"
    dev, ino = dir_id
    return f"dev {os.major(dev)}:{os.minor(dev)}" + (f" inode {ino}" if ino > 2 else "")


def check_shmem_thp(root: str = sysfs.SYS) -> None:
    """Refuse to run when shared-memory THP is forced on every mount."""
    text = sysfs.shmem_thp(root)
    path = sysfs.shmem_thp_path(root)
    if text is not None and "[force]" in text:
        raise StorageError(
            f"{path} is 'force': shared memory would use huge pages, which pinning splits and "
            f"placement cannot verify; run 'echo never > {path}' (or 'advise') as root")


def check_directory(directory: str) -> None:
    """A table directory must be a real directory on tmpfs or hugetlbfs:
    anywhere else the table would be written back to a disk."""
    if os.path.islink(directory):
        raise StorageError(f"directory {directory!r} is a symlink; pass the directory it "
                           f"points to ({os.path.realpath(directory)!r}) if you trust it")
    if not os.path.exists(directory):
        raise StorageError(f"directory {directory!r} does not exist; mount a tmpfs there or "
                           "pass directory= another tmpfs")
    if not os.path.isdir(directory):
        raise StorageError(f"directory {directory!r} is not a directory (a regular file?); "
                           "pass the tmpfs directory the table should live in, e.g. /dev/shm")
    fs_type = native.statfs_type(directory)
    if fs_type not in (native.TMPFS_MAGIC, native.HUGETLBFS_MAGIC):
        raise StorageError(f"directory {directory!r} is not on tmpfs or hugetlbfs (file system "
                           f"magic {fs_type:#x}): a table there would be written to disk; "
                           "use /dev/shm or mount a tmpfs (mount -t tmpfs -o size=... tmpfs DIR)")


def check_space(directory: str, size: int) -> None:
    check_directory(directory)
    free, total = native.statvfs(directory)
    if size > free:
        raise CapacityError(
            f"{directory} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB but the "
            f"table needs {size / 2**30:.2f} GiB; enlarge it (mount -o remount,size=...) or "
            "use another directory")


def check_directory_room(directory: str, layout: Layout) -> None:
    """The directory can hold this table: tmpfs with room (and shmem THP not
    forced) for 4 KiB pages, a hugetlbfs mount of the layout's page size
    for huge pages (their pool is checked by check_pool)."""
    page = layout.page_size
    if not hugepages.is_huge(page):
        check_shmem_thp()
        check_space(directory, layout.file_size)
        return
    check_directory(directory)
    hugepages.check_mount(directory, page)
    hugepages.check_mount_room(directory, layout.file_size, page)
