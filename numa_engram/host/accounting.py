"""Capacity and memory accounting.

Measured part (the /proc readers are procfs's): per-node Shmem, statvfs of a
tmpfs, and a sum over a set of pids.  PSS, not RSS, is
what tells one shared copy from N private ones.  No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..bindings import native
from ..errors import CapacityError, NumaEngramError
from ..literals import DEFAULT_DIRECTORY
from . import procfs, sysfs


def node_shmem() -> dict[int, int]:
    """Shmem bytes per NUMA node (nodeN/meminfo)."""
    return {n: sysfs.node_meminfo(n).get("Shmem", 0) for n in sysfs.online_nodes()
            if sysfs.node_exists(n)}


def tmpfs_usage(directory: str = DEFAULT_DIRECTORY) -> tuple[int, int]:
    """(used bytes, total bytes) of a tmpfs."""
    free, total = native.statvfs(directory)
    return total - free, total


# ---------------------------------------------------------- memory room --
# Checked before a table is allocated, so a table that does not fit is a
# CapacityError naming the numbers, never the OOM killer.

UNLIMITED = 1 << 60  # cgroup "max" / v1's page-rounded LONG_MAX


def node_free_bytes(node: int) -> int:
    """Memory a node can give: MemFree + Inactive(file) (page cache, e.g. the
    checkpoint being read, is reclaimable)."""
    info = sysfs.node_meminfo(node)
    return info.get("MemFree", 0) + info.get("Inactive(file)", 0)


@dataclass(frozen=True)
class CgroupRoom:
    path: str   # the cgroup directory whose limit this is
    limit: int
    usage: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return UNLIMITED if text == "max" else int(text)


def _cgroup_dirs(root: str = procfs.PROC) -> list[tuple[Path, Path, str]]:
    """(this process's memory cgroup dir, its mount point, 'v1'|'v2') for
    each memory hierarchy mounted here."""
    mine = {}
    for controllers, path in procfs.cgroups(root).items():
        if controllers == "v2":
            mine["v2"] = path
        elif "memory" in controllers.split(","):
            mine["v1"] = path
    out = []
    for fs_root, mount_point, fstype, options in procfs.mountinfo(root):
        kind = ("v2" if fstype == "cgroup2" else
                "v1" if fstype == "cgroup" and "memory" in options.split(",") else None)
        if kind is None or kind not in mine:
            continue
        mount = Path(mount_point)
        rel = os.path.relpath(mine[kind], fs_root) if mine[kind].startswith(fs_root) else "."
        out.append((mount / rel if (mount / rel).is_dir() else mount, mount, kind))
    return out


def cgroup_memory_room(root: str = procfs.PROC) -> list[CgroupRoom]:
    """The memory limit and usage of this process's cgroup and every
    ancestor that sets one (v2 memory.max/current, v1 limit/usage_in_bytes);
    ``root``: a directory laid out like /proc (its mountinfo names the
    cgroup mounts read)."""
    names = {"v2": ("memory.max", "memory.current"),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
    out = []
    for cgroup, mount, kind in _cgroup_dirs(root):
        limit_name, usage_name = names[kind]
        d = cgroup
        while True:
            limit, usage = _read_int(d / limit_name), _read_int(d / usage_name)
            if limit is not None and usage is not None and limit < UNLIMITED:
                out.append(CgroupRoom(str(d), limit, usage))
            if d == mount or mount not in d.parents:
                break
            d = d.parent
    return out


@dataclass(frozen=True)
class HostMemory:
    """What the planner reads of this host: MemAvailable, the tightest
    memory cgroup limit over this process, /dev/shm's size (None: unread)."""

    available: int | None
    cgroup: CgroupRoom | None
    shm_total: int | None
    shm_free: int | None

    @property
    def budget(self) -> int | None:
        """The memory tables may take: the cgroup's limit or MemAvailable,
        whichever is smaller (None: neither is known)."""
        known = [b for b in (self.available, self.cgroup and self.cgroup.limit) if b]
        return min(known) if known else None


def host_memory(root: str = procfs.PROC, shm: str = DEFAULT_DIRECTORY) -> HostMemory:
    """MemAvailable, the tightest cgroup limit and the size of the tmpfs
    ``shm``, each None where it cannot be read (no cgroup limit, no tmpfs)."""
    try:
        available = procfs.meminfo(root).get("MemAvailable")
    except OSError:
        available = None
    rooms = cgroup_memory_room(root)
    shm_total: int | None
    shm_free: int | None
    try:
        used, total = tmpfs_usage(shm)
        shm_total, shm_free = total, total - used
    except (OSError, NumaEngramError):
        shm_total = shm_free = None
    return HostMemory(available, min(rooms, key=lambda r: r.limit) if rooms else None,
                      shm_total, shm_free)


def check_memory(size: int, bytes_per_node: dict[int, int] | None = None,
                 what: str = "the table") -> None:
    """Refuse (CapacityError naming the numbers) when ``size`` bytes do not
    fit the host's MemAvailable, a planned node's free memory, or the
    memory limit of this process's cgroup or any ancestor."""
    gib = 2**30
    available = procfs.meminfo().get("MemAvailable")
    if available is not None and size > available:
        raise CapacityError(
            f"{what} needs {size / gib:.2f} GiB but the host has {available / gib:.2f} GiB "
            "available (MemAvailable); free memory, use a smaller table or more shards")
    for node, planned in sorted((bytes_per_node or {}).items()):
        try:
            free = node_free_bytes(node)
        except OSError:
            continue  # a simulated node: nothing to measure
        if planned > free:
            raise CapacityError(
                f"{what} puts {planned / gib:.2f} GiB on NUMA node {node}, which has "
                f"{free / gib:.2f} GiB free (MemFree + Inactive(file)); choose another "
                "placement (e.g. interleave) or free memory on that node")
    for room in cgroup_memory_room():
        if size > room.free:
            raise CapacityError(
                f"{what} needs {size / gib:.2f} GiB but the memory cgroup {room.path} allows "
                f"{room.free / gib:.2f} GiB more (limit {room.limit / gib:.2f} GiB, used "
                f"{room.usage / gib:.2f} GiB); raise its limit or use a smaller table")
