"""The backing file's format: each region aligned to the file's page size
from offset 0, then a 4 KiB header in the file's last 4 KiB (magic,
version, state, creator, boot, spec fingerprint, shard key, page size, the
regions, each loader's progress slot and the placement plan).

The header lives in the last region's page padding when that padding holds
it, else in a page of its own at the end: a table on 1 GiB pages pays
nothing for it (a whole first page would be 1 GiB per file), one on 4 KiB
pages pays one 4 KiB page.  A reader finds it from the file's size alone.
Pure data: no syscalls, no torch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..bindings import native
from ..errors import StorageError

PREFIX = "numa-engram-"
MAGIC = b"NUMAENGR"
FORMAT_VERSION = 4  # 4: the header at the end (3 and before: a whole first page)
STATE_CREATING, STATE_READY, STATE_FAILED = 0, 1, 2
STATE_NAMES = {STATE_CREATING: "CREATING", STATE_READY: "READY", STATE_FAILED: "FAILED"}
MAX_REGIONS = 16
HEADER_BYTES = 4096  # the file's last 4 KiB, whatever its page size

# magic, version, state, creator pid, creator uid, creator start time (ticks),
# boot id, fingerprint (32 raw bytes), file size, region count, then the
# shard key: layer id, head start, head end, row start, row end; page size
_HEAD = struct.Struct("<8sIIIIQ16s32sQIiIIQQQ")
_REGION = struct.Struct("<32sQQ")
STATE_OFFSET = 12
# Each loading member's progress (a counter it bumps as it goes) lives in its
# own 8-byte slot, so the others can tell a slow load from a dead loader.
PROGRESS_OFFSET = 2048
MAX_LOADERS = 64
SLOT = struct.Struct("<Q")
# The placement plan as JSON (length-prefixed): a hugetlb file keeps no
# memory policy of its own (it lives on the mapping that set it), so verify
# compares the pages with this.
PLAN_OFFSET = PROGRESS_OFFSET + MAX_LOADERS * SLOT.size
_PLAN_LEN = struct.Struct("<I")
MAX_PLAN_BYTES = HEADER_BYTES - PLAN_OFFSET - _PLAN_LEN.size


class OldFormatError(StorageError):
    """A table file of another format version: refused (tables are rebuilt,
    never migrated); gc still removes one that no process holds."""


def older_format(first_bytes: bytes, where: str) -> OldFormatError | None:
    """The error for a file whose header is where versions 3 and before put
    it (at offset 0), given its first 12 bytes; None for anything else."""
    if len(first_bytes) < 12 or first_bytes[:8] != MAGIC:
        return None
    version = struct.unpack_from("<I", first_bytes, 8)[0]
    return OldFormatError(f"{where} has format version {version} (its header at the start); "
                          f"this library reads version {FORMAT_VERSION} (the header at the "
                          "end): recreate the table with this version (`numa-engram gc` "
                          "removes an old one no process holds)")


@dataclass(frozen=True)
class ShardKey:
    """Which rows a table file holds: a layer, a head range and its rows.
    Checked at join and attach, so a member that asks for other rows with
    the same row count fails instead of reading the wrong ones."""

    layer_id: int = -1
    head_start: int = 0
    head_end: int = 0
    row_start: int = 0
    row_end: int = 0

    def __str__(self) -> str:
        return (f"layer {self.layer_id}, heads [{self.head_start}, {self.head_end}), "
                f"rows [{self.row_start}, {self.row_end})")


@dataclass(frozen=True)
class LayoutRegion:
    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class Layout:
    """Each region aligned to the page size from 0, in order, and the header
    in the last ``HEADER_BYTES`` of the file (a hugetlb file's size and
    every region start must be multiples of its huge page size: ftruncate
    and mbind refuse anything else)."""

    regions: tuple[LayoutRegion, ...]
    file_size: int
    page_size: int = native.PAGE_SIZE

    @classmethod
    def of(cls, sizes: Sequence[tuple[str, int]], page_size: int = native.PAGE_SIZE) -> Layout:
        if not sizes or len(sizes) > MAX_REGIONS:
            raise StorageError(f"a backing file holds 1 to {MAX_REGIONS} regions, got {len(sizes)}")
        page = page_size
        offset, regions = 0, []
        for name, length in sizes:
            if length <= 0:
                raise StorageError(f"region {name!r} has size {length}; sizes must be > 0")
            if len(name.encode()) > 32:
                raise StorageError(f"region name {name!r} is longer than 32 bytes")
            regions.append(LayoutRegion(name, offset, int(length)))
            offset += (int(length) + page - 1) // page * page
        if offset - (regions[-1].offset + regions[-1].length) < HEADER_BYTES:
            offset += page  # the last page's padding cannot hold the header: a page for it
        return cls(tuple(regions), offset, page)

    @property
    def header_offset(self) -> int:
        return self.file_size - HEADER_BYTES

    def region(self, name: str) -> LayoutRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise StorageError(f"the backing file has no region {name!r}; its regions are "
                           f"{[r.name for r in self.regions]}: not a table of this kind")


@dataclass(frozen=True)
class Header:
    version: int
    state: int
    creator_pid: int
    creator_uid: int
    creator_start: int
    boot_id: bytes
    fingerprint: bytes
    layout: Layout
    key: ShardKey = ShardKey()
    plan: dict | None = None  # PlacementPlan.to_dict() of the creator, if it fits

    def pack(self) -> bytes:
        """The whole header block (HEADER_BYTES), progress slots zeroed."""
        k = self.key
        head = _HEAD.pack(MAGIC, self.version, self.state, self.creator_pid, self.creator_uid,
                          self.creator_start, self.boot_id, self.fingerprint,
                          self.layout.file_size, len(self.layout.regions), k.layer_id,
                          k.head_start, k.head_end, k.row_start, k.row_end,
                          self.layout.page_size)
        regions = b"".join(_REGION.pack(r.name.encode(), r.offset, r.length)
                           for r in self.layout.regions)
        block = bytearray(HEADER_BYTES)
        block[:len(head) + len(regions)] = head + regions
        plan = pack_plan(self.plan)
        block[PLAN_OFFSET:PLAN_OFFSET + len(plan)] = plan
        return bytes(block)

    @classmethod
    def unpack(cls, data: bytes, where: str) -> Header:
        if len(data) < _HEAD.size:
            raise StorageError(f"{where} is too short ({len(data)} bytes) to be a numa_engram "
                               "backing file")
        if data[:8] != MAGIC:
            raise StorageError(f"{where} is not a numa_engram backing file (magic {data[:8]!r})")
        version = struct.unpack_from("<I", data, 8)[0]
        if version != FORMAT_VERSION:
            raise OldFormatError(f"{where} has format version {version}, this library reads "
                                 f"{FORMAT_VERSION}; recreate the table with this version")
        (magic, version, state, pid, uid, start, boot, fp, size, count,
         *key, page) = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise StorageError(f"{where} is not a numa_engram backing file (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise StorageError(f"{where} has format version {version}, this library reads "
                               f"{FORMAT_VERSION}; recreate the table with this version")
        if page < native.PAGE_SIZE or page & (page - 1) or size % page or size < page:
            raise StorageError(f"{where} has a corrupt header: page size {page} with file "
                               f"size {size}")
        if not 0 < count <= MAX_REGIONS:
            raise StorageError(f"{where} header claims {count} regions (1 to {MAX_REGIONS})")
        if len(data) < _HEAD.size + count * _REGION.size:
            raise StorageError(f"{where} is too short ({len(data)} bytes) for its header")
        regions: list[LayoutRegion] = []
        for i in range(count):
            name, offset, length = _REGION.unpack_from(data, _HEAD.size + i * _REGION.size)
            try:
                text = name.rstrip(b"\0").decode()
            except UnicodeDecodeError:
                raise StorageError(f"{where} has a corrupt header (region {i} name)") from None
            if offset % page or offset + length > size - HEADER_BYTES:
                raise StorageError(f"{where} has a corrupt header: region {text!r} "
                                   f"[{offset}, {offset + length}) is not inside the "
                                   f"{size - HEADER_BYTES} bytes before the header")
            # regions follow each other, in order
            floor = regions[-1].offset + regions[-1].length if regions else 0
            if offset < floor:
                raise StorageError(f"{where} has a corrupt header: region {text!r} starts at "
                                   f"{offset}, inside region {regions[-1].name!r} (which ends "
                                   f"at {floor})")
            regions.append(LayoutRegion(text, offset, length))
        return cls(version, state, pid, uid, start, boot, fp,
                   Layout(tuple(regions), size, page), ShardKey(*key), unpack_plan(data))


def pack_plan(plan: dict | None) -> bytes:
    """Length-prefixed JSON, or nothing when there is no plan or it does not
    fit (verify then asks the kernel for the policy, as for any tmpfs file)."""
    if plan is None:
        return b""
    text = json.dumps(plan, separators=(",", ":")).encode()
    return _PLAN_LEN.pack(len(text)) + text if len(text) <= MAX_PLAN_BYTES else b""


def unpack_plan(data: bytes) -> dict | None:
    if len(data) < PLAN_OFFSET + _PLAN_LEN.size:
        return None
    (length,) = _PLAN_LEN.unpack_from(data, PLAN_OFFSET)
    if not 0 < length <= MAX_PLAN_BYTES:
        return None
    start = PLAN_OFFSET + _PLAN_LEN.size
    try:
        plan = json.loads(data[start:start + length])
    except ValueError:
        return None
    return plan if isinstance(plan, dict) else None
