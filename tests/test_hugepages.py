"""Tables on 2 MiB hugetlb pages: a hugetlbfs file (shared) or an
MFD_HUGETLB memfd (private), checked against the pool before anything is
allocated.  Needs root to reserve a pool (the ``huge_pool`` fixture skips,
saying why, where it cannot); placement per node runs in the NUMA guests
(tests/test_numa_hugepages.py)."""

import os

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint
from numa_engram.errors import CapacityError, StorageError
from numa_engram.host import hugepages, procfs
from numa_engram.lookup.cpu import reference_lookup
from numa_engram.store.fileformat import Layout
from numa_engram.store.storage import BackingFile

from .conftest import run_python
from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world
from .support.dist_scenarios import make_spec

MIB2 = 2 << 20
ROWS_PER_HEAD = 4000  # ~4 MiB per layer: 3 huge pages with the header


def _free() -> int:
    return hugepages.pool_pages(MIB2)


def _exact(table: SharedEngramTable, spec: EngramSpec, layer: int, ids: np.ndarray) -> bool:
    got = table.lookup(ids)
    want = reference_lookup(table.weights, table.scales, ids, head_start=table.shard.head_start,
                            bucket_sizes=spec.bucket_sizes(layer))
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_page_sizes_parse_and_name_the_choices():
    assert hugepages.parse_page_size("2M") == MIB2
    assert hugepages.parse_page_size("1g") == 1 << 30
    assert hugepages.parse_page_size("4KiB") == 4096
    with pytest.raises(StorageError, match=r"'3M' is not one of \['4K', '2M', '1G'\]"):
        hugepages.parse_page_size("3M")


def test_a_missing_mount_says_how_to_mount_one(tmp_path):
    proc = tmp_path / "proc"  # a /proc laid out for procfs's readers
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mounts").write_text("tmpfs /dev/shm tmpfs rw 0 0\n"
                                          "none /mnt/huge1g hugetlbfs rw,pagesize=1024M 0 0\n"
                                          "none /mnt/huge\\040x hugetlbfs rw 0 0\n")
    (proc / "meminfo").write_text("MemTotal: 100 kB\nHugepagesize:    4096 kB\n")
    with pytest.raises(StorageError, match="mount -t hugetlbfs -o pagesize=2M"):
        hugepages.find_mount(MIB2, str(proc))
    assert hugepages.find_mount(1 << 30, str(proc)) == "/mnt/huge1g"
    # no pagesize= option: the default huge page size (4 MiB in this meminfo)
    assert hugepages.find_mount(4 << 20, str(proc)) == "/mnt/huge x"


def test_page_tables_per_process_shrink_512_fold():
    table = 190 << 30
    assert hugepages.page_table_bytes(table, 4096) == 380 << 20
    assert hugepages.page_table_bytes(table, MIB2) * 512 == hugepages.page_table_bytes(table, 4096)


def test_layout_aligns_every_region_to_the_huge_page():
    layout = Layout.of([("weights", 5 << 20), ("scales", 1000)], MIB2)
    assert [r.offset for r in layout.regions] == [0, 3 * MIB2]
    # the header in the last page's padding: no page of its own
    assert layout.file_size == 4 * MIB2 and layout.page_size == MIB2
    assert layout.header_offset == 4 * MIB2 - 4096


@pytest.mark.parametrize("page", [4096, MIB2, 1 << 30], ids=["4K", "2M", "1G"])
def test_the_header_costs_at_most_a_small_page_for_every_v41_flash_shard(page):
    """V4.1 Flash at TP 1, 2, 4 and 8, both layers, every shard: the file is
    its regions rounded to the page size plus at most 2 MiB (at 1 GiB pages
    exactly the rounded regions: the header sits in the scales' padding; a
    whole header page was 8 GiB per copy at TP 4 x 2 layers)."""
    from numa_engram.model.sharding import shard_heads
    from numa_engram.model.spec import EngramSpec
    from numa_engram.tables.request import table_layout

    spec = EngramSpec.named("v4-flash")
    for tp in (1, 2, 4, 8):
        for layer in spec.layer_ids:
            for rank in range(tp):
                layout = table_layout(spec, shard_heads(spec.bucket_sizes(layer), tp, rank),
                                      page)
                rounded = sum(-(-r.length // page) * page for r in layout.regions)
                assert rounded <= layout.file_size <= rounded + max(4096, min(page, MIB2))
                if page == 1 << 30:
                    assert layout.file_size == rounded
                last = layout.regions[-1]
                assert last.offset + last.length <= layout.header_offset


def test_private_table_on_a_hugetlb_memfd_is_bit_exact(tmp_path, huge_pool):
    spec = make_spec(ROWS_PER_HEAD)
    ckpt = write_synthetic_checkpoint(tmp_path / "engram.safetensors", spec)
    layer = spec.layer_ids[0]
    shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
    huge_pool.reserve(8)
    before = _free()
    with SharedEngramTable.create(spec, layer, shard, checkpoint=str(ckpt),
                                  page_size="2M") as table:
        assert table.path.startswith("memfd:")
        pages = table.backing_bytes // MIB2
        assert before - _free() == pages, "the table's pages come from the pool"
        assert procfs.smaps("self", table.path).page_size == MIB2
        ids = np.random.default_rng(0).integers(0, 1 << 40, (500, spec.n_hash_cols))
        ids %= np.asarray(spec.bucket_sizes(layer))
        assert _exact(table, spec, layer, ids)
    assert _free() == before, "closing the table gives its pages back"


def test_shared_table_on_hugetlbfs_is_one_copy_for_the_group(tmp_path, huge_pool):
    spec = make_spec(ROWS_PER_HEAD)
    ckpt = str(write_synthetic_checkpoint(tmp_path / "engram.safetensors", spec))
    huge_pool.reserve(16)
    in_use = hugepages.bytes_in_use()
    results = run_world(2, scenarios.share, tp=1, dp=2, mode="dp_shared", checkpoint=ckpt,
                        rows_per_head=ROWS_PER_HEAD, page_size="2M",
                        directory=huge_pool.mount)
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('traceback') or r}"
        assert r["same_as_source"] and r["lookup_exact"] and r["path_gone"]
        assert r["kernel_page_size"] == MIB2
        assert r["placement"]["ok"]
        # both mapped one file: the pool lent its pages once
        assert r["huge_in_use"] - in_use == r["backing_bytes"]
    assert len({r["digest"] for r in results}) == 1
    assert not os.listdir(huge_pool.mount)


def test_a_pool_too_small_is_a_capacity_error_before_anything_exists(huge_pool):
    got = huge_pool.reserve(2)
    before = _free()
    code = f"""
        from numa_engram.errors import CapacityError
        from numa_engram.store.fileformat import Layout
        from numa_engram.store.storage import BackingFile
        for directory in ({huge_pool.mount!r}, None):
            try:
                BackingFile.create(Layout.of([("w", 16 << 20)], 2 << 20), bytes(32),
                                   directory=directory)
            except CapacityError as exc:
                print("refused:", exc)
    """
    child = run_python(code)
    assert child.returncode == 0, child.stderr  # never SIGBUS
    lines = child.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") for line in lines), child.stdout
    assert f"pool has {got} free" in lines[0] and "nr_hugepages" in lines[0]
    assert _free() == before and not os.listdir(huge_pool.mount)


def test_verify_reads_the_plan_from_a_hugetlb_files_header(huge_pool):
    from numa_engram.store.placement import PlacementPlan, PlacementRange

    huge_pool.reserve(4)
    layout = Layout.of([("w", 3 << 20)], MIB2)
    plan = PlacementPlan((PlacementRange("w", 0, 3 << 20, "bind", (0,)),), "node:0")
    with BackingFile.create(layout, bytes(32), directory=huge_pool.mount, placement=plan) as f:
        child = run_python(f"""
            import sys
            from numa_engram.cli.app import main
            sys.exit(main(["verify", {f.path!r}]))
        """)
        assert f.header.plan["policy"] == "node:0"
    assert child.returncode == 0, child.stderr
    assert "bind" in child.stdout and "100.0%" in child.stdout
    assert "pages of 2 MiB: Node 0=2" in child.stdout, child.stdout


def test_members_must_agree_on_the_page_size(tmp_path, huge_pool):
    results = run_world(2, scenarios.other_page_size, directory=huge_pool.mount)
    assert all(not r["ok"] and r["error_type"] == "StorageError" for r in results), results
    assert all("page_size" in r["message"] for r in results)


def test_a_directory_of_another_page_size_is_refused(huge_pool):
    with pytest.raises(StorageError, match="is not a hugetlbfs mount of 1G pages"):
        hugepages.resolve_directory(huge_pool.mount, 1 << 30, "/dev/shm")
    with pytest.raises(StorageError, match="is not a hugetlbfs mount of 2M pages"):
        hugepages.resolve_directory("/dev/shm/", MIB2, "/dev/shm")
    with pytest.raises(CapacityError):
        hugepages.check_pool(1 << 40, MIB2)


def test_a_private_table_needs_no_hugetlbfs_mount(tmp_path, huge_pool):
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    huge_pool.reserve(4)
    # tmp_path is no hugetlbfs mount: a private table lives on a memfd anyway
    with SharedEngramTable.create(spec, 1, shard, page_size="2M",
                                  directory=str(tmp_path)) as table:
        assert table.path.startswith("memfd:") and table.mode == "independent"
        assert procfs.smaps("self", table.path).page_size == MIB2


def test_one_gib_pages_for_shared_and_private_tables(gib_pool):
    from numa_engram.store.placement import PlacementPlan, PlacementRange

    gib = 1 << 30
    layout = Layout.of([("w", 300 << 20)], gib)  # one page: rows, then the header
    assert layout.file_size == gib
    plan = PlacementPlan((PlacementRange("w", 0, 300 << 20, "bind", (0,)),), "node:0")
    free = hugepages.pool_pages(gib)
    for directory in (gib_pool.mount, None):
        with BackingFile.create(layout, bytes(32), directory=directory, placement=plan) as f:
            assert hugepages.pool_pages(gib) == free - 1
            assert procfs.smaps("self", f.path).page_size == gib
            f.region("w")[:] = 7
            assert f.region("w")[-1] == 7
        assert hugepages.pool_pages(gib) == free


def test_a_mount_size_below_the_table_is_a_capacity_error_up_front(tmp_path, huge_pool):
    import subprocess

    small = tmp_path / "small-mount"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,size=4M,mode=0700",
                              "none", str(small)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs with size=: {mounted.stderr.strip()}")
    try:
        before = _free()
        with pytest.raises(CapacityError, match=rf"the hugetlbfs mount {small} is limited to "
                                                r"4\.00 MiB \(size=\) with 4\.00 MiB free, but "
                                                r"the table needs 6\.00 MiB; raise it: "
                                                rf"mount -o remount,size=6M {small}"):
            BackingFile.create(Layout.of([("w", 4 << 20)], MIB2), bytes(32),
                               directory=str(small))
        assert _free() == before and not os.listdir(small)
    finally:
        subprocess.run(["umount", "-l", str(small)])


TAKE_POOL = """
import mmap, os, sys
pages = int(sys.argv[1])
fd = os.memfd_create("taker", os.MFD_HUGETLB)
os.ftruncate(fd, pages << 21)
m = mmap.mmap(fd, pages << 21)
for i in range(pages):
    m[i << 21] = 1
print("taken", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("directory", ["mount", None], ids=["hugetlbfs", "memfd"])
def test_a_pool_taken_after_the_check_is_a_capacity_error(huge_pool, monkeypatch, directory):
    """Another process takes the pool between the check and the mapping: a
    CapacityError naming the pool and the fix, never a raw ENOMEM, and
    nothing left behind."""
    import subprocess
    import sys

    from numa_engram.store import storage

    free = huge_pool.reserve(4)
    checked = storage._check_room
    taker: list[subprocess.Popen] = []

    def check_then_lose_the_pool(*args, **kwargs):
        checked(*args, **kwargs)  # the pool has room here...
        taker.append(subprocess.Popen([sys.executable, "-c", TAKE_POOL, str(free - 1)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        assert taker[0].stdout.readline().strip() == "taken"  # ...and not any more
    monkeypatch.setattr(storage, "_check_room", check_then_lose_the_pool)
    target = huge_pool.mount if directory == "mount" else None
    try:
        with pytest.raises(CapacityError, match=r"mmap: the 2M huge page pool ran out .*"
                                                r"reserve more \(echo \d+ > .*nr_hugepages\)"):
            BackingFile.create(Layout.of([("w", 4 << 20)], MIB2), bytes(32), directory=target)
        assert not os.listdir(huge_pool.mount)
    finally:
        for p in taker:  # only the process this test started
            p.stdin.close()
            p.wait(10)
    assert _free() == free
