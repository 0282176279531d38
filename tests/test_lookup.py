import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_engram.bindings import lookupkernel, native
from numa_engram.errors import LookupIdError
from numa_engram.lookup.cpu import gather, lookup_rows, reference_lookup
from numa_engram.lookup.outputs import OutputPool, aligned_empty
from numa_engram.model.fp8 import random_rows

from .support.kernel_paths import assert_prints_true

SIZES = [97, 101, 103, 107, 109, 113, 127, 131]  # 8 heads, like vLLM's test
DIM = 64


def _bits(t):
    return t.view(torch.int16).numpy()


def _shard(head_start, head_end, seed=0):
    sizes = SIZES[head_start:head_end]
    w, s = random_rows(sum(sizes), DIM, seed=seed, raw=True)  # NaN bytes included
    return sizes, w, s


def _ids(n_tokens, dead_fraction=0.1, seed=1):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, b, size=n_tokens) for b in SIZES], axis=1)
    ids[rng.random(ids.shape) < dead_fraction] = -1
    return np.ascontiguousarray(ids, dtype=np.int64)


@pytest.mark.parametrize("head_start, head_end", [(0, 8), (0, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("prefetch", [(8, 0), (0, 0), (32, 3), (256, 1)])
def test_fused_kernel_is_bit_exact_with_reference(head_start, head_end, threads, prefetch):
    sizes, w, s = _shard(head_start, head_end)
    ids = _ids(777)
    ids[:50] = ids[50:100]  # repeated rows
    # how far ahead, and with which hint, never changes what is read
    tuning = lookupkernel.Tuning(prefetch_ahead=prefetch[0], prefetch_hint=prefetch[1])
    got = lookup_rows(w, s, ids, head_start=head_start, bucket_sizes=sizes, threads=threads,
                      tuning=tuning)
    want = reference_lookup(w, s, ids, head_start=head_start, bucket_sizes=sizes)
    assert got.shape == (777, head_end - head_start, DIM) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert (_bits(got)[ids[:, head_start:head_end] == -1] == 0).all()  # DEAD rows are zeros


def test_every_weight_byte_times_every_scale_byte_through_the_kernel():
    w = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(256, 256)
    s = np.repeat(np.arange(256, dtype=np.uint8), 8).reshape(256, 8)
    ids = np.arange(256, dtype=np.int64).reshape(256, 1)
    got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[256], threads=2)
    want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=[256])
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_writes_into_a_caller_tensor_and_pins_threads():
    sizes, w, s = _shard(0, 8)
    ids = _ids(64)
    out = torch.full((64, 8, DIM), 7.0, dtype=torch.bfloat16)
    res = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes, out=out, threads=2,
                      cpus=[0])
    assert res is out
    np.testing.assert_array_equal(_bits(out), _bits(reference_lookup(
        w, s, ids, head_start=0, bucket_sizes=sizes)))
    with pytest.raises(ValueError, match="contiguous CPU bfloat16"):
        lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes, out=out.float())


@pytest.mark.parametrize("bad", [-2, -3, -(2**63), 97, 98, 2**62])
def test_bad_ids_are_refused_before_any_read(bad):
    sizes, w, s = _shard(0, 8)
    ids = _ids(10)
    ids[7, 0] = bad
    with pytest.raises(LookupIdError, match=f"hash id {bad} at token 7, column 0"):
        lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes)


def test_dtype_layout_and_shape_errors():
    sizes, w, s = _shard(0, 8)
    ids = _ids(10)
    with pytest.raises(LookupIdError, match="dtype float32"):
        lookup_rows(w, s, ids.astype(np.float32), head_start=0, bucket_sizes=sizes)
    with pytest.raises(LookupIdError, match="columns must be adjacent"):
        lookup_rows(w, s, np.asfortranarray(ids), head_start=0, bucket_sizes=sizes)
    with pytest.raises(LookupIdError, match=r"columns must be adjacent.*\.contiguous\(\)"):
        lookup_rows(w, s, torch.from_numpy(ids).t().contiguous().t(), head_start=0,
                    bucket_sizes=sizes)
    with pytest.raises(LookupIdError, match="not columns of hash ids with 5 columns"):
        lookup_rows(w, s, ids[:, :5].copy(), head_start=0, bucket_sizes=sizes)
    with pytest.raises(LookupIdError, match="expected"):
        lookup_rows(w, s, ids.reshape(-1), head_start=0, bucket_sizes=sizes)
    with pytest.raises(LookupIdError, match="not columns"):
        lookup_rows(w, s, ids, head_start=4, bucket_sizes=sizes)


def test_int32_and_token_strided_ids_read_the_same_rows_without_a_copy():
    sizes, w, s = _shard(0, 8)
    ids = _ids(40)
    want = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes)
    got = lookup_rows(w, s, ids.astype(np.int32), head_start=0, bucket_sizes=sizes)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    wide = np.full((40, 3, 8), 7, np.int64)  # like out[:, layer] of HashState.hash
    wide[:, 1] = ids
    strided = wide[:, 1]
    assert not strided.flags.c_contiguous
    got = lookup_rows(w, s, strided, head_start=0, bucket_sizes=sizes)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_empty_batch():
    sizes, w, s = _shard(0, 8)
    out = lookup_rows(w, s, np.zeros((0, 8), np.int64), head_start=0, bucket_sizes=sizes)
    assert out.shape == (0, 8, DIM)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 140),
                         min_size=4, max_size=4), min_size=1, max_size=20),
       st.sampled_from([0, 4]))
def test_fuzz_never_crashes(rows, head_start):
    sizes, w, s = _shard(head_start, head_start + 4)
    ids = np.zeros((len(rows), 8), np.int64)
    ids[:, head_start:head_start + 4] = rows
    try:
        got = lookup_rows(w, s, ids, head_start=head_start, bucket_sizes=sizes)
    except LookupIdError:
        cols = ids[:, head_start:head_start + 4]
        assert ((cols < -1) | (cols >= np.array(sizes))).any()
        return
    want = reference_lookup(w, s, ids, head_start=head_start, bucket_sizes=sizes)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.slow  # starts an interpreter (~1 s)
@pytest.mark.parametrize("disabled", [(), ("NUMA_ENGRAM_NO_VBMI",), ("NUMA_ENGRAM_NO_AVX512",),
                                      ("NUMA_ENGRAM_NO_AVX512", "NUMA_ENGRAM_NO_AVX2")],
                         ids=["best", "avx512bw", "avx2", "portable"])
def test_every_kernel_path_is_bit_exact_for_every_byte_under_every_scale(disabled):
    """The AVX-512 VBMI row is used where the CPU has it, else AVX-512BW's,
    else AVX2's, else the portable (compiler vectorised) one (a path the CPU
    lacks runs the next one here): each must give the reference's bits for
    every weight byte under every scale byte, with neighbouring blocks of a
    row under different scales (the VBMI row takes two blocks a step), on
    both sides of the small-call threshold (256 rows read in token order,
    8192 sorted)."""
    code = """
        import numpy as np, torch
        from numa_engram.lookup.cpu import lookup_rows, reference_lookup
        w = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(256, 256)
        s = ((np.arange(256)[:, None] + 37 * np.arange(8)) % 256).astype(np.uint8)
        ok = True
        for tokens in (256, 8192):
            ids = (np.arange(tokens, dtype=np.int64) % 256).reshape(tokens, 1)
            got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[256], threads=2)
            want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=[256])
            ok = ok and torch.equal(got.view(torch.int16), want.view(torch.int16))
        print(ok)
    """
    assert_prints_true(code, disabled)


def test_rows_wider_than_the_staging_buffer_take_the_direct_path():
    w, s = random_rows(300, 1056, seed=4, raw=True)  # 1056 B > the 1024 B staging row
    ids = np.random.default_rng(5).integers(-1, 300, size=(70, 1))
    got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[300], threads=2)
    want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=[300])
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dim", [64, 128, 512, 1024, 2048, 2112])
def test_rows_of_every_width_are_bit_exact(dim):
    """Rows of 2-66 scale blocks (over 1024 bytes a row is read in place,
    not staged), random bytes (NaN and every scale byte), token order and
    table order, bit-exact."""
    w, s = random_rows(300, dim, seed=dim, raw=True)
    for tokens in (40, 3000):  # 40 rows read in token order, 3000 sorted
        ids = np.random.default_rng(dim + tokens).integers(-1, 300, size=(tokens, 1))
        got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[300], threads=2)
        want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=[300])
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_default_output_reuses_freed_buffers_and_never_a_live_one():
    import gc
    import threading

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        table.weights[:] = np.random.default_rng(0).integers(0, 256, table.weights.shape,
                                                             dtype=np.uint8)
        table.scales[:] = 120
        ids_a = np.zeros((64, spec.n_hash_cols), np.int64)
        ids_b = np.ones((64, spec.n_hash_cols), np.int64)
        a = table.lookup(ids_a)
        keep = a.clone()
        view = a[3:9]
        ptr = a.data_ptr()
        del a
        gc.collect()
        b = table.lookup(ids_b)  # the view keeps a's storage: b must not reuse it
        assert b.data_ptr() != ptr
        assert torch.equal(view.view(torch.int16), keep[3:9].view(torch.int16))
        freed = {ptr, b.data_ptr()}
        del view, b
        gc.collect()
        assert table.lookup(ids_a).data_ptr() in freed, "a freed buffer is reused"
        results = []

        def worker(ids):
            for _ in range(50):
                r = table.lookup(ids)
                results.append(bool((r.view(torch.int16) == table.lookup(ids)
                                     .view(torch.int16)).all()))
        threads = [threading.Thread(target=worker, args=(x,)) for x in (ids_a, ids_b)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert all(results) and len(results) == 100


def test_packed_fp8_output_dequantises_to_the_lookup():
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads
    from numa_engram.model.fp8 import dequantize_rows

    spec = EngramSpec.small(rows_per_head=500)
    shard = shard_heads(spec.bucket_sizes(1), 2, 1)
    with SharedEngramTable.create(spec, 1, shard) as table:
        rng = np.random.default_rng(3)
        table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
        table.scales[:] = rng.integers(0, 256, table.scales.shape, dtype=np.uint8)
        ids = np.stack([rng.integers(-1, n, 300) for n in spec.bucket_sizes(1)], 1)
        rows, scales = table.lookup(ids, packed=True)
        assert rows.shape == (300, 4, 64) and scales.shape == (300, 4, 2)
        got = dequantize_rows(rows.reshape(-1, 64), scales.reshape(-1, 2)).view(300, 4, 64)
        want = table.lookup(ids)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        dead = ids[:, 4:8] == -1
        assert not rows.numpy()[dead].any() and not scales.numpy()[dead].any()
        first = rows.clone()
        with pytest.raises(LookupIdError, match="column 5"):
            bad = ids.copy()
            bad[7, 5] = 10**6
            table.lookup(bad, packed=True, out=(rows, scales))
        for threads in (1, 2):
            table.lookup_threads = threads
            again = table.lookup(ids, packed=True)
            assert torch.equal(again[0], first)


def _packed_reference(w, s, ids, sizes):
    """The rows as stored, by numpy take: zeros for DEAD."""
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rows = np.where(ids >= 0, ids + offsets, 0)
    keep = (ids >= 0)[..., None]
    return np.where(keep, w[rows], 0), np.where(keep, s[rows], 0)


def test_rows_read_in_table_order_land_in_token_order_across_chunks():
    """The kernel sorts a job's rows by table address (ORDER_CHUNK = 2**18
    rows at a time) and writes each to its token's place: a job of 2 chunks
    over a 2**17-row table (so the sort's buckets hold many rows), with
    heavy repeats and DEAD ids, gives the reference's bits, BF16 and packed,
    on 1 and 2 threads; the first bad id is the one reported, in token order."""
    sizes = [1 << 15] * 4
    w, s = random_rows(sum(sizes), DIM, seed=7, raw=True)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 1 << 15, size=(70_000, 4))  # 280 k rows > one chunk
    ids[rng.random(ids.shape) < 0.3] = 17  # 30% the same row
    ids[rng.random(ids.shape) < 0.05] = -1
    want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=sizes)
    want_w, want_s = _packed_reference(w, s, ids, sizes)
    for threads in (1, 2):
        got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes, threads=threads)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        packed = (np.empty((70_000, 4, DIM), np.uint8), np.empty((70_000, 4, 2), np.uint8))
        gather(w, s, ids, head_start=0, bucket_sizes=sizes, out=packed, threads=threads)
        np.testing.assert_array_equal(packed[0], want_w)
        np.testing.assert_array_equal(packed[1], want_s)
    ids[69_000, 2] = 1 << 15  # in the second chunk
    ids[5, 3] = -5            # in the first: reported, with the count
    with pytest.raises(LookupIdError, match=r"hash id -5 at token 5, column 3 .*2 bad ids"):
        lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes)


@pytest.mark.parametrize("offset", [0, 2, 66])
def test_aligned_and_unaligned_outputs_get_the_same_bits(offset):
    """Streaming stores where the output is 64-byte aligned, plain stores
    where it is not (``offset`` bytes past a 64-byte boundary): the same
    bits either way, BF16 and packed."""
    w, s = random_rows(sum(SIZES), 256, seed=9, raw=True)
    ids = _ids(300)
    n = 300 * 8 * 256
    memory = aligned_empty(2 * n + 128, np.uint8)
    out = torch.from_numpy(memory[offset:offset + 2 * n].view(np.uint16).reshape(300, 8, 256))
    got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=SIZES, out=out.view(torch.bfloat16))
    want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=SIZES)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    packed = (memory[offset:offset + n].reshape(300, 8, 256), np.empty((300, 8, 8), np.uint8))
    gather(w, s, ids, head_start=0, bucket_sizes=SIZES, out=packed)
    want_w, want_s = _packed_reference(w, s, ids, SIZES)
    np.testing.assert_array_equal(packed[0], want_w)
    np.testing.assert_array_equal(packed[1], want_s)


def test_pooled_outputs_are_aligned_for_streaming_stores():
    pool = OutputPool()
    for shape in ((1, 1, 3), (100, 24, 256)):
        tensor, bits = pool.take(shape)
        assert bits.ctypes.data % 64 == 0 and tensor.data_ptr() % 64 == 0
        assert tensor.shape == shape and tensor.dtype == torch.bfloat16


@pytest.mark.slow  # starts an interpreter (~1 s)
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer reserves terabytes of shadow address space: an "
                    "address-space limit cannot be set under it (tools/sanitize.sh)")
def test_no_memory_for_the_kernel_scratch_is_a_memory_error():
    """The kernel's sort scratch is malloc'ed per call: when that fails the
    lookup raises MemoryError naming it (nothing written, no crash)."""
    code = """
        import resource, numpy as np
        from numa_engram.lookup.cpu import lookup_rows
        from numa_engram.model.fp8 import random_rows
        w, s = random_rows(5000, 64, seed=1, raw=True)
        ids = np.random.default_rng(2).integers(0, 5000, size=(200_000, 1))
        out = lookup_rows(w, s, ids[:10], head_start=0, bucket_sizes=[5000])  # warm
        import torch
        big = torch.empty((200_000, 1, 64), dtype=torch.bfloat16)
        vm = int([l.split()[1] for l in open("/proc/self/status")
                  if l.startswith("VmSize")][0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), vm + (1 << 20)))
        try:
            lookup_rows(w, s, ids, head_start=0, bucket_sizes=[5000], out=big)
        except MemoryError as exc:
            print("MemoryError:", exc)
    """
    import subprocess
    import sys
    import textwrap

    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MemoryError: lookup of 200000 tokens x 1 heads: no memory for its scratch" in \
        out.stdout


# ------------------------------------------------ serving-size lookups --

@pytest.mark.parametrize("rows_at", [0, 1, native.lib.NE_SMALL_ROWS, 4096])
@pytest.mark.parametrize("tokens", [1, 7, 85, 86, 200])
def test_both_sides_of_the_small_call_threshold_are_bit_exact(rows_at, tokens):
    """24 heads: 85 tokens are 2040 rows, 86 are 2064 (either side of the
    default); the threshold moved to 0 and 4096 puts every size on one side."""
    sizes = [97 + i for i in range(24)]
    w, s = random_rows(sum(sizes), 64, seed=tokens)
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.integers(-1, n, tokens) for n in sizes], 1)
    tuning = lookupkernel.Tuning(small_rows=rows_at)
    for threads in (1, 2):
        got = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes, threads=threads,
                          tuning=tuning)
        want = reference_lookup(w, s, ids, head_start=0, bucket_sizes=sizes)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        packed = (np.empty((tokens, 24, 64), np.uint8), np.empty((tokens, 24, 2), np.uint8))
        gather(w, s, ids, head_start=0, bucket_sizes=sizes, out=packed, threads=threads,
               tuning=tuning)
        rows = np.where(ids >= 0, ids + np.cumsum([0] + sizes[:-1]), 0)
        np.testing.assert_array_equal(packed[0], np.where((ids >= 0)[..., None], w[rows], 0))
    with pytest.raises(ValueError, match="small_rows must be in 0..4096"):
        lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes,
                    tuning=lookupkernel.Tuning(small_rows=5000))


def _threads(settle_at: int | None = None) -> int:
    """This process's thread count; with ``settle_at``, once it is that (or
    after 5 s): a thread pthread_join returned for stays in /proc/self/task
    until the kernel has reaped it, a moment later (a leaked one stays).
    torch's own thread pool is started first (its first parallel op starts
    it: a test run alone counted it as a lookup worker)."""
    import os
    import time

    torch.equal(torch.zeros(1 << 20), torch.zeros(1 << 20))

    deadline = time.monotonic() + 5
    while True:
        count = len(os.listdir("/proc/self/task"))
        if settle_at is None or count == settle_at or time.monotonic() > deadline:
            return count
        time.sleep(0.005)


def test_table_workers_persist_and_stop_with_close_no_leak_after_100_tables():
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    ids = np.random.default_rng(0).integers(0, 500, (3000, spec.n_hash_cols))
    before = _threads()
    # 3 threads a call: the caller runs one part, 2 workers the others
    with SharedEngramTable.create(spec, 1, shard, lookup_threads=3) as table:
        first = table.lookup(ids).clone()
        workers = table.rows._kernel.workers
        assert workers is not None and _threads() == before + 2  # made once...
        for _ in range(5):
            assert torch.equal(table.lookup(ids), first)
        assert table.rows._kernel.workers is workers and _threads() == before + 2  # ...and kept
        want = reference_lookup(table.weights, table.scales, ids, head_start=0,
                                bucket_sizes=spec.bucket_sizes(1))
        assert torch.equal(first.view(torch.int16), want.view(torch.int16))
    assert _threads(settle_at=before) == before  # close() stopped them
    for _ in range(100):
        table = SharedEngramTable.create(spec, 1, shard, lookup_threads=3)
        table.lookup(ids)
        table.close()
    assert _threads(settle_at=before) == before


def _calls_compared(table, seed: int, token_counts: tuple[int, ...], pause_every: int,
                    wrong: list[tuple[int, int]]) -> None:
    """60 lookups of ``table`` (one head column each of its shard's heads,
    DEAD ids among them) of the sizes in ``token_counts``, every
    ``pause_every``-th after 2 ms (past the workers' spin: they sleep),
    each compared bit for bit with the reference; (seed, call) of each that
    differs goes to ``wrong``."""
    import time

    sizes = table.spec.bucket_sizes(table.layer_id)
    r = np.random.default_rng(seed)
    for call in range(60):
        tokens = int(r.choice(token_counts))
        ids = np.stack([r.integers(-1, n, tokens) for n in sizes], 1)
        want = reference_lookup(table.weights, table.scales, ids, head_start=0,
                                bucket_sizes=sizes)
        if call % pause_every == 0:
            time.sleep(0.002)
        if not torch.equal(table.lookup(ids).view(torch.int16), want.view(torch.int16)):
            wrong.append((seed, call))


def test_tables_on_the_same_cpus_share_one_pool_that_the_last_to_let_go_stops():
    """Tables whose lookups ask for as many threads on the same CPUs use one
    set of workers (a step's second layer finds them awake); each stays
    bit-exact, closing one leaves the other's lookups working, a table
    dropped by a setter lets go of them too, another thread count gets a
    pool of its own, and the last table to let go stops the threads."""
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    ids = np.random.default_rng(2).integers(0, 500, (3000, spec.n_hash_cols))
    before = _threads()
    a = SharedEngramTable.create(spec, 1, shard, lookup_threads=3)
    b = SharedEngramTable.create(spec, 1, shard, lookup_threads=3)
    c = SharedEngramTable.create(spec, 1, shard, lookup_threads=2)
    try:
        for table in (a, b, c):
            table.weights[:] = np.random.default_rng(id(table) % 1000).integers(
                0, 256, table.weights.shape, dtype=np.uint8)
        wants = [reference_lookup(t.weights, t.scales, ids, head_start=0,
                                  bucket_sizes=spec.bucket_sizes(1)).view(torch.int16)
                 for t in (a, b, c)]
        for table, want in zip((a, b, c), wants):
            assert torch.equal(table.lookup(ids).view(torch.int16), want)
        assert a.rows._kernel.workers is b.rows._kernel.workers is not c.rows._kernel.workers
        assert _threads() == before + 2 + 1
        a.close()
        assert torch.equal(b.lookup(ids).view(torch.int16), wants[1])
        assert _threads(settle_at=before + 3) == before + 3  # b still uses them
        b.lookup_threads = 2  # b's kernel dropped: b now shares c's pool
        assert torch.equal(b.lookup(ids).view(torch.int16), wants[1])
        assert b.rows._kernel.workers is c.rows._kernel.workers
        assert _threads(settle_at=before + 1) == before + 1  # nobody uses the 2-thread one
    finally:
        for table in (a, b, c):
            table.close()
    assert _threads(settle_at=before) == before


def test_callers_of_tables_sharing_a_pool_each_get_their_own_rows():
    """Two threads looking up two tables that share one pool, calls of
    every size, some after a pause (workers asleep): a call that finds the
    pool busy with the other table's runs on its caller alone; every call
    gets exactly its own table's rows."""
    import threading

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    sizes = spec.bucket_sizes(1)
    shard = shard_heads(sizes, 1, 0)
    with SharedEngramTable.create(spec, 1, shard, lookup_threads=3) as a, \
            SharedEngramTable.create(spec, 1, shard, lookup_threads=3) as b:
        for seed, table in enumerate((a, b)):
            rng = np.random.default_rng(20 + seed)
            table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
            table.scales[:] = rng.integers(100, 140, table.scales.shape, dtype=np.uint8)
        wrong: list[tuple[int, int]] = []
        threads = [threading.Thread(target=_calls_compared, args=(
            t, seed, (1, 40, 300, 2500, 6000), 4, wrong)) for t, seed in ((a, 1), (b, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert a.rows._kernel.workers is b.rows._kernel.workers
        assert wrong == []


def test_a_forked_child_looks_up_through_a_pool_of_its_own():
    import os

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    ids = np.random.default_rng(1).integers(0, 500, (3000, spec.n_hash_cols))
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                  lookup_threads=2) as table:
        want = table.lookup(ids).view(torch.int16).numpy().copy()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's pool has no threads here
            ok = False
            try:  # numpy only: torch's OpenMP pool does not survive a fork
                got = table.lookup(ids).view(torch.int16).numpy()
                ok = np.array_equal(got, want) and table.rows._kernel.workers.pid == os.getpid()
            finally:
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
        os.close(w)
        import select
        import signal

        answer = os.read(r, 1) if select.select([r], [], [], 60)[0] else b"hung"
        if answer == b"hung":
            os.kill(pid, signal.SIGKILL)  # the child this test forked
        os.waitpid(pid, 0)
        os.close(r)
        assert answer == b"1"
        # the parent's pool still works
        np.testing.assert_array_equal(table.lookup(ids).view(torch.int16).numpy(), want)


@pytest.mark.parametrize("split_rows", [1, native.lib.NE_SPLIT_ROWS, 1 << 40])
@pytest.mark.parametrize("stream_bytes", [0, native.lib.NE_STREAM_BYTES, 1 << 40])
@pytest.mark.parametrize("job_rows", [1, native.lib.NE_JOB_ROWS, native.lib.NE_SHARE_ROWS])
def test_split_and_streaming_thresholds_never_change_the_bits(split_rows, stream_bytes, job_rows):
    """A call splits over the table's threads (the caller and its pool)
    only above split_rows rows per thread, in jobs of job_rows rows that
    the threads claim up to NE_SHARE_ROWS rows (one job a thread above),
    and writes with streaming stores from stream_bytes on: every side of
    each gives the reference's bits, for a decode step, a call either side
    of the split, one that shares jobs and a large call."""
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    rng = np.random.default_rng(split_rows % 97)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                  lookup_threads=3) as table:
        table.rows.tuning = lookupkernel.Tuning(split_rows=split_rows, stream_bytes=stream_bytes,
                                                job_rows=job_rows)
        table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
        table.scales[:] = rng.integers(100, 140, table.scales.shape, dtype=np.uint8)
        sizes = spec.bucket_sizes(1)
        two = -(-2 * native.lib.NE_SPLIT_ROWS // len(sizes))  # the fewest tokens split in two
        for tokens in (1, two - 1, two, 700, 5000):
            ids = np.stack([rng.integers(-1, n, tokens) for n in sizes], 1)
            want = reference_lookup(table.weights, table.scales, ids, head_start=0,
                                    bucket_sizes=sizes)
            assert torch.equal(table.lookup(ids).view(torch.int16), want.view(torch.int16))
    for bad in (dict(split_rows=0), dict(job_rows=0), dict(stream_bytes=-1)):
        with pytest.raises(ValueError, match="split_rows >= 1, job_rows in 1..16384"):
            table.rows.tuning = lookupkernel.Tuning(**bad)


def test_jobs_claimed_by_whichever_thread_is_awake_give_the_bits_of_every_call():
    """The caller and the table's workers claim a call's jobs as they come,
    so a worker that wakes late claims none, or claims jobs of the next
    call: two caller threads making calls of every size, some right after
    another (workers spinning), some after a pause (workers asleep, woken
    mid-call), each get exactly their own rows."""
    import threading

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    sizes = spec.bucket_sizes(1)
    with SharedEngramTable.create(spec, 1, shard_heads(sizes, 1, 0), lookup_threads=3) as table:
        rng = np.random.default_rng(11)
        table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
        table.scales[:] = rng.integers(100, 140, table.scales.shape, dtype=np.uint8)
        wrong: list[tuple[int, int]] = []
        threads = [threading.Thread(target=_calls_compared, args=(
            table, seed, (1, 40, 70, 300, 700, 2500), 3, wrong)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == []


def test_a_pooled_output_is_handed_out_again_only_once_nothing_refers_to_it():
    """The pool keeps the tensor it handed out: the same one comes back once
    the caller dropped it; a kept result, a slice of one or a numpy view of
    one keeps its memory from the next call."""
    import gc

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        table.weights[:] = 7
        table.scales[:] = 127
        ids = np.zeros((4, spec.n_hash_cols), np.int64)
        first = table.lookup(ids)
        ptr = first.data_ptr()
        del first
        again = table.lookup(ids)
        assert again.data_ptr() == ptr, "a dropped result's buffer is reused"
        for keep in (lambda r: r, lambda r: r[1:3], lambda r: r.view(torch.int16).numpy()):
            ptr = again.data_ptr()
            held = keep(again)
            del again
            gc.collect()
            other = table.lookup(ids)
            assert other.data_ptr() != ptr, "memory still referred to was handed out"
            other_ptr = other.data_ptr()
            del held, other
            gc.collect()
            again = table.lookup(ids)
            # the last call's buffer first (its lines are the ones in cache)
            assert again.data_ptr() == other_ptr, "a freed buffer is reused, not a new one made"
            assert len(table.rows._outputs._buffers) == 2


def test_a_prepared_output_gives_what_out_gives_and_refuses_another_shape():
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    rng = np.random.default_rng(3)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
        table.scales[:] = 120
        ids = rng.integers(0, 500, (6, spec.n_hash_cols))
        buf = torch.empty((6, spec.n_hash_cols, spec.head_dim), dtype=torch.bfloat16)
        prepared = table.prepare_out(buf)
        got = table.lookup(ids, out=prepared)
        assert got is buf
        assert torch.equal(got.view(torch.int16), table.lookup(ids).view(torch.int16))
        pair = (torch.empty((6, spec.n_hash_cols, spec.head_dim), dtype=torch.uint8),
                torch.empty((6, spec.n_hash_cols, spec.scales_per_row), dtype=torch.uint8))
        rows, scales = table.lookup(ids, out=table.prepare_out(pair, packed=True), packed=True)
        want_rows, want_scales = table.lookup(ids, packed=True)
        assert torch.equal(rows, want_rows) and torch.equal(scales, want_scales)
        with pytest.raises(ValueError, match="prepare one for this many tokens"):
            table.lookup(ids[:5], out=prepared)
        with pytest.raises(ValueError, match="packed=False"):
            table.lookup(ids, out=prepared, packed=True)


def test_a_bound_lookup_gives_what_lookup_gives_and_counts_what_it_refuses():
    from numa_engram import EngramSpec, SharedEngramTable, StorageError, shard_heads
    from numa_engram.errors import LookupIdError

    spec = EngramSpec.small(rows_per_head=500)
    rng = np.random.default_rng(4)
    table = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0))
    table.weights[:] = rng.integers(0, 256, table.weights.shape, dtype=np.uint8)
    table.scales[:] = rng.integers(110, 130, table.scales.shape, dtype=np.uint8)
    buf = torch.empty((5, spec.n_hash_cols, spec.head_dim), dtype=torch.bfloat16)
    into = table.bind_lookup(buf)
    for _ in range(3):  # the same output every call, with other ids each time
        ids = rng.integers(-1, 500, (5, spec.n_hash_cols))
        assert into(ids) is buf
        want = _bits(table.lookup(ids))
        assert np.array_equal(_bits(buf), want)
        assert np.array_equal(_bits(into(torch.from_numpy(ids))), want)  # a tensor of them too
    pair = (torch.empty((5, spec.n_hash_cols, spec.head_dim), dtype=torch.uint8),
            torch.empty((5, spec.n_hash_cols, spec.scales_per_row), dtype=torch.uint8))
    base = table.id_base("global")
    packed = table.bind_lookup(pair, packed=True, id_format="global")
    rows, scales = packed(np.where(ids >= 0, ids + base, -1))
    want_rows, want_scales = table.lookup(ids, packed=True)
    assert torch.equal(rows, want_rows) and torch.equal(scales, want_scales)
    before = table.stats()
    bad = ids.copy()
    bad[2, 1] = 10**9
    with pytest.raises(LookupIdError, match="1000000000"):
        into(bad)
    with pytest.raises(ValueError, match="bind one for this many tokens"):
        into(ids[:4])
    with pytest.raises(ValueError, match="packed=True"):
        table.bind_lookup(table.prepare_out(buf), packed=True)
    after = table.stats()
    assert (after.bad_id_lookups, after.failed_lookups) == \
        (before.bad_id_lookups + 1, before.failed_lookups + 1)
    table.close()
    with pytest.raises(StorageError, match="closed"):
        into(ids)


def test_default_lookup_threads_are_the_allowed_cpus_of_the_rows_node_at_most_four():
    import os

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads
    from numa_engram.lookup.cpu import MAX_DEFAULT_LOOKUP_THREADS, default_lookup_threads

    allowed = sorted(os.sched_getaffinity(0))
    assert default_lookup_threads() == min(MAX_DEFAULT_LOOKUP_THREADS, len(allowed))
    assert default_lookup_threads(allowed[:1]) == 1
    assert default_lookup_threads([10_000, 10_001]) == 1  # none of them allowed: the caller
    spec = EngramSpec.small(rows_per_head=500)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        assert table.lookup_threads == default_lookup_threads(table.lookup_cpus)
        assert table.mode_report()["lookup_threads"] == table.lookup_threads
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                  lookup_threads=1) as table:
        assert table.lookup_threads == 1


def test_packed_outputs_are_pooled_too():
    """lookup(ids, packed=True) without out= reuses the rows and scales
    buffers of a dropped result (a fresh large output is page faults every
    call), never those of a result still held."""
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        table.weights[:] = 5
        table.scales[:] = 127
        ids = np.zeros((16, spec.n_hash_cols), np.int64)
        rows, scales = table.lookup(ids, packed=True)
        ptrs = (rows.data_ptr(), scales.data_ptr())
        del rows, scales
        rows, scales = table.lookup(ids, packed=True)
        assert (rows.data_ptr(), scales.data_ptr()) == ptrs
        other_rows, other_scales = table.lookup(ids, packed=True)  # the first pair is held
        assert other_rows.data_ptr() != ptrs[0] and other_scales.data_ptr() != ptrs[1]
        assert torch.equal(other_rows, rows) and bool((rows == 5).all())


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # exited since it was listed
        return ""


def test_a_tables_lookup_threads_are_bound_to_the_rows_nodes_cpus():
    """The pool's threads run only on lookup_cpus (the rows' node), as a
    set: the kernel picks an idle one of them for each."""
    import os

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=500)
    node_cpus = sorted(os.sched_getaffinity(0))[:1]  # a one-CPU "node" this process may use
    before = set(os.listdir("/proc/self/task"))
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                  lookup_threads=3) as table:
        table.lookup_cpus = node_cpus
        table.lookup_threads = 3  # (a default table on one CPU would have 1)
        table.lookup(np.zeros((3000, spec.n_hash_cols), np.int64))
        # the pool's threads by their name (pool.c's NE_POOL_THREAD_NAME):
        # another thread this process starts meanwhile (torch's) is not one
        workers = [tid for tid in set(os.listdir("/proc/self/task")) - before
                   if _comm(tid) == "numa-engram-lk"]
        assert len(workers) == 2
        assert all(os.sched_getaffinity(int(tid)) == set(node_cpus) for tid in workers)


def test_a_pool_bound_to_cpus_this_process_may_not_use_runs_where_it_may():
    """A node whose CPUs are all outside this process's cpuset (a
    container's): the threads start unbound instead of failing the table."""
    import os

    from numa_engram.bindings.lookupkernel import Workers

    allowed = os.sched_getaffinity(0)
    foreign = 1000  # below CPU_SETSIZE, above any CPU this host has
    assert foreign not in allowed
    before = set(os.listdir("/proc/self/task"))
    pool = Workers(2, [foreign])
    try:
        workers = [tid for tid in set(os.listdir("/proc/self/task")) - before
                   if _comm(tid) == "numa-engram-lk"]
        assert len(workers) == 2
        assert all(os.sched_getaffinity(int(tid)) == allowed for tid in workers)
    finally:
        pool.close()
