"""numa-engram gc: remove table files nobody holds, and the hand-over
directories of tables whose holders were all killed."""

from __future__ import annotations

import argparse

from ..literals import DEFAULT_DIRECTORY
from .args import emit


def cmd_gc(args: argparse.Namespace) -> int:
    from ..store.gc import gc_handover_directories, gc_stale_files
    from ..units import text_table, unit_for
    from ..userfiles import printable

    entries = gc_stale_files(args.directory, dry_run=args.dry_run, all_users=args.all_users)
    entries += gc_handover_directories(args.handover_root, dry_run=args.dry_run)

    def verdict(e) -> str:
        if e.removed:
            return "removed"
        return "would remove" if e.reason.startswith("stale") else e.reason.split(":")[0]

    def why(e) -> str:  # the reason without the verdict and the path the row already shows
        text = e.reason.split(": ", 1)[-1]
        return text.replace(f"{e.path} ", "").replace(e.path, "the file")

    unit = unit_for(*(e.size for e in entries))
    # every cell escaped: a file's name (or an error quoting it) holding a
    # newline must not forge a row
    table = text_table(["verdict", "file", unit[0], "why"],
                       [[printable(verdict(e)), printable(e.path), f"{e.size / unit[1]:.2f}",
                         printable(why(e))] for e in entries], left=2, text_last=True)
    emit(args, [vars(e) for e in entries], table if entries else "no numa_engram files")
    return 0


HELP = "remove table files no live process holds, and dead tables' hand-over directories"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram gc``'s arguments."""
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY, help="where to look")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    sp.add_argument("--handover-root", default=None,
                    help="where 4 KiB dp_shared tables' hand-over directories are made "
                         "(default: $XDG_RUNTIME_DIR where it is ours, else the temporary "
                         "directory)")
    sp.add_argument("--all-users", action="store_true",
                    help="root only: include other users' files (else only your own)")
