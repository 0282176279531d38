"""One reader per /proc file this library looks at: stat, smaps, smaps_rollup,
numa_maps, meminfo, cmdline, fd links, the boot id and the mounts.

Every reader takes ``root=`` (a directory laid out like /proc, for tests)
and translates errors: a pid that does not exist (or vanished while being
read) is ``NoSuchProcess`` naming it, not a FileNotFoundError.  Values are
in bytes.  No torch here.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import NoSuchProcess, StorageError

PROC = "/proc"


def _read(pid: int | str, name: str, root: str) -> str:
    try:
        return Path(root, str(pid), name).read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(f"no process with pid {pid} (or it exited); give the pid of a "
                            "running process (e.g. from pgrep)") from None
    except PermissionError:
        raise StorageError(f"cannot read {root}/{pid}/{name}: permission denied; run as the "
                           "process's user or root") from None


def check_pid(pid: int, root: str = PROC) -> int:
    """``pid`` if such a process exists, else NoSuchProcess naming it."""
    if pid <= 0 or not Path(root, str(pid)).is_dir():
        raise NoSuchProcess(f"no process with pid {pid}; give the pid of a running process "
                            "(e.g. from pgrep)")
    return pid


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    rss: int
    pss: int
    pss_shmem: int
    shared: int  # Shared_Clean + Shared_Dirty


def smaps_rollup(pid: int, root: str = PROC) -> ProcessMemory:
    """/proc/<pid>/smaps_rollup."""
    fields: dict[str, int] = {}
    for line in _read(pid, "smaps_rollup", root).splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return ProcessMemory(pid, fields.get("Rss", 0), fields.get("Pss", 0),
                         fields.get("Pss_Shmem", 0),
                         fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0))


@dataclass(frozen=True)
class MappingMemory:
    pss: int
    rss: int
    page_size: int  # KernelPageSize of the last matching mapping (huge for hugetlb)


def smaps(pid: int | str, match: str, root: str = PROC) -> MappingMemory:
    """Pss, Rss and page size of pid's mappings whose smaps header line
    contains ``match``."""
    pss = rss = 0
    page = 4096
    take = False
    for line in _read(pid, "smaps", root).splitlines():
        first = line.split(maxsplit=1)[0] if line else ""
        if "-" in first and not first.endswith(":"):
            take = match in line
        elif take and first in ("Pss:", "Rss:", "KernelPageSize:"):
            value = int(line.split()[1]) * 1024
            if first == "Pss:":
                pss += value
            elif first == "Rss:":
                rss += value
            else:
                page = value
    return MappingMemory(pss, rss, page)


def numa_maps(pid: int | str, match: str | None = None, root: str = PROC) -> dict[int, int]:
    """Bytes per node of pid's mappings (pages it has mapped), from
    numa_maps; a hugetlb mapping counts huge pages, so each count is
    multiplied by that line's kernelpagesize_kB.  ``match`` keeps lines
    containing that text."""
    out: Counter[int] = Counter()
    for line in _read(pid, "numa_maps", root).splitlines():
        if match is not None and match not in line:
            continue
        tokens = line.split()
        page = next((int(t.split("=")[1]) * 1024 for t in tokens
                     if t.startswith("kernelpagesize_kB=")), 4096)
        for tok in tokens:
            if tok[:1] == "N" and "=" in tok and tok[1:tok.index("=")].isdigit():
                node, count = tok[1:].split("=")
                out[int(node)] += int(count) * page
    return dict(sorted(out.items()))


def meminfo(root: str = PROC) -> dict[str, int]:
    """/proc/meminfo in bytes (counts such as HugePages_Total stay counts)."""
    out: dict[str, int] = {}
    for line in Path(root, "meminfo").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out[parts[0].rstrip(":")] = int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    return out


def start_time(pid: int, root: str = PROC) -> int | None:
    """Start time of pid in clock ticks since boot (None if no such process)."""
    try:
        stat_line = _read(pid, "stat", root)
    except NoSuchProcess:
        return None
    return int(stat_line.rsplit(")", 1)[1].split()[19])


def current_cpu(root: str = PROC) -> int:
    """CPU this process last ran on (field 39 of /proc/self/stat)."""
    return int(_read("self", "stat", root).rsplit(")", 1)[1].split()[36])


def boot_id(root: str = PROC) -> bytes:
    return uuid.UUID(Path(root, "sys/kernel/random/boot_id").read_text().strip()).bytes


def fd_targets(pid: int, root: str = PROC) -> Iterator[tuple[int, str]]:
    """(fd, link target) of every open descriptor of pid."""
    base = Path(root, str(pid), "fd")
    try:
        entries = sorted(os.listdir(base), key=int)
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid} (or it exited)") from None
    except PermissionError:
        raise StorageError(f"cannot list {base}: permission denied; run as the process's "
                           "user or root") from None
    for entry in entries:
        try:
            yield int(entry), os.readlink(base / entry)
        except OSError:
            continue  # closed meanwhile


def open_fd(pid: int, fd: int, root: str = PROC) -> int:
    """Our own descriptor for another process's open file (same user or root)."""
    try:
        return os.open(Path(root, str(pid), "fd", str(fd)), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"cannot open fd {fd} of pid {pid}: {exc.strerror}; run as the "
                           "same user or root") from exc


def pids_with_cmdline(pattern: str, root: str = PROC) -> list[int]:
    """Pids (not this one) whose command line contains pattern."""
    out = []
    for pid in pids(root):
        try:
            cmd = Path(root, str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue
        if pattern in cmd:
            out.append(pid)
    return out


def cgroups(root: str = PROC) -> dict[str, str]:
    """This process's cgroup paths: {'v2': path} for the unified hierarchy,
    {controller list: path} for each v1 hierarchy (/proc/self/cgroup)."""
    out = {}
    for line in _read("self", "cgroup", root).splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers or "v2"] = path
    return out


def mountinfo(root: str = PROC) -> list[tuple[str, str, str, str]]:
    """(root within the file system, mount point, type, super options) of
    each mount (/proc/self/mountinfo)."""
    out = []
    for line in _read("self", "mountinfo", root).splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((fields[3], fields[4], fields[sep + 1], fields[-1]))
    return out


def namespace(kind: str, root: str = PROC) -> str:
    """This process's namespace of ``kind`` ('mnt', 'pid', ...) as the
    kernel names it ('mnt:[4026531841]'), '' where it cannot be read."""
    try:
        return os.readlink(Path(root, "self", "ns", kind))
    except OSError:
        return ""


def mounts(root: str = PROC) -> list[tuple[str, str, str, dict[str, str]]]:
    """(device, mount point, type, options) of this process's mounts."""
    out = []
    for line in Path(root, "self", "mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4:
            options = dict(o.partition("=")[::2] for o in fields[3].split(","))
            out.append((fields[0], fields[1].replace("\\040", " "), fields[2], options))
    return out


def supplementary_groups(pid: int, root: str = PROC) -> tuple[int, ...]:
    """The process's supplementary group ids ("Groups:" of its status);
    () when the process is gone."""
    try:
        text = _read(pid, "status", root)
    except (OSError, NoSuchProcess):
        return ()
    for line in text.splitlines():
        if line.startswith("Groups:"):
            return tuple(int(g) for g in line.split()[1:])
    return ()


def pids_mapping(match: str, root: str = PROC) -> list[int]:
    """Pids (not this one) with a mapping whose path contains ``match``
    (unlinked files and memfds included: their maps line keeps the name)."""
    out = []
    for pid in pids(root):
        try:
            with open(Path(root, str(pid), "maps"), "rb") as fh:
                if any(match.encode() in line for line in fh):
                    out.append(pid)
        except OSError:
            continue  # exited, or not ours to read
    return out


def pids(root: str = PROC) -> list[int]:
    """Every process id this /proc shows, but this one, in order."""
    return sorted(int(e) for e in os.listdir(root) if e.isdigit() and int(e) != os.getpid())
