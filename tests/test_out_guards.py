"""No lookup writes a byte outside the caller's buffer: every ``out=`` path
(packed and BF16; ``lookup``, ``prepare_out``, ``bind_lookup``) gets a slice
of a larger tensor whose other bytes are a guard pattern, and a buffer of
the wrong size, shape, layout or overlap is refused before the kernel runs."""

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads

GUARD = 0xA5
TOKENS = 64


@pytest.fixture(scope="module")
def table():
    spec = EngramSpec.small(rows_per_head=400)
    shard = shard_heads(spec.bucket_sizes(14), 2, 1)
    with SharedEngramTable.create(spec, 14, shard) as t:
        rng = np.random.default_rng(5)
        t.weights[:] = rng.integers(0, 0x7F, t.weights.shape, dtype=np.uint8)
        t.scales[:] = rng.integers(100, 140, t.scales.shape, dtype=np.uint8)
        yield spec, t


def _ids(spec, tokens=TOKENS, seed=1):
    rng = np.random.default_rng(seed)
    return np.ascontiguousarray(rng.integers(0, 400, (tokens, spec.n_hash_cols)), np.int64)


def _guarded(shape, dtype=torch.uint8, pad=4096):
    """A view of ``shape`` in the middle of a guard-filled buffer, and the buffer."""
    n = int(np.prod(shape))
    itemsize = torch.empty((), dtype=dtype).element_size()
    whole = torch.full((n * itemsize + 2 * pad,), GUARD, dtype=torch.uint8)
    view = whole[pad:pad + n * itemsize].view(dtype).view(shape)
    return view, whole, pad, n * itemsize


def _guards_intact(whole, pad, nbytes):
    raw = whole.numpy()
    return bool((raw[:pad] == GUARD).all() and (raw[pad + nbytes:] == GUARD).all())


def _packed_shapes(spec, t, tokens=TOKENS):
    rows = (tokens, t.shard.num_heads, spec.head_dim)
    return rows, (*rows[:2], spec.head_dim // spec.block)


def test_packed_slices_of_exactly_the_right_size_are_filled_and_nothing_around_them(table):
    spec, t = table
    ids = _ids(spec)
    want_rows, want_scales = t.lookup(ids, packed=True)
    want_rows, want_scales = want_rows.clone(), want_scales.clone()
    rows_shape, scales_shape = _packed_shapes(spec, t)
    for path in ("lookup", "prepare_out", "bind_lookup"):
        rows, rows_whole, pad, rows_n = _guarded(rows_shape)
        scales, scales_whole, _, scales_n = _guarded(scales_shape)
        if path == "lookup":
            got = t.lookup(ids, packed=True, out=(rows, scales))
        elif path == "prepare_out":
            got = t.lookup(ids, packed=True, out=t.prepare_out((rows, scales), packed=True))
        else:
            got = t.bind_lookup((rows, scales), packed=True)(ids)
        assert torch.equal(got[0], want_rows) and torch.equal(got[1], want_scales), path
        assert _guards_intact(rows_whole, pad, rows_n), path
        assert _guards_intact(scales_whole, pad, scales_n), path


def test_bf16_slices_are_filled_and_nothing_around_them(table):
    spec, t = table
    ids = _ids(spec)
    want = t.lookup(ids).clone()
    shape = (TOKENS, t.shard.num_heads, spec.head_dim)
    for path in ("lookup", "prepare_out", "bind_lookup"):
        out, whole, pad, n = _guarded(shape, torch.bfloat16)
        if path == "lookup":
            got = t.lookup(ids, out=out)
        elif path == "prepare_out":
            got = t.lookup(ids, out=t.prepare_out(out))
        else:
            got = t.bind_lookup(out)(ids)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), path
        assert _guards_intact(whole, pad, n), path


def _bad_pairs(spec, t):
    """(what is wrong, a (rows, scales) pair, guard buffers to check)."""
    rows_shape, scales_shape = _packed_shapes(spec, t)
    rows_n, scales_n = int(np.prod(rows_shape)), int(np.prod(scales_shape))
    cases = []
    small_rows, rw, pad, _ = _guarded((16,))
    small_scales, sw, _, _ = _guarded((1,))
    cases.append(("16 bytes of rows, 1 of scales", (small_rows, small_scales), [(rw, pad, 16),
                                                                                 (sw, pad, 1)]))
    short, rw2, _, _ = _guarded((TOKENS - 1, *rows_shape[1:]))
    scales, sw2, _, _ = _guarded(scales_shape)
    cases.append(("one token short", (short, scales), [(rw2, pad, rows_n - rows_shape[1] *
                                                        rows_shape[2]), (sw2, pad, scales_n)]))
    flat_rows, rw3, _, _ = _guarded((rows_n,))
    flat_scales, sw3, _, _ = _guarded((scales_n,))
    cases.append(("a 1-D pair of the right byte count", (flat_rows, flat_scales),
                  [(rw3, pad, rows_n), (sw3, pad, scales_n)]))
    both = torch.full((rows_n + scales_n,), GUARD, dtype=torch.uint8)
    cases.append(("rows and scales overlapping",
                  (both[:rows_n].view(rows_shape), both[rows_n - scales_n:rows_n]
                   .view(scales_shape)), []))
    strided = torch.full((TOKENS, rows_shape[1], 2 * rows_shape[2]), GUARD, dtype=torch.uint8)
    cases.append(("strided rows", (strided[:, :, ::2], _guarded(scales_shape)[0]), []))
    cases.append(("int8 rows", (torch.zeros(rows_shape, dtype=torch.int8),
                                torch.zeros(scales_shape, dtype=torch.uint8)), []))
    cases.append(("a list, not a pair", [torch.zeros(rows_shape, dtype=torch.uint8),
                                         torch.zeros(scales_shape, dtype=torch.uint8)], []))
    return cases


@pytest.mark.parametrize("path", ["lookup", "prepare_out", "bind_lookup"])
def test_packed_buffers_of_the_wrong_size_shape_layout_or_overlap_are_refused(table, path):
    spec, t = table
    ids = _ids(spec)
    for what, pair, guards in _bad_pairs(spec, t):
        with pytest.raises(ValueError, match=r"out('s (rows|scales))? must be|overlap") as err:
            if path == "lookup":
                t.lookup(ids, packed=True, out=pair)
            elif path == "prepare_out":
                t.lookup(ids, packed=True, out=t.prepare_out(pair, packed=True))
            else:
                t.bind_lookup(pair, packed=True)(ids)
        assert "out" in str(err.value), what
        for whole, pad, n in guards:
            assert _guards_intact(whole, pad, n), what
    rows, scales = t.lookup(ids, packed=True)  # the table works on
    assert rows.shape == _packed_shapes(spec, t)[0]


def test_a_wrong_prepare_out_argument_is_a_value_error_not_an_attribute_error(table):
    _, t = table
    for bad in (None, 3, (), "rows"):
        with pytest.raises(ValueError, match="out must be"):
            t.prepare_out(bad, packed=True)
        with pytest.raises(ValueError, match="out must be"):
            t.prepare_out(bad)


@pytest.mark.parametrize("packed", [False, True])
def test_the_schedulers_staging_buffers_take_a_steps_rows_and_nothing_past_them(table, packed):
    """The runtime's buffers: a layer's staging holds ``max_tokens`` rows and
    a step of fewer tokens writes exactly its rows; the rest keep a guard
    pattern, step after step and size after size."""
    from numa_engram.lookup.prefetch import PrefetchScheduler

    spec, t = table
    sched = PrefetchScheduler({14: t}, {14: (t.shard.num_heads, spec.head_dim)},
                              max_tokens=TOKENS, packed=packed)
    try:
        staged = sched.staging[14]
        parts = staged if isinstance(staged, tuple) else (staged,)
        for part in parts:
            part.view(torch.uint8).fill_(GUARD)
        for n, seed in ((10, 1), (3, 2), (17, 3), (1, 4)):
            ids = _ids(spec, n, seed)
            sched.submit(14, ids)
            got = sched.wait(14)
            want = t.lookup(ids, packed=packed)
            if packed:
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            else:
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            for part in parts:
                past = part[17:].contiguous().view(torch.uint8).numpy()
                assert (past == GUARD).all(), f"a step of {n} wrote past row 17"
    finally:
        sched.close()


# ------------------------------------------------ buffers sharing bytes --

@pytest.fixture(scope="module")
def attached(table):
    """The module's table mapped again read-only, as a service's client maps it."""
    import os

    spec, t = table
    fd = t.dup_descriptor()
    try:
        view = SharedEngramTable.attach(spec, 14, t.shard, fd=fd)
    finally:
        os.close(fd)
    with view:
        yield spec, view


def _over(array, shape, dtype):
    """A tensor of ``shape`` over the first bytes of numpy ``array``'s memory."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(array.reshape(-1)[:n].view(np.uint8))
    return raw.view(dtype).view(shape)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("which", ["attached", "table"])
@pytest.mark.parametrize("path", ["lookup", "prepare_out", "prepared alone", "bind_lookup",
                                  "packed"])
def test_out_over_the_tables_own_rows_is_refused_not_written(table, attached, which, path):
    """Issue 49, item 3: a view of the table's rows as ``out=`` (a read-only
    mapping: the kernel's write was a SIGSEGV; a writable one: the table
    overwritten) is refused naming the table."""
    spec, t = attached if which == "attached" else table
    ids = _ids(spec, 4)
    shape = (4, t.shard.num_heads, spec.head_dim)
    before = (t.weights.copy(), t.scales.copy())
    with pytest.raises(ValueError, match="the table's mapping") as err:
        if path == "packed":
            pair = (_over(t.weights, shape, torch.uint8),
                    torch.empty(_packed_shapes(spec, t, 4)[1], dtype=torch.uint8))
            t.lookup(ids, packed=True, out=pair)
        else:
            out = _over(t.scales if path == "bind_lookup" else t.weights, shape, torch.bfloat16)
            if path == "lookup":
                t.lookup(ids, out=out)
            elif path == "prepare_out":
                t.lookup(ids, out=t.prepare_out(out))
            elif path == "prepared alone":  # by the module's prepare_out: for no table
                from numa_engram.lookup.outputs import prepare_out

                t.lookup(ids, out=prepare_out(out, shape))
            else:
                t.bind_lookup(out)(ids)
    from numa_engram.errors import NumaEngramError

    assert isinstance(err.value, NumaEngramError)
    assert np.array_equal(t.weights, before[0]) and np.array_equal(t.scales, before[1])


def _shared(spec, t, tokens, packed=False):
    """(ids, out) over one buffer: the ids' bytes are the start of out's."""
    rows_shape, scales_shape = _packed_shapes(spec, t, tokens)
    n_rows = int(np.prod(rows_shape)) * (1 if packed else 2)
    whole = torch.zeros(n_rows + int(np.prod(scales_shape)), dtype=torch.uint8)
    ids_n = tokens * spec.n_hash_cols * 8
    ids = whole[:ids_n].view(torch.int64).view(tokens, spec.n_hash_cols).numpy()
    ids[:] = _ids(spec, tokens)
    if not packed:
        return ids, whole[:n_rows].view(torch.bfloat16).view(rows_shape)
    return ids, (whole[:n_rows].view(rows_shape), torch.empty(scales_shape, dtype=torch.uint8))


@pytest.mark.parametrize("path", ["lookup", "prepare_out", "bind_lookup", "packed rows",
                                  "packed scales"])
def test_out_sharing_bytes_with_the_ids_is_refused(table, path):
    """Issue 49, item 4: ids whose bytes are out's (the kernel overwrote ids it
    had not read yet: wrong rows, or a LookupIdError naming ids never
    passed) are refused before the kernel runs."""
    spec, t = table
    tokens = 8
    ids, out = _shared(spec, t, tokens, packed=path.startswith("packed"))
    if path == "packed scales":  # the scales over the ids instead
        scales = torch.from_numpy(ids).view(torch.uint8).view(-1)[:out[1].numel()]
        out = (out[1].new_empty(out[0].shape), scales.view(out[1].shape))
    with pytest.raises(ValueError, match="the ids") as err:
        if path == "lookup":
            t.lookup(ids, out=out)
        elif path == "prepare_out":
            t.lookup(ids, out=t.prepare_out(out))
        elif path == "bind_lookup":
            t.bind_lookup(out)(ids)
        else:
            t.lookup(ids, packed=True, out=out)
    from numa_engram.errors import NumaEngramError

    assert isinstance(err.value, NumaEngramError) and "share" in str(err.value)
    assert np.array_equal(ids, _ids(spec, tokens)), "the ids were written"


def test_lookup_rows_refuses_an_out_over_its_ids_or_rows(table):
    """The table-less ``lookup_rows`` checks its ``out=`` as a table does."""
    from numa_engram.errors import SpecError
    from numa_engram.lookup.cpu import lookup_rows

    spec, t = table
    sizes = spec.bucket_sizes(14)[t.shard.head_start:t.shard.head_end]
    ids, out = _shared(spec, t, 8)
    kwargs = dict(head_start=t.shard.head_start, bucket_sizes=sizes, block=spec.block)
    with pytest.raises(SpecError, match="out and the ids share bytes"):
        lookup_rows(t.weights, t.scales, ids, out=out, **kwargs)
    assert np.array_equal(ids, _ids(spec, 8))
    rows = np.zeros_like(t.weights)
    over = _over(rows, out.shape, torch.bfloat16)
    with pytest.raises(SpecError, match="out and the weights share bytes"):
        lookup_rows(rows, t.scales, _ids(spec, 8), out=over, **kwargs)
    assert not rows.any()


def test_the_kernels_themselves_refuse_an_output_over_the_ids_or_the_table(table):
    """The guards live in the C kernels (NE_OVERLAP: nothing read, nothing
    written), so no Python path that casts its own outputs can skip them:
    an Engram kernel's BF16 or packed output over its ids, its table or its
    other output, a PLE shard's over its ids or its table."""
    from numa_engram.bindings import lookupkernel
    from numa_engram.bindings.native import ffi
    from numa_engram.lookup.outputs import array_span
    from numa_engram.model.sharding import prefix_offsets

    spec, t = table
    sizes = np.asarray(spec.bucket_sizes(14)[t.shard.head_start:t.shard.head_end])
    geometry = lookupkernel.Geometry.of(t.weights, t.scales, prefix_offsets(sizes), sizes, None,
                                        spec.block)
    mapped = (min(array_span(t.weights)[0], array_span(t.scales)[0]),
              max(array_span(t.weights)[1], array_span(t.scales)[1]))
    kernel = lookupkernel.ShardKernel(geometry, 1, col0=t.shard.head_start, persistent=False,
                                      mapped=mapped, ids_cols=spec.n_hash_cols)
    tokens = 4
    rows_n = tokens * t.shard.num_heads * spec.head_dim
    whole = np.zeros(2 * rows_n + tokens * spec.n_hash_cols * 8, dtype=np.uint8)
    ids = whole[:tokens * spec.n_hash_cols * 8].view(np.int64).reshape(tokens, spec.n_hash_cols)
    ids[:] = _ids(spec, tokens)
    before = (ids.copy(), t.weights.copy(), t.scales.copy())
    at = ffi.from_buffer(ids)
    over_ids = ffi.cast("uint16_t *", ffi.from_buffer(whole))
    over_rows = ffi.cast("uint16_t *", ffi.from_buffer(t.weights))
    apart = np.empty(rows_n, dtype=np.uint8)
    pair = ffi.from_buffer(apart)
    calls = {"BF16 over the ids": (over_ids, ffi.NULL),
             "BF16 over the table": (over_rows, ffi.NULL),
             "packed scales over the ids": (pair, ffi.from_buffer(whole)),
             "packed rows over their scales": (pair, ffi.cast("uint8_t *", pair) + 8)}
    for what, (rows, scales) in calls.items():
        assert kernel.run(at, tokens, spec.n_hash_cols, False, rows, scales) == \
            lookupkernel.NE_OVERLAP, what
        with pytest.raises(ValueError, match="shares bytes"):
            kernel.bad_ids(lookupkernel.NE_OVERLAP, tokens)
    assert np.array_equal(ids, before[0]) and np.array_equal(t.weights, before[1]) and \
        np.array_equal(t.scales, before[2])
    # and a lookup into a buffer of its own runs
    assert kernel.run(at, tokens, spec.n_hash_cols, False, ffi.from_buffer(
        np.empty(rows_n, dtype=np.uint16))) == 0

    rows = np.random.default_rng(3).integers(0, 256, (64, 160), dtype=np.uint8)
    shard = lookupkernel.PLEShard(rows, 0, 64, 0.5, mapped=array_span(rows))
    ple_ids = np.arange(4, dtype=np.int64)
    kept = rows.copy()
    assert shard.kernel(ffi.from_buffer(ple_ids), 4, True, ffi.from_buffer(rows)) == \
        lookupkernel.NE_OVERLAP
    assert shard.kernel(ffi.from_buffer(ple_ids), 4, False, ffi.from_buffer(ple_ids)) == \
        lookupkernel.NE_OVERLAP
    assert np.array_equal(rows, kept) and np.array_equal(ple_ids, np.arange(4))
    with pytest.raises(ValueError, match="shares bytes"):
        lookupkernel.ple_failed(lookupkernel.NE_OVERLAP)
    out = np.empty((4, 160), dtype=np.uint16)
    assert shard.kernel(ffi.from_buffer(ple_ids), 4, True, ffi.from_buffer(out)) == -1
