import fcntl
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.errors import (
    CapacityError,
    PlacementError,
    SpecMismatchError,
    StorageError,
    TopologyError,
)
from numa_engram.store.directories import check_directory, check_shmem_thp
from numa_engram.store.fileformat import FORMAT_VERSION, MAGIC, PREFIX, Layout
from numa_engram.store.placement import PlacementPlan, PlacementRange
from numa_engram.store.storage import BackingFile

from .conftest import SHM, run_python, shm_files

FP = bytes(range(32))
LAYOUT = Layout.of([("weights", 3 * native.PAGE_SIZE + 5), ("scales", 100)])


@pytest.fixture
def backing():
    f = BackingFile.create(LAYOUT, FP)
    yield f
    f.close()


def test_layout_regions_are_page_aligned_from_0_and_the_header_ends_the_file():
    page = native.PAGE_SIZE
    assert [(r.offset, r.length) for r in LAYOUT.regions] == [(0, 3 * page + 5),
                                                               (4 * page, 100)]
    # the last page's padding (4096 - 100 bytes) cannot hold the header: a page of its own
    assert LAYOUT.file_size == 6 * page and LAYOUT.header_offset == 5 * page
    roomy = Layout.of([("w", 3 * page + 5), ("s", 2 * page)], 4 * page)  # 16 KiB "pages"
    assert roomy.file_size == 8 * page  # the header in the padding of the last one
    assert roomy.header_offset == 7 * page >= roomy.regions[-1].offset + 2 * page


def test_create_writes_header_and_mode_0600(backing):
    st = os.stat(backing.path)
    assert oct(st.st_mode & 0o777) == "0o600" and st.st_size == LAYOUT.file_size
    assert os.path.basename(backing.path).startswith(PREFIX)
    h = backing.read_header()
    assert h.creator_pid == os.getpid() and h.fingerprint == FP and h.state == 0
    assert h.layout == LAYOUT
    backing.mark_ready()
    assert backing.state == 1


def test_peer_in_another_process_sees_the_bytes(backing):
    backing.region("weights")[:3] = [7, 8, 9]
    out = run_python("""
        import sys
        from numa_engram.store.storage import BackingFile
        f = BackingFile.attach(sys.argv[1], fingerprint=bytes(range(32)))
        print(f.region("weights")[:3].tolist())
        f.close()
    """, backing.path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[7, 8, 9]"


def test_unlink_keeps_memory_alive(backing):
    peer = BackingFile.attach(backing.path, fingerprint=FP)
    backing.region("scales")[0] = 42
    backing.unlink()
    assert not os.path.exists(backing.path)
    assert peer.region("scales")[0] == 42
    peer.close()


def test_close_is_idempotent(backing):
    backing.close()
    backing.close()
    assert not os.path.exists(backing.path)


def test_size_larger_than_free_tmpfs_is_refused_before_creating():
    huge = Layout.of([("weights", native.statvfs("/dev/shm")[1] * 2)])
    before = shm_files()
    with pytest.raises(CapacityError, match="GiB free"):
        BackingFile.create(huge, FP)
    assert shm_files() == before


def test_missing_directory():
    with pytest.raises(StorageError, match="does not exist"):
        BackingFile.create(LAYOUT, FP, directory="/no/such/dir")


@pytest.mark.parametrize("plan, error, match", [
    (PlacementPlan((PlacementRange("w", 4097, 4096, "bind", (0,)),)), PlacementError, "aligned"),
    (PlacementPlan((PlacementRange("w", 4096, 1 << 30, "bind", (0,)),)), PlacementError,
     "outside the file"),
    (PlacementPlan((PlacementRange("w", 4096, 4096, "bind", (7,)),)), TopologyError,
     "node 7 does not exist"),
    (PlacementPlan((PlacementRange("w", 4096, 4096, "bind", ()),)), TopologyError,
     "empty node set"),
    (PlacementPlan((PlacementRange("w", 4096, 8192, "bind", (0,)),
                    PlacementRange("s", 8192, 4096, "bind", (0,)))), PlacementError, "overlap"),
])
def test_bad_plans_are_refused_and_leave_nothing(plan, error, match):
    before = shm_files()
    with pytest.raises(error, match=match):
        BackingFile.create(LAYOUT, FP, placement=plan)
    assert shm_files() == before


def _foreign(tmp_name: str, data: bytes) -> str:
    path = f"/dev/shm/{PREFIX}{tmp_name}"
    with open(path, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)
    return path


def test_wrong_magic_is_refused():
    path = _foreign("test-magic", b"\0" * LAYOUT.file_size)
    try:
        with pytest.raises(StorageError, match="not a numa_engram backing file"):
            BackingFile.attach(path)
    finally:
        os.unlink(path)


def test_other_format_version_is_refused(backing):
    os.pwrite(backing.fd, struct.pack("<I", 99), LAYOUT.header_offset + 8)
    with pytest.raises(StorageError, match="format version 99"):
        BackingFile.attach(backing.path)


def test_a_version_3_file_is_refused_by_attach_and_removed_by_gc_once_unheld():
    """Versions 3 and before kept the header in a whole first page: such a
    file is refused naming both versions; gc, deciding by its lock, removes
    it once no process holds it and keeps it while one does."""
    from numa_engram.store.fileformat import OldFormatError
    from numa_engram.store.gc import gc_stale_files

    path = os.path.join(SHM, f"{PREFIX}test-v3")
    with open(path, "wb") as f:  # a v3 file: magic and version 3 at offset 0
        f.write((MAGIC + struct.pack("<I", 3)).ljust(3 * native.PAGE_SIZE, b"\0"))
    try:
        with pytest.raises(OldFormatError, match="format version 3 .*its header at the start.* "
                                                 "reads version 4"):
            BackingFile.attach(path)
        holder = os.open(path, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)
        try:
            kept = [e for e in gc_stale_files(SHM) if e.path == path]
            assert kept and not kept[0].removed and "in use" in kept[0].reason
        finally:
            os.close(holder)
        gone = [e for e in gc_stale_files(SHM) if e.path == path]
        assert gone and gone[0].removed and "older format" in gone[0].reason
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_truncated_file_is_refused(backing):
    os.ftruncate(backing.fd, LAYOUT.file_size - native.PAGE_SIZE)
    with pytest.raises(StorageError, match="truncated"):
        BackingFile.attach(backing.path)


def test_symlink_is_refused(backing):
    link = f"/dev/shm/{PREFIX}test-link"
    os.symlink(backing.path, link)
    try:
        with pytest.raises(StorageError, match="symlink"):
            BackingFile.attach(link)
    finally:
        os.unlink(link)


def test_other_owner_is_refused(backing):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another uid")
    os.fchown(backing.fd, 4321, -1)
    with pytest.raises(StorageError, match="owned by uid 4321"):
        BackingFile.attach(backing.path)


def test_fingerprint_mismatch(backing):
    with pytest.raises(SpecMismatchError, match="same EngramSpec"):
        BackingFile.attach(backing.path, fingerprint=b"\1" * 32)


def test_shmem_thp_force_is_refused(tmp_path):
    knob = tmp_path / "kernel" / "mm" / "transparent_hugepage" / "shmem_enabled"
    knob.parent.mkdir(parents=True)
    knob.write_text("always within_size advise never deny [force]\n")
    with pytest.raises(StorageError, match="echo never"):
        check_shmem_thp(root=str(tmp_path))
    knob.write_text("always within_size advise [never] deny force\n")
    check_shmem_thp(root=str(tmp_path))
    check_shmem_thp(root=str(tmp_path / "none"))  # a kernel without the knob: nothing to refuse


def _plausible_header(regions, size):
    """A header that passes the magic/version/uid/size checks, with fuzzed regions."""
    head = struct.pack("<8sIIIIQ16s32sQIiIIQQ", MAGIC, FORMAT_VERSION, 1, 1, os.geteuid(), 0,
                       b"\0" * 16, b"\0" * 32, size, len(regions), 1, 0, 1, 0, 1)
    return head + b"".join(struct.pack("<32sQQ", n, o, ln) for n, o, ln in regions)


header_bodies = st.one_of(
    st.binary(max_size=600).map(lambda b: (b, None)),
    st.builds(lambda regions, pages: (_plausible_header(regions, pages * 4096), pages * 4096),
              st.lists(st.tuples(st.binary(max_size=32), st.integers(0, 2**64 - 1),
                                 st.integers(0, 2**64 - 1)), max_size=17),
              st.integers(1, 4)))


@settings(max_examples=200, deadline=None)
@given(header_bodies, st.integers(0, 3))
def test_fuzzed_headers_are_refused_cleanly(body, extra_pages):
    """Whatever bytes a file holds, attach either works or raises StorageError;
    a region view outside the mapping is refused, never a crash or SIGBUS."""
    data, size = body
    path = f"/dev/shm/{PREFIX}test-fuzz"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        total = size or native.PAGE_SIZE * (1 + extra_pages)
        os.ftruncate(fd, total)
        os.pwrite(fd, data[:4096], total - 4096)  # where the header is read
        try:
            f = BackingFile.attach(path)
        except StorageError:
            return
        with f:
            for region in f.layout.regions:
                try:
                    f.region(region.name)[:1].tobytes()
                except ValueError:
                    pass
    finally:
        os.close(fd)
        os.unlink(path)


# ------------------------------------------ a corrupt header on attach --

def _corrupt(kind: str):
    """A table file of a small spec whose header's layout is damaged."""
    from dataclasses import replace

    from numa_engram.store.fileformat import STATE_READY, Header, LayoutRegion
    from numa_engram.tables.request import shard_key, table_layout

    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    layout = table_layout(spec, shard)
    f = BackingFile.create(layout, spec.fingerprint, directory="/dev/shm",
                           key=shard_key(1, shard))
    w, s = layout.regions
    regions = {"overlap": (w, LayoutRegion("scales", w.offset, s.length)),
               "over-header": (w, LayoutRegion("scales", s.offset, layout.file_size - s.offset)),
               "row-short": (LayoutRegion("weights", w.offset, w.length - spec.head_dim), s),
               }[kind]
    bad = replace(f.header, state=STATE_READY, layout=replace(layout, regions=regions))
    os.pwrite(f.fd, Header.pack(bad), layout.header_offset)
    return spec, shard, f


def _request(spec, shard):
    from numa_engram.tables.request import CreateRequest, TableOptions

    return CreateRequest.of(spec, 1, shard, "auto", None,
                            TableOptions(directory="/dev/shm", timeout_s=30, lookup_threads=1,
                                         load_threads=1, shared_load=False))


@pytest.mark.parametrize("kind, text", [
    ("overlap", "region 'scales' starts at 0, inside region 'weights'"),
    ("over-header", r"region 'scales' \[\d+, \d+\) is not inside the \d+ bytes before the "
                    "header"),
    ("row-short", r"header: region 'weights' length is \d+, expected \d+; a corrupt header"),
])
def test_a_corrupt_header_layout_is_refused_on_attach_naming_the_field(kind, text):
    from numa_engram.tables.protocol import peer_attach

    spec, shard, f = _corrupt(kind)
    try:
        with pytest.raises(StorageError, match=text):
            SharedEngramTable.attach(spec, 1, shard, fd=f.fd)
        with pytest.raises(StorageError, match=text):  # as a peer maps it, by path
            peer_attach(f.path, _request(spec, shard))
    finally:
        f.close()


def test_directory_must_be_a_real_tmpfs_directory(tmp_path):
    if os.statvfs(str(tmp_path)).f_fsid and _is_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is itself a tmpfs here")
    with pytest.raises(StorageError, match="not on tmpfs or hugetlbfs"):
        check_directory(str(tmp_path))
    link = tmp_path / "link"
    link.symlink_to(SHM)
    with pytest.raises(StorageError, match="is a symlink"):
        check_directory(str(link))
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        check_directory(str(regular))
    with pytest.raises(StorageError, match="not on tmpfs"):
        BackingFile.create(Layout.of([("w", 4096)]), bytes(32), directory=str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]



def _is_tmpfs(path) -> bool:
    from numa_engram.bindings import native

    return native.statfs_type(str(path)) == native.TMPFS_MAGIC



def test_header_with_no_regions_is_refused(tmp_path):
    import struct

    from numa_engram.store.fileformat import FORMAT_VERSION, MAGIC

    path = os.path.join(SHM, f"{PREFIX}test-noregions")
    head = struct.pack("<8sIIIIQ16s32sQIiIIQQQ", MAGIC, FORMAT_VERSION, 1, 1, os.geteuid(), 0,
                       b"\0" * 16, b"\0" * 32, 8192, 0, 1, 0, 1, 0, 1, 4096)
    with open(path, "wb") as f:
        f.write(head.ljust(4096, b"\0").rjust(8192, b"\0"))  # the header: the last 4 KiB
    try:
        with pytest.raises(StorageError, match="0 regions"):
            BackingFile.attach(path)
    finally:
        os.unlink(path)
