"""Loading a shared table from a checkpoint, split over its sharing group.

The members on the NUMA nodes the rows are bound to each copy an equal
part of the rows (their writes stay on their node, and N loaders bring N
times the memory bandwidth); when no member sits there, the leader loads
alone.  Each loader publishes the bytes it has copied in its own progress
slot of the header and sets the slot's DONE bit at the end; everybody then
waits until every loader is done, as long as some loader keeps advancing,
so a slow load is never mistaken for a dead loader.  A loader that fails
marks the table FAILED, which ends every wait at once.  No torch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..checkpoints.familyreaders import reader_of
from ..errors import GroupTimeout, PeerLoadFailed
from ..store.fileformat import MAX_LOADERS, STATE_FAILED
from ..store.storage import BackingFile

DONE = 1 << 63
POLL_S = 0.05


def load_parts(num_rows: int, member_nodes: Sequence[int],
               bound_nodes: Sequence[int] | None, cooperative: bool) -> list[tuple[int, int]]:
    """The row range [a, b) each member loads (empty for most).  Members on
    ``bound_nodes`` (None: pages on every node, e.g. interleave) share the
    rows evenly; nobody there, or not ``cooperative``: member 0 loads all."""
    loaders = [i for i, node in enumerate(member_nodes)
               if bound_nodes is None or node in bound_nodes][:MAX_LOADERS]
    if not cooperative or not loaders:
        loaders = [0]
    parts = [(0, 0)] * len(member_nodes)
    for k, member in enumerate(loaders):
        parts[member] = (num_rows * k // len(loaders), num_rows * (k + 1) // len(loaders))
    return parts


def loaders_of(parts: Sequence[tuple[int, int]]) -> list[int]:
    """Members with rows to load, and member 0 (which always reports)."""
    return [i for i, (a, b) in enumerate(parts) if b > a or i == 0]


def load_part(backing: BackingFile, spec, layer_id: int, shard, checkpoint, names,
              part: tuple[int, int], slot: int, threads: int, cpus: Sequence[int],
              report: Callable[[], None]) -> None:
    """Copy rows ``part`` of the shard, publishing the bytes done in
    ``slot`` (and calling ``report()``) after each chunk, then the DONE bit;
    on any error the table is marked FAILED before the error goes on."""
    a, b = part
    try:
        reader = reader_of(spec) if checkpoint is not None else None
        if b > a and reader is not None:
            if threads > 1:
                backing.prefault(threads, _spans(backing, spec, a, b))

            def chunk_done(done: int, _total: int) -> None:
                backing.write_progress(slot, done)
                report()
            reader.load(backing, checkpoint, spec, layer_id, shard, part, names,
                        progress=chunk_done, threads=threads, cpus=cpus)
        if slot == 0 and reader is not None:
            reader.finish(backing, checkpoint)
        backing.write_progress(slot, DONE | (b - a) * spec.row_bytes)
    except BaseException:
        backing.set_state(STATE_FAILED)
        raise


def bytes_done(backing: BackingFile, loaders: Sequence[int]) -> int:
    """Bytes copied so far by all loaders together."""
    slots = backing.read_progress()
    return sum(slots[i] & ~DONE for i in loaders)


def wait_for_parts(backing: BackingFile, loaders: Sequence[int], timeout_s: float,
                   progress: Callable[[], None] | None = None) -> None:
    """Until every loader's slot is DONE; no slot advancing for timeout_s is
    a GroupTimeout naming the loaders not done, FAILED a StorageError.
    ``progress()`` is called whenever some slot advanced (the group's
    progress keeps moving after this member's own part is done)."""
    last, deadline = None, time.monotonic() + timeout_s
    while True:
        if backing.state == STATE_FAILED:
            raise PeerLoadFailed("a member failed to load its part of the table (its error "
                               "follows from that member)")
        slots = backing.read_progress()
        pending = [i for i in loaders if not slots[i] & DONE]
        if not pending:
            return
        now = tuple(slots[i] for i in loaders)
        if now != last:
            last, deadline = now, time.monotonic() + timeout_s
            if progress is not None:
                progress()
        elif time.monotonic() > deadline:
            raise GroupTimeout(f"step 'load': member(s) {pending} made no progress loading "
                               f"their part of the table for {timeout_s:.0f} s (stopped, hung "
                               "or dead)")
        time.sleep(POLL_S)


def _spans(backing: BackingFile, spec, a: int, b: int) -> list[tuple[int, int]]:
    """Page-aligned byte spans of rows [a, b) in each row region."""
    page = backing.mapping.page_size
    out = []
    for name, width in spec.row_regions():
        region = backing.layout.region(name)
        start = (region.offset + a * width) // page * page
        end = -(-(region.offset + b * width) // page) * page
        out.append((start, min(end, backing.mapping.length) - start))
    return out
