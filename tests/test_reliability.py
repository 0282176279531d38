"""Reliability under faults, races and hostile neighbours (one test or
more per defect of the reliability issue; multi-process ones over gloo)."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.errors import (
    CapacityError,
    PlacementError,
    PrefetchError,
    SpecMismatchError,
    StorageError,
)
from numa_engram.sharing.checkpoint import write_synthetic_checkpoint
from numa_engram.store.fileformat import PREFIX, Layout
from numa_engram.store.gc import gc_stale_files
from numa_engram.store.storage import BackingFile, check_directory

from . import dist_scenarios as scenarios
from .conftest import SHM, run_python, shm_files
from .dist_harness import run_world
from .dist_scenarios import make_spec

multiproc = pytest.mark.multiproc


def _same_failure(results, error_type, text=None, ranks=None):
    for r in results:
        if ranks is not None and r["rank"] not in ranks:
            continue
        assert not r["ok"] and r["error_type"] == error_type, r
        if text is not None:
            assert text in r["message"], r["message"]


# ---------------------------------------------- 1. silent wrong rows --

@multiproc
def test_member_asking_for_another_shard_fails_everywhere():
    results = run_world(3, scenarios.other_shard)
    _same_failure(results, "SpecMismatchError", "rank 1 asked for layer 1, heads [4, 8)")
    assert "the leader (rank 0) for layer 1, heads [0, 4)" in results[0]["message"]


def test_attach_checks_layer_and_shard():
    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with SharedEngramTable.create(spec, 1, shard) as table:
        other = shard_heads(spec.bucket_sizes(14), 1, 0)
        with pytest.raises(SpecMismatchError, match="holds layer 1, .*but layer 14, .*asked"):
            SharedEngramTable.attach(spec, 14, other, fd=table._backing.fd)
        two = shard_heads(spec.bucket_sizes(1), 2, 1)
        with pytest.raises(SpecMismatchError, match=r"heads \[0, 8\).*heads \[4, 8\)"):
            SharedEngramTable.attach(spec, 1, two, fd=table._backing.fd)


# --------------------------------------------------------------- 2. gc --

def _unshare_ok(*flags) -> bool:
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


def test_gc_keeps_a_live_table_whose_creator_is_in_another_pid_namespace():
    if not _unshare_ok("--pid", "--fork", "--mount-proc"):
        pytest.skip("unshare --pid is not permitted here (needs root or user namespaces)")
    code = ("import sys\n"
            "from numa_engram.store.fileformat import Layout\n"
            "from numa_engram.store.storage import BackingFile\n"
            "f = BackingFile.create(Layout.of([('w', 4096)]), bytes(32))\n"
            "print(f.path, flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                              code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        entry = {e.path: e for e in gc_stale_files()}[path]
        assert not entry.removed and entry.reason.startswith("kept: in use"), entry
        assert entry.creator_pid < 5  # the pid it had in its own namespace
        assert os.path.exists(path)
    finally:
        child.stdin.close()
        child.wait(30)
    entry = {e.path: e for e in gc_stale_files()}[path]
    assert entry.removed and "stale" in entry.reason and not os.path.exists(path)


def test_gc_skips_hostile_entries_with_a_reason():
    names = {kind: os.path.join(SHM, f"{PREFIX}hostile-{kind}") for kind in
             ("fifo", "dir", "short", "link")}
    os.mkfifo(names["fifo"])
    os.mkdir(names["dir"])
    with open(names["short"], "wb") as f:
        f.write(b"NUMAENGR\x02\x00\x00\x00")
    os.symlink("/etc/passwd", names["link"])
    try:
        for dry_run in (True, False):
            done = []
            t = threading.Thread(target=lambda done=done, dry_run=dry_run: done.append(
                gc_stale_files(dry_run=dry_run)))
            t.start()
            t.join(20)
            assert done, "gc hung on a hostile entry"
            entries = {e.path: e for e in done[0]}
            assert "a FIFO" in entries[names["fifo"]].reason
            assert "a directory" in entries[names["dir"]].reason
            assert "too short" in entries[names["short"]].reason
            assert "a symlink" in entries[names["link"]].reason
            assert not any(entries[p].removed for p in names.values())
    finally:
        os.unlink(names["fifo"])
        os.rmdir(names["dir"])
        os.unlink(names["short"])
        os.unlink(names["link"])


def test_root_gc_leaves_other_users_files_unless_asked():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file owned by another uid")
    child = run_python("""
        import os, signal
        from numa_engram.store.fileformat import Layout
        from numa_engram.store.storage import BackingFile
        f = BackingFile.create(Layout.of([("w", 4096)]), bytes(32))
        os.fchown(f.fd, 65534, 65534)
        print(f.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = child.stdout.strip()
    entry = {e.path: e for e in gc_stale_files()}[path]
    assert not entry.removed and "owned by uid 65534" in entry.reason
    entry = {e.path: e for e in gc_stale_files(all_users=True)}[path]
    assert entry.removed


# ---------------------------------------------------------- 3. capacity --

@pytest.fixture
def big_tmpfs(tmp_path):
    """A tmpfs mounted larger than the machine's RAM (nothing is written)."""
    mnt = tmp_path / "big"
    mnt.mkdir()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if os.system(f"mount -t tmpfs -o size={2 * ram} tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    yield str(mnt)
    os.system(f"umount {mnt}")


def test_table_larger_than_memory_on_a_huge_tmpfs_is_refused(big_tmpfs):
    from numa_engram.host.procfs import meminfo as read_meminfo

    size = read_meminfo()["MemAvailable"] + (1 << 30)
    with pytest.raises(CapacityError, match="MemAvailable"):
        BackingFile.create(Layout.of([("w", size)]), bytes(32), directory=big_tmpfs)
    with pytest.raises(CapacityError, match="MemAvailable"):
        BackingFile.create(Layout.of([("w", size)]), bytes(32), directory=None)  # memfd
    assert not os.listdir(big_tmpfs)


class MemoryCgroup:
    """A child memory cgroup (v2 with the memory controller, else v1) of
    this process's own, with a limit; ``enter`` moves this process in and
    ``leave`` moves it back (children started inside stay charged there)."""

    def __init__(self, limit: int) -> None:
        from numa_engram.host.accounting import _cgroup_dirs

        for cgroup, _mount, kind in _cgroup_dirs():
            names = {"v2": ("memory.max", "memory.current"),
                     "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}[kind]
            if kind == "v2" and "memory" not in (cgroup / "cgroup.controllers").read_text():
                continue
            path = cgroup / f"numa-engram-test-{os.getpid()}"
            try:
                path.mkdir()
                (path / names[0]).write_text(str(limit))
            except OSError:
                continue
            self.path, self.home = path, cgroup
            return
        pytest.skip("no writable memory cgroup (v2 with the memory controller or v1) here")

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def leave(self) -> None:
        (self.home / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # children still exiting
                time.sleep(0.1)


def test_private_table_beyond_the_cgroup_limit_is_a_capacity_error():
    cg = MemoryCgroup(256 << 20)
    try:
        cg.enter()
        child = run_python("""
            from numa_engram.errors import CapacityError
            from numa_engram.store.fileformat import Layout
            from numa_engram.store.storage import BackingFile
            try:
                BackingFile.create(Layout.of([("w", 512 << 20)]), bytes(32), directory=None)
            except CapacityError as exc:
                print("refused:", exc)
        """)
    finally:
        cg.leave()
        cg.remove()
    assert child.returncode == 0, child.stderr
    assert "refused:" in child.stdout and "memory cgroup" in child.stdout, child.stdout


@multiproc
def test_auto_falls_back_only_to_copies_that_fit(tmp_path):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.system(f"mount -t tmpfs -o size=512k tmpfs {tiny} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    cg = MemoryCgroup(3 << 30)
    try:
        cg.enter()
        from numa_engram.host.accounting import cgroup_memory_room

        room = min(r.free for r in cgroup_memory_room())
        results = run_world(2, scenarios.memory_fallback, directory=str(tiny), room=room)
    finally:
        cg.leave()
        cg.remove()
        os.system(f"umount {tiny}")
    _same_failure(results, "CapacityError", "2 independent copies (the fallback)")


# ---------------------------------------------- 4. ids race, close race --

def test_ids_changed_by_another_thread_never_read_outside_the_table():
    child = run_python("""
        import threading
        import numpy as np
        from numa_engram import EngramSpec, SharedEngramTable, shard_heads
        from numa_engram.errors import LookupIdError
        spec = EngramSpec.small(rows_per_head=2000)
        t = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
        t.lookup_threads = 2
        ids = np.zeros((4096, spec.n_hash_cols), np.int64)
        stop = False
        def flip():
            while not stop:
                ids[:, 3] = 1 << 40
                ids[:, 3] = 0
        th = threading.Thread(target=flip)
        th.start()
        refused = 0
        for _ in range(300):
            try:
                t.lookup(ids)
            except LookupIdError:
                refused += 1
        stop = True
        th.join()
        print("survived", refused)
    """, timeout=300)
    assert child.returncode == 0, f"crashed: {child.returncode} {child.stderr[-500:]}"
    assert "survived" in child.stdout


def test_close_waits_for_running_lookups_and_later_lookups_raise():
    spec = EngramSpec.small(rows_per_head=2000)
    table = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
    ids = np.zeros((20000, spec.n_hash_cols), np.int64)
    outcomes = []

    def reader():
        for _ in range(50):
            try:
                table.lookup(ids)
                outcomes.append("ok")
            except StorageError as exc:
                outcomes.append(str(exc))
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    time.sleep(0.05)
    table.close()
    for th in threads:
        th.join(60)
    assert "ok" in outcomes and "the table is closed" in outcomes
    assert set(outcomes) <= {"ok", "the table is closed"}


# ------------------------------------- 5, 7. same end, bounded by timeout --

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(1000)))


LEADER_POINTS = ("before-join", "after-create", "after-map", "after-unlink", "load-progress",
                 "before-ready", "after-ready")
PEER_POINTS = ("before-join", "after-decide", "before-map", "after-map", "before-load",
               "before-ready", "after-ready")
FAULTS = [(0, p, a) for p in LEADER_POINTS for a in ("kill", "stop")] + \
         [(2, p, a) for p in PEER_POINTS for a in ("kill", "stop")]


@multiproc
@pytest.mark.parametrize("victim, point, action", FAULTS,
                         ids=[f"{'leader' if v == 0 else 'peer'}-{a}-{p}" for v, p, a in FAULTS])
def test_fault_matrix(victim, point, action, ckpt):
    """A member killed or stopped at each protocol step: every surviving
    member ends the same way within timeout_s + 10 s, a stopped one resumed
    later ends like them, and gc then leaves /dev/shm clean."""
    timeout_s = 4
    before = shm_files()
    results = run_world(3, scenarios.fault, timeout_s=90, pg_timeout_s=120, resume_stopped=True,
                        victim=victim, point=point, action=action, bound_s=timeout_s,
                        checkpoint=ckpt)
    survivors = [r for r in results if r["rank"] != victim or action == "stop"]
    ends = {(r["ok"], r.get("error_type")) for r in survivors}
    assert len(ends) == 1, [(r["rank"], r["ok"], r.get("error_type"), r.get("message"))
                            for r in survivors]
    for r in results:
        if r["rank"] != victim:
            assert r["seconds"] < timeout_s + 10, r
        if r["ok"]:
            assert r["exact"]
    if action == "kill":
        assert results[victim]["exitcode"] == -signal.SIGKILL
    else:
        assert results[victim]["resumed"]
    gc_stale_files()
    assert not shm_files() - before


@multiproc
def test_timeout_bounds_collectives_not_the_process_group():
    """A stopped peer, a 40 s process-group timeout, create(timeout_s=5)."""
    results = run_world(3, scenarios.peer_stops_itself, timeout_s=90, pg_timeout_s=40, bound_s=5)
    _same_failure(results, "GroupTimeout", "step 'join'", ranks={0, 1})
    assert all(r["seconds"] < 5 + 10 for r in results[:2]), [r["seconds"] for r in results]


# ------------------------------------------------- 6. errors of members --

@multiproc
def test_syscall_error_on_a_peer_is_raised_as_itself_everywhere():
    results = run_world(3, scenarios.peer_raises, error="syscall")
    for r in results:
        assert r["raised"] == "SyscallError", r
        assert "step 'map' on member 1 (rank 1): mmap failed: ENOMEM" in r["text"], r["text"]
        assert r["failures"] == [[1, 1, "map", "SyscallError", r["failures"][0][4]]]


@multiproc
def test_foreign_errors_become_member_failure_listing_every_member():
    results = run_world(3, scenarios.peer_raises, error="foreign")
    for r in results:
        assert r["raised"] == "MemberFailure", r
        assert "member 1 (rank 1) RuntimeError: not ours, rank 1" in r["text"]
        assert "member 2 (rank 2) RuntimeError: not ours, rank 2" in r["text"]
        assert [f[0] for f in r["failures"]] == [1, 2]


# ------------------------------------------------------ 8. load bounds --

@multiproc
def test_a_slow_but_healthy_load_outlasts_the_timeout(tmp_path):
    path = tmp_path / "c.safetensors"
    write_synthetic_checkpoint(path, make_spec(4000))
    results = run_world(3, scenarios.slow_load, pg_timeout_s=3, bound_s=3, checkpoint=str(path),
                        pause_s=2.0)
    for r in results:
        assert r["ok"], r
        assert r["took"] > 3, "the load must outlast the timeout for this test to mean much"
        assert not r["writable"], "a loaded table is read-only in every member"


@multiproc
def test_fifo_checkpoint_is_refused_up_front(tmp_path):
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    results = run_world(3, scenarios.load_from, timeout_s=60, checkpoint=str(fifo))
    _same_failure(results, "CheckpointError", "is not a regular file")
    assert all(r["seconds"] < 10 for r in results)


# ------------------------------------------------ 9. DP-sharded bad id --

@multiproc
def test_dp_sharded_bad_id_fails_all_at_once_and_the_group_stays_usable():
    results = run_world(2, scenarios.dp_sharded_bad_id)
    for r in results:
        assert r["ok"], r
        assert "EDP member(s) [1]" in r["first"] and r["took"] < 5
        assert r["exact"]
    assert "hash id 1000000000 at token 7, column 3" in results[1]["first"]


# ------------------------------------------------ 10. prefetch threads --

def _scheduler(lookup):
    from numa_engram.lookup.prefetch import PrefetchScheduler

    return PrefetchScheduler({"a": lookup, "b": lookup}, {"a": (1, 4), "b": (1, 4)},
                             max_tokens=8, depth=1)


def test_prefetch_close_wakes_a_waiting_thread():
    import torch

    gate = threading.Event()

    def slow(ids, out):
        gate.wait(10)
        return out
    s = _scheduler(slow)
    s.submit("a", torch.zeros((2, 1)))
    errors = []

    def waiter():
        try:
            s.wait("a")
        except PrefetchError as exc:
            errors.append(exc)
    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    closer = threading.Thread(target=s.close)
    closer.start()
    gate.set()
    th.join(10)
    closer.join(10)
    assert not th.is_alive() and not closer.is_alive(), "close() left a thread hanging"
    assert errors and "closed" in str(errors[0])


def test_prefetch_same_layer_from_two_threads_is_accepted_once():
    import torch

    s = _scheduler(lambda ids, out: out)
    outcomes = []
    barrier = threading.Barrier(2)

    def submit():
        barrier.wait()
        try:
            s.submit("a", torch.zeros((2, 1)))
            outcomes.append("ok")
        except PrefetchError:
            outcomes.append("refused")
    threads = [threading.Thread(target=submit) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sorted(outcomes) == ["ok", "refused"]
    s.wait("a")
    s.close()


# ------------------------------------------------- 11. descriptor leak --

def test_failed_attaches_keep_no_descriptor():
    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with SharedEngramTable.create(spec, 1, shard) as table:
        fd = table._backing.fd
        table._backing.set_state(0)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            with pytest.raises(StorageError):
                SharedEngramTable.attach(spec, 1, shard, fd=fd)
            with pytest.raises(SpecMismatchError):
                SharedEngramTable.attach(spec, 14, shard_heads(spec.bucket_sizes(14), 1, 0),
                                         fd=fd)
        assert len(os.listdir("/proc/self/fd")) == before


# ---------------------------------------------------------- 12. smaller --

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


@multiproc
def test_members_must_agree_on_the_mode():
    results = run_world(3, scenarios.other_mode)
    _same_failure(results, "TopologyError", "rank 2 asked for mode 'independent'")


def test_placement_of_the_wrong_type_is_a_clear_error():
    spec = EngramSpec.small()
    with pytest.raises(PlacementError, match="got int 123"):
        SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0), placement=123)


def test_header_with_no_regions_is_refused(tmp_path):
    import struct

    from numa_engram.store.fileformat import FORMAT_VERSION, MAGIC

    path = os.path.join(SHM, f"{PREFIX}test-noregions")
    head = struct.pack("<8sIIIIQ16s32sQIiIIQQQ", MAGIC, FORMAT_VERSION, 1, 1, os.geteuid(), 0,
                       b"\0" * 16, b"\0" * 32, 8192, 0, 1, 0, 1, 0, 1, 4096)
    with open(path, "wb") as f:
        f.write(head.ljust(8192, b"\0"))
    try:
        with pytest.raises(StorageError, match="0 regions"):
            BackingFile.attach(path)
    finally:
        os.unlink(path)


def test_huge_output_is_a_capacity_error():
    from numa_engram.model.fp8 import bf16_out

    with pytest.raises(CapacityError, match="look up fewer tokens"):
        bf16_out(None, (1 << 40, 24, 256))


# ------------------------------------------- loading split over the group --

def test_load_parts_go_to_the_members_on_the_rows_node():
    from numa_engram.sharing.loading import load_parts, loaders_of

    # bound to node 1: the two members there split the rows, the others load nothing
    parts = load_parts(10, [0, 1, 0, 1], (1,), cooperative=True)
    assert parts == [(0, 0), (0, 5), (0, 0), (5, 10)] and loaders_of(parts) == [0, 1, 3]
    assert load_parts(9, [0, 1, 0], None, True) == [(0, 3), (3, 6), (6, 9)]  # interleave
    assert load_parts(9, [0, 0], (1,), True) == [(0, 9), (0, 0)]  # nobody there: the leader
    assert load_parts(9, [0, 0], (0,), False) == [(0, 9), (0, 0)]  # one loading thread


def test_every_member_loads_its_part_and_the_rows_are_exact(ckpt):
    results = run_world(3, scenarios.split_load, checkpoint=ckpt)
    assert all(r["ok"] and r["raised"] is None for r in results), results
    for r in results:
        assert r["exact"] and r["done"] and r["sealed"]
        # three loaders (all on this host's one node), a third of the rows each
        assert len(r["bytes"]) == 3 and sum(r["bytes"]) == r["row_bytes"]
        assert max(r["bytes"]) - min(r["bytes"]) <= 2 * r["row_bytes"] // 1000


def test_a_loader_failing_mid_part_fails_every_member_at_once(ckpt):
    results = run_world(3, scenarios.split_load, checkpoint=ckpt, fail_rank=2)
    assert all(r["ok"] for r in results), results
    assert len({r["raised"] for r in results}) == 1 and results[0]["raised"], results
    assert all("disk gone under rank 2" in r["text"] for r in results)
    assert all(r["seconds"] < 20 for r in results), results  # FAILED ends the waits, no timeout


# ---------------------------------------------------- round 3 (issue 19) --

@pytest.fixture
def two_versions(tmp_path):
    """A checkpoint and another version of it (another seed, same spec)."""
    path, other = tmp_path / "c.safetensors", tmp_path / "c-v2.safetensors"
    write_synthetic_checkpoint(path, make_spec(1000), seed=0)
    write_synthetic_checkpoint(other, make_spec(1000), seed=1)
    return str(path), str(other)


@multiproc
@pytest.mark.parametrize("replacer", [0, 2], ids=["leader", "peer-loader"])
def test_a_checkpoint_replaced_during_the_load_fails_every_member(two_versions, replacer):
    path, other = two_versions
    results = run_world(3, scenarios.replace_during_load, checkpoint=path, other=other,
                        replacer=replacer)
    for r in results:
        assert r["ok"] and r["raised"] == "CheckpointError", r
        assert "changed since the checkpoint was resolved" in r["text"], r["text"]
        assert r["seconds"] < 20, r


@multiproc
def test_every_member_refuses_a_truncated_checkpoint_naming_file_and_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_synthetic_checkpoint(path, make_spec(200))
    os.truncate(path, os.path.getsize(path) - 100)
    results = run_world(3, scenarios.load_from, timeout_s=60, checkpoint=str(path))
    _same_failure(results, "CheckpointError", f"{path}: tensor ")
    for r in results:
        assert "needs bytes up to" in r["message"] and "truncated or corrupt" in r["message"]
        assert "step 'decide'" in r["message"], r["message"]  # before anything was allocated
        assert r["seconds"] < 30


@multiproc
@pytest.mark.parametrize("error, cls", [("foreign", "MemberFailure"),
                                        ("checkpoint", "CheckpointError"),
                                        ("truncate", "CheckpointError")])
def test_a_split_load_fails_with_the_class_of_the_member_that_failed(tmp_path, error, cls):
    path = tmp_path / "c.safetensors"
    write_synthetic_checkpoint(path, make_spec(1000))
    results = run_world(3, scenarios.split_load, checkpoint=str(path), fail_rank=2, error=error)
    for r in results:
        assert r["ok"] and r["raised"] == cls, r
        assert r["seconds"] < 20, r


@multiproc
def test_placement_disagreement_and_bad_nodes_fail_in_every_member():
    results = run_world(3, scenarios.other_placement, placement="interleave")
    _same_failure(results, "SpecMismatchError", "rank 1 asked for placement 'interleave', "
                                                "the leader (rank 0) for 'gpu-local'")
    results = run_world(3, scenarios.other_placement, placement="node:999")
    _same_failure(results, "TopologyError", "step 'join' on member 1 (rank 1)")
    assert "999" in results[0]["message"]
    results = run_world(3, scenarios.other_placement, placement="gpu-local")
    assert all(r["ok"] and r["policy"] == "gpu-local" for r in results), results


@multiproc
def test_sharing_groups_never_merge_what_the_caller_separated():
    results = run_world(4, scenarios.groups_limited, gpus_per_host=2)
    assert [r["group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]], results
    results = run_world(4, scenarios.groups_limited, within=[[0, 3], [1, 2]])
    assert [r["group"] for r in results] == [[0, 3], [1, 2], [1, 2], [0, 3]], results
    results = run_world(4, scenarios.groups_limited, gpus_per_host=2, within=[[0], [1, 2, 3]])
    assert [r["group"] for r in results] == [[0], [1], [2, 3], [2, 3]], results


@multiproc
def test_a_peers_syscall_error_keeps_its_errno_and_call_everywhere():
    import errno

    results = run_world(3, scenarios.peer_raises, error="syscall")
    for r in results:
        assert r["raised"] == "SyscallError" and r["is_oserror"], r
        assert r["errno"] == errno.ENOMEM and r["call"] == "mmap", r


@multiproc
def test_a_group_timeout_names_the_members_that_did_not_arrive():
    results = run_world(3, scenarios.peer_never_joins, timeout_s=60)
    _same_failure(results, "GroupTimeout", "member(s) at world rank(s) [2] did not arrive",
                  ranks={0, 1})


def test_register_device_without_a_gpu_fails_at_join_before_anything_exists():
    from numa_engram.bindings import cudart as cuda
    from numa_engram.errors import CudaUnavailable

    if cuda.available()[0]:
        pytest.skip("a GPU is usable here: register_device works")
    spec = EngramSpec.small()
    before = shm_files()
    with pytest.raises(CudaUnavailable, match="step 'join'.*register_device=0"):
        SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                 register_device=0)
    assert shm_files() == before


def test_misused_arguments_are_library_errors_naming_what_to_pass():
    from numa_engram.errors import SpecError
    from numa_engram.sharing.exchange import DPShardedLookup

    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with pytest.raises(SpecError, match=r"mode must be one of \('auto', 'dp_shared', "
                                        r"'independent'\), got 'indepndent'"):
        SharedEngramTable.create(spec, 1, shard, mode="indepndent")
    with SharedEngramTable.create(spec, 1, shard) as table, \
            pytest.raises(SpecError, match="heads must be the ShardedHeads.*got ShardInfo"):
        DPShardedLookup(table, shard, 0)


def test_a_sealed_tables_views_cannot_be_made_writable(tmp_path):
    spec = make_spec(200)
    path = write_synthetic_checkpoint(tmp_path / "c.safetensors", spec)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                  checkpoint=str(path)) as table:
        for view in (table.weights, table.scales):
            with pytest.raises(ValueError, match="WRITEABLE"):
                view.flags.writeable = True
        assert int(table.weights[0, 0]) >= 0  # still readable
