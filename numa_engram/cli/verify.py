"""numa-engram verify: where a table's pages are (a file, or every table a live process holds)."""

from __future__ import annotations

import argparse
import os

from ..errors import StorageError
from .args import emit, positive_int


def cmd_verify(args: argparse.Namespace) -> int:
    """Where the pages of table files are, against the policy stored on each:
    a file by path, or every table a running process holds (--pid), unlinked
    and memfd ones included."""
    from ..host import procfs

    if args.pid is not None:
        targets: list[tuple[str, int | None]] = [
            (f"pid {args.pid} fd {fd} ({name})", procfs.open_fd(args.pid, fd))
            for fd, name in _tables_held(procfs.check_pid(args.pid))]
        if not targets:
            raise StorageError(f"pid {args.pid} holds no numa_engram table")
    elif args.path:
        targets = [(args.path, None)]
    else:
        targets = _live_tables()
        if not targets:
            emit(args, [], "no live numa_engram table on this host (none held by a process "
                           "this user may look at)")
            return 0
    docs, texts, ok = [], [], True
    for label, fd in targets:
        doc, text = _verify_one(label, args.path if fd is None else None, fd)
        docs.append(doc)
        texts.append(text)
        ok &= doc["report"]["ok"]
    emit(args, docs if args.path is None else docs[0], "\n".join(texts))
    return 0 if ok else 1



def _tables_held(pid: int) -> list[tuple[int, str]]:
    """(fd, link target) of every table file or memfd ``pid`` holds open."""
    from ..host import procfs
    from ..store.fileformat import PREFIX

    return [(fd, name) for fd, name in procfs.fd_targets(pid) if PREFIX in name]


def _live_tables() -> list[tuple[str, int | None]]:
    """Every table some process holds open, once each (by file identity),
    as (label, our descriptor of it)."""
    from ..host import procfs

    seen: set[tuple[int, int]] = set()
    out: list[tuple[str, int | None]] = []
    for pid in procfs.pids():
        try:
            held = _tables_held(pid)
        except (StorageError, OSError):
            continue  # gone, or another user's
        for fd, name in held:
            try:
                mine = procfs.open_fd(pid, fd)
            except StorageError:
                continue
            st = os.fstat(mine)
            if (st.st_dev, st.st_ino) in seen:
                os.close(mine)
                continue
            seen.add((st.st_dev, st.st_ino))
            out.append((f"pid {pid} fd {fd} ({name})", mine))
    return out


def _verify_one(label: str, path: str | None, fd: int | None) -> tuple[dict, str]:
    from ..store.fileformat import STATE_NAMES
    from ..store.placement import PlacementPlan, plan_of_mapping, verify
    from ..store.storage import BackingFile

    holder = "in use by that process" if fd is not None else _holder_status(path)
    try:
        with BackingFile.attach(path, fd=fd) as f:
            # the creator's plan from the header (a hugetlb file keeps no policy
            # of its own); else the policy the kernel stores on the file
            ranges = [(r.name, r.offset, r.length) for r in f.layout.regions]
            plan = (PlacementPlan.from_dict(f.header.plan) if f.header.plan
                    else plan_of_mapping(f.mapping, ranges))
            report = verify(f.mapping, plan)
            state = STATE_NAMES.get(f.state, "?")
    finally:
        if fd is not None:
            os.close(fd)
    return ({"table": label, "state": state, "holder": holder, "report": report.to_dict()},
            f"{label} [{state}; {holder}]\n{report.format()}")



def _holder_status(path: str | None) -> str:
    """Whether a live process holds the table (each holder keeps a lock on
    it for its life, whatever pid namespace it runs in)."""
    from ..store.gc import OPEN_TO_INSPECT, holders_alive

    if path is None:
        return "holder unknown"
    try:
        fd = os.open(path, OPEN_TO_INSPECT)
    except OSError:
        return "holder unknown"
    try:
        alive = holders_alive(fd)
    finally:
        os.close(fd)
    return {True: "in use", None: "liveness unknown",
            False: "creator dead: no process holds it (numa-engram gc removes it)"}[alive]


HELP = ("report where a table's pages are (every live table, a "
        "file, or a process's)")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram verify``'s arguments."""
    sp.add_argument("path", nargs="?", help="a table file (none: every table a live process "
                    "holds, each once)")
    sp.add_argument("--pid", type=positive_int, help="every table this process holds")
