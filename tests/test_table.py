"""SharedEngramTable on its own: attach checks, capacity refused before allocating, lookups racing
ids changes and close, bad arguments named, sealed views."""

import os
import threading
import time

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint
from numa_engram.errors import (
    CapacityError,
    PlacementError,
    SpecMismatchError,
    StorageError,
)
from numa_engram.store.fileformat import Layout
from numa_engram.store.storage import BackingFile

from .conftest import run_python, shm_files
from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world, same_failure
from .support.dist_scenarios import make_spec


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



@pytest.mark.multiproc
def test_auto_falls_back_only_to_copies_that_fit(tmp_path):
    deep = tmp_path / ("d" * 120)  # no socket path fits under it: no sharing
    deep.mkdir(mode=0o700)
    cg = MemoryCgroup(3 << 30)
    try:
        cg.enter()
        from numa_engram.host.accounting import cgroup_memory_room

        room = min(r.free for r in cgroup_memory_room())
        results = run_world(2, scenarios.memory_fallback, handover_root=str(deep), room=room)
    finally:
        cg.leave()
        cg.remove()
    same_failure(results, "CapacityError", "2 independent copies (the fallback)")



@pytest.mark.slow  # starts an interpreter (~1 s)
def test_ids_changed_by_another_thread_never_read_outside_the_table():
    child = run_python("""
        import sys
        import threading
        import numpy as np
        from numa_engram import EngramSpec, SharedEngramTable, shard_heads
        from numa_engram.errors import LookupIdError
        # the flipping thread gets the GIL back within 0.2 ms, not 5 ms: many
        # more flips land while the kernel reads, and no lookup waits long
        sys.setswitchinterval(0.0002)
        spec = EngramSpec.small(rows_per_head=2000)
        t = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
        t.lookup_threads = 2
        refused = 0
        # a decode step (token order, the caller alone) and a large call
        # (table order, split over the caller and a pool thread)
        for tokens in (8, 4096):
            ids = np.zeros((tokens, spec.n_hash_cols), np.int64)
            stop = False
            def flip():
                while not stop:
                    ids[:, 3] = 1 << 40
                    ids[:, 3] = 0
            th = threading.Thread(target=flip)
            th.start()
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



@pytest.mark.slow  # starts an interpreter (~1 s)
def test_lookup_threads_and_cpus_changed_while_other_threads_look_up():
    """Setting lookup_threads or lookup_cpus while other threads look up
    binds a new kernel for later calls; the old one's threads stop once no
    call uses them (stopped at once, a running call's pool was freed under
    it: threads were left behind in 2 of 4 runs of this test).  Every result
    keeps the reference's bits, and no thread is left after close()."""
    child = run_python("""
        import threading
        import numpy as np, torch
        from numa_engram import EngramSpec, SharedEngramTable, shard_heads
        from numa_engram.lookup.cpu import reference_lookup
        spec = EngramSpec.small(rows_per_head=2000)
        t = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
        t.weights[:] = np.random.default_rng(0).integers(0, 256, t.weights.shape, np.uint8)
        ids = np.random.default_rng(1).integers(0, 2000, (1024, spec.n_hash_cols))
        want = reference_lookup(t.weights, t.scales, ids, head_start=0,
                                bucket_sizes=spec.bucket_sizes(1)).view(torch.int16)
        torch.set_num_threads(1)  # torch's own pool stays as it is
        torch.equal(want, want)
        tasks = lambda: len(__import__("os").listdir("/proc/self/task"))
        before = tasks()  # no lookup yet: no kernel threads
        wrong, stop = [], False
        def reader():
            while not stop:
                if not torch.equal(t.lookup(ids).view(torch.int16), want):
                    wrong.append(1)
        readers = [threading.Thread(target=reader) for _ in range(2)]
        for th in readers:
            th.start()
        for i in range(3000):
            t.lookup_threads = 1 + i % 3
            t.lookup_cpus = (0,) if i % 2 else ()
        stop = True
        for th in readers:
            th.join()
        t.close()
        import time  # a joined thread leaves /proc/self/task a moment later
        deadline = time.monotonic() + 5
        while tasks() != before and time.monotonic() < deadline:
            time.sleep(0.005)
        print("survived", len(wrong), before == tasks())
    """, timeout=300)
    assert child.returncode == 0, f"crashed: {child.returncode} {child.stderr[-500:]}"
    assert "survived 0 True" in child.stdout, child.stdout


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


def test_attaching_a_fifo_by_path_is_refused_at_once_not_blocked_in_open(tmp_path):
    """open(2) of a FIFO with no writer blocks for ever: the path is opened
    non-blocking, then refused as not a regular file."""
    import threading

    spec = EngramSpec.small()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    raised = []

    def attach():
        try:
            SharedEngramTable.attach(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                     path=str(fifo))
        except StorageError as exc:
            raised.append(str(exc))
    worker = threading.Thread(target=attach, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("attach(path=FIFO) blocked in open(2)")
    assert raised and "not a regular file" in raised[0]


def test_placement_of_the_wrong_type_is_a_clear_error():
    spec = EngramSpec.small()
    with pytest.raises(PlacementError, match="got int 123"):
        SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0), placement=123)



def test_huge_output_is_a_capacity_error():
    from numa_engram.lookup.outputs import bf16_out

    with pytest.raises(CapacityError, match="look up fewer tokens"):
        bf16_out(None, (1 << 40, 24, 256))



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
    from numa_engram.runtime.dpsharded import DPShardedLookup

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


def _request(mode="auto", **kwargs):
    from numa_engram.tables.request import CreateRequest, TableOptions

    spec = EngramSpec.small()
    args = dict(directory="/dev/shm", timeout_s=30, lookup_threads=1)
    args.update(kwargs)
    return CreateRequest.of(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0), mode, None,
                            TableOptions(**args))


def test_a_create_request_gives_each_name_one_meaning():
    req = _request(load_threads=3)
    assert (req.load_threads, req.options.shared_load, req.stall_timeout_s) == (3, True, 30.0)
    assert _request(shared_load=False, load_threads=4).options.shared_load is False
    # 1 thread, shared
    assert _request(load_threads=1, shared_load=True).options.shared_load is True
    assert _request(stall_timeout_s=5).stall_timeout_s == 5.0  # the collectives keep 30
    assert _request(page_size="2M").page_size == 2 << 20


def test_table_options_come_as_keywords_or_as_one_object_not_both():
    import torch

    from numa_engram import TableOptions

    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    options = TableOptions(directory=None, lookup_threads=2, load_threads=1, timeout_s=30)
    with SharedEngramTable.create(spec, 1, shard, options=options) as by_object, \
            SharedEngramTable.create(spec, 1, shard, directory=None, lookup_threads=2,
                                     load_threads=1, timeout_s=30) as by_keywords:
        assert by_object.lookup_threads == by_keywords.lookup_threads == 2
        # directory=None: a memfd each
        assert by_object.path.startswith("memfd:") and by_keywords.path.startswith("memfd:")
        ids = np.zeros((3, spec.n_hash_cols), np.int64)
        assert torch.equal(by_object.lookup(ids), by_keywords.lookup(ids))
    with pytest.raises(TypeError, match=r"page_size, timeout_s given both as keyword\(s\) and "
                                        r"in options="):
        SharedEngramTable.create(spec, 1, shard, options=options, page_size="2M", timeout_s=5)


def test_load_threads_only_counts_threads_and_shared_load_decides_sharing():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _request(load_threads=1).options.shared_load is True
        assert _request(load_threads=1, shared_load=False).options.shared_load is False


@pytest.mark.parametrize("kwargs, text", [
    ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0, got 0"),
    ({"stall_timeout_s": -1}, "stall_timeout_s must be a finite number of seconds > 0"),
    ({"timeout_s": True}, "timeout_s must be"),
    ({"load_threads": 0}, "load_threads must be >= 1"),
    ({"load_threads": 2.5}, "load_threads"),
    ({"mode": "indepndent"}, "mode must be one of"),
])
def test_a_create_request_names_the_bad_argument(kwargs, text):
    from numa_engram.errors import SpecError

    with pytest.raises(SpecError, match=text):
        _request(**kwargs)



def test_lookup_counts_every_outcome_and_a_closed_table_says_so_whatever_the_ids():
    """The ids are checked before the lookup lock and the pooled output is
    taken under it: a wrongly shaped id array is still counted as a bad-id
    lookup, a good one as a lookup, the table's in-flight count is back to
    0 after each (close() does not wait), and a closed table refuses good
    and bad ids alike with its own error."""
    from numa_engram.errors import LookupIdError

    spec = EngramSpec.small()
    table = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
    good = np.zeros((3, spec.n_hash_cols), dtype=np.int64)
    assert table.lookup(good).shape == (3, spec.n_hash_cols, spec.head_dim)
    with pytest.raises(LookupIdError, match="shape"):
        table.lookup(np.zeros((3, spec.n_hash_cols + 1), dtype=np.int64))
    with pytest.raises(LookupIdError, match="dtype"):
        table.lookup(np.zeros((3, spec.n_hash_cols), dtype=np.float32))
    bad_value = good.copy()
    bad_value[1, 2] = 1 << 40
    with pytest.raises(LookupIdError):
        table.lookup(bad_value)
    stats = table.stats()
    assert (stats.lookups, stats.bad_id_lookups, stats.failed_lookups) == (1, 3, 0)
    assert table.rows._active == 0
    table.close()
    for ids in (good, np.zeros((3, 1), dtype=np.int64)):
        with pytest.raises(StorageError, match="closed"):
            table.lookup(ids)


def test_the_kernel_counts_each_lookup_once_in_the_bucket_its_time_falls_in(tp_shard_table):
    """CPU lookups are counted in C (struct ne_table_state): every output
    kind and a zero-token call once, with all their rows; a lookup with a
    bad id not as a lookup; the counts go on across a new thread count
    (a new kernel); the time is in the first bucket whose bound it does not
    pass: all in the first with bounds of 10 s and more, all in +Inf with
    bounds of picoseconds, the bound rule at both ends."""
    import torch

    from numa_engram.bindings import lookupkernel
    from numa_engram.errors import LookupIdError

    spec, t = tp_shard_table
    ids = np.zeros((5, spec.n_hash_cols), np.int64)
    t0 = time.perf_counter()
    t.lookup(ids)
    t.lookup(ids, out=torch.empty((5, 4, spec.head_dim), dtype=torch.bfloat16))
    t.lookup(ids, packed=True)
    t.lookup_threads = 1 if t.lookup_threads > 1 else 2  # a new kernel, the same counts
    t.lookup(ids[:0])
    bad = ids.copy()
    bad[2, 5] = 1 << 40
    with pytest.raises(LookupIdError):
        t.lookup(bad)
    wall = time.perf_counter() - t0
    s = t.stats()
    assert (s.lookups, s.rows, s.bad_id_lookups) == (4, 3 * 5 * 4, 1)
    assert 0 < s.lookup_seconds < wall and dict(s.latency[0])["+Inf"] == 4

    def bucket_counts(bounds):
        geometry = t.rows._geometry
        state = lookupkernel.TableState(bounds)
        kernel = lookupkernel.ShardKernel(geometry, 1, col0=t.shard.head_start, state=state)
        out = np.empty((5, 4, spec.head_dim), np.uint16)
        for _ in range(3):
            assert kernel(ids, False, out) == (0, -1, 0)
        return state.counts()
    lookups, rows, seconds, buckets = bucket_counts([10.0 + i for i in range(16)])
    assert (lookups, rows, buckets[0], sum(buckets)) == (3, 60, 3, 3) and seconds > 0
    lookups, rows, seconds, buckets = bucket_counts([1e-12 * (i + 1) for i in range(16)])
    assert (lookups, buckets[16], sum(buckets)) == (3, 3, 3)
    with pytest.raises(ValueError, match="latency bounds"):
        lookupkernel.TableState([1.0] * 15)


def test_a_closed_table_state_refuses_the_kernel_and_close_waits_for_running_calls(
        tp_shard_table):
    """ne_table_close: calls inside finish (their rows intact, counted),
    later ones are refused with StorageError, nothing counted for them; no
    call is inside once it returns."""
    import torch

    from numa_engram.bindings import lookupkernel

    spec, t = tp_shard_table
    state = lookupkernel.TableState([1e-3 * (i + 1) for i in range(16)])
    kernel = lookupkernel.ShardKernel(t.rows._geometry, 1, col0=t.shard.head_start, state=state)
    ids = np.random.default_rng(0).integers(0, 400, (4000, spec.n_hash_cols))
    expected = t.lookup(ids).view(torch.int16).numpy()
    outcomes = []

    def reader():  # until refused: every call after close() is
        out = np.empty((4000, 4, spec.head_dim), np.uint16)
        for _ in range(100_000):
            try:
                kernel(ids, False, out)
            except StorageError as exc:
                outcomes.append(str(exc))
                return
            outcomes.append(bool((out.view(np.int16) == expected).all()))
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.05)
    state.close()
    assert state.struct.active == 0
    done_at_close = state.counts()[0]
    for th in threads:
        th.join(30)
    assert outcomes.count("the table is closed") == 2 and all(
        o is True for o in outcomes if o != "the table is closed")
    assert state.counts()[0] == done_at_close == outcomes.count(True) > 0
    with pytest.raises(StorageError, match="the table is closed"):
        kernel(ids, False, np.empty((4000, 4, spec.head_dim), np.uint16))



def test_a_callers_output_tensor_gets_the_same_bits_and_a_wrong_one_is_refused(tp_shard_table):
    """``lookup(ids, out=tensor)`` writes through the tensor's address (no
    numpy view per call): the same bits as the pooled output, at a strided
    view of ids too, and the tensor returned.  A float, misshapen or
    non-contiguous tensor, a numpy array or a list is a ValueError that
    names it, counted as a failed lookup; the table works on."""
    import torch

    spec, t = tp_shard_table
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 400, (7, 2, spec.n_hash_cols))  # [T, layers, cols]: a strided view
    out = torch.full((7, 4, spec.head_dim), 3.0, dtype=torch.bfloat16)
    assert t.lookup(ids[:, 1], out=out) is out
    assert torch.equal(out.view(torch.int16), t.lookup(ids[:, 1]).view(torch.int16))
    failed = t.stats().failed_lookups
    wrong = [out.float(), out[:6], torch.empty((7, 8, spec.head_dim), dtype=torch.bfloat16)[:, ::2],
             out.view(torch.int16).numpy(), [[0.0]]]
    for bad in wrong:
        with pytest.raises(ValueError, match=r"out must be a contiguous CPU bfloat16 tensor of "
                                             r"shape \[7, 4, \d+\], got "):
            t.lookup(ids[:, 1], out=bad)
    assert t.stats().failed_lookups == failed + len(wrong)
    assert torch.equal(t.lookup(ids[:, 0], out=out).view(torch.int16),
                       t.lookup(ids[:, 0]).view(torch.int16))
