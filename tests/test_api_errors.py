"""Misuse of the PLE hashing and lookup APIs and of the kernels' bindings
(issue 49, items 3, 4, 5, 13 and 14): each is the library's error naming
the value, never a crash, a write into the table, a bare numpy or cffi
error, or a message about something else."""

from __future__ import annotations

import numpy as np
import pytest

from numa_engram.bindings import hashkernels, lookupkernel
from numa_engram.checkpoints.synthetic import write_ple_checkpoint
from numa_engram.errors import LookupIdError, SpecError, StorageError
from numa_engram.model.ple import PLESpec
from numa_engram.model.plehashing import PLEHistory, ple_ids, ple_ids_numpy
from numa_engram.tables.pletable import SharedPLETable

torch = pytest.importorskip("torch")

SPEC = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
               ngram_vocab_size_base=3000, split_ngram_parts=7)
LAYER = 2


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """A PLE table loaded from a checkpoint: sealed, its mapping read-only."""
    path = write_ple_checkpoint(tmp_path_factory.mktemp("ple") / "m.safetensors", SPEC, seed=3)
    with SharedPLETable.create(SPEC, LAYER, checkpoint=str(path), mode="independent") as table:
        assert not table.weights.flags.writeable
        yield table


@pytest.fixture
def writable():
    with SharedPLETable.create(SPEC, LAYER, mode="independent") as table:
        assert table.weights.flags.writeable
        yield table


def _ids(n: int = 6) -> np.ndarray:
    return np.random.default_rng(1).integers(0, SPEC.rows(LAYER), n)


# ------------------------------------------------ item 3: out= over the table --

@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("which", ["sealed", "writable"])
def test_ple_out_over_the_tables_own_rows_is_refused(request, which):
    """A view of the table's rows as ``out=``: the kernel's write was a
    SIGSEGV on the sealed (read-only) mapping and overwrote the rows of a
    writable one."""
    table = request.getfixturevalue(which)
    ids = _ids()
    nbytes = len(ids) * SPEC.head_dim * 2
    out = torch.from_numpy(table.weights.reshape(-1)[nbytes:2 * nbytes]).view(torch.bfloat16)
    before = table.weights.copy()
    with pytest.raises(SpecError, match="out and the table's mapping share bytes"):
        table.lookup(ids, out.view(len(ids), SPEC.head_dim))
    assert np.array_equal(table.weights, before)


# --------------------------------------------- item 4: out= over the ids --

@pytest.mark.parametrize("offset", [0, 8])
def test_ple_out_sharing_bytes_with_the_ids_is_refused(sealed, offset):
    """ids whose bytes are out's: the kernel wrote rows over ids it had not
    read yet (wrong rows, or a LookupIdError naming an id never passed)."""
    ids = _ids(16)
    whole = torch.zeros(len(ids) * SPEC.head_dim * 2 + offset, dtype=torch.uint8)
    shared = whole[offset:offset + ids.nbytes].view(torch.int64).numpy()
    shared[:] = ids
    out = whole[:len(ids) * SPEC.head_dim * 2].view(torch.bfloat16).view(len(ids), -1)
    with pytest.raises(SpecError, match="out and the ids share bytes"):
        sealed.lookup(shared, out)
    assert np.array_equal(shared, ids)


def test_ple_rows_out_must_be_writable_and_apart_from_the_ids(sealed):
    ids = _ids(4)
    out = np.empty((4, SPEC.head_dim), np.uint16)
    out.flags.writeable = False
    with pytest.raises(SpecError, match="writable"):
        sealed.rows.rows_bf16(ids, out)
    both = np.zeros(4 * SPEC.head_dim, np.uint16)
    view = both[:16].view(np.int64)
    view[:] = ids
    with pytest.raises(SpecError, match="out and the ids share bytes"):
        sealed.rows.rows_bf16(view, both.reshape(4, SPEC.head_dim))


# ------------------------------------------ item 5: the PLE hash kernel --

@pytest.mark.parametrize("size", [0, -1])
def test_a_zero_or_negative_bucket_size_is_refused_by_the_binding(size):
    """A zero bucket size was a SIGFPE in ple.c (``mix % 0``); -1 one too
    (INT64_MIN % -1)."""
    mult = SPEC.multipliers(LAYER)[None]
    sizes = np.array([SPEC.bucket_sizes(LAYER)], dtype=np.int64)
    sizes[0, 3] = size
    offsets = SPEC.head_offsets(LAYER)[None]
    ids = np.array([1, 2, 3], np.int64)
    qs, ctx = np.array([0, 3], np.int64), np.full((1, 2), 7, np.int64)
    with pytest.raises(SpecError, match=rf"bucket size {size} .*layer 0, head 3"):
        hashkernels.ple_ids(ids, qs, ctx, 7, mult, sizes, offsets, SPEC.heads_per_ngram)
    sizes[0, 3] = 5
    assert hashkernels.ple_ids(ids, qs, ctx, 7, mult, sizes, offsets,
                               SPEC.heads_per_ngram).shape == (3, 1, SPEC.n_heads)


def test_the_c_kernel_refuses_a_zero_bucket_size_itself():
    """The C kernel checks the sizes too: EINVAL, not a SIGFPE."""
    from numa_engram.bindings.native import ffi, lib

    sizes = np.zeros(SPEC.n_heads, np.int64)
    mult, offsets = SPEC.multipliers(LAYER), SPEC.head_offsets(LAYER)
    ids, qs, ctx = np.array([1], np.int64), np.array([0, 1], np.int64), np.zeros(2, np.int64)
    out = np.empty(SPEC.n_heads, np.int64)
    cast = lambda a: ffi.cast("int64_t *", ffi.from_buffer(a))  # noqa: E731
    assert lib.ne_ple_ids(cast(ids), 1, cast(qs), 1, cast(ctx), 2, 7, cast(mult), cast(sizes),
                          cast(offsets), 1, SPEC.n_heads, SPEC.heads_per_ngram, cast(out)) == -1
    assert ffi.errno == 22  # EINVAL


# ------------------------------------------------- item 13: the PLE API --

@pytest.mark.parametrize("layers,match", [
    ([], "at least one PLE layer"),
    ("2", r"layer_ids must be a sequence of PLE layer numbers, got str"),
    (2, r"layer_ids must be a sequence of PLE layer numbers, got int"),
    ([2.0], r"layer_ids entry must be an integer, got float 2.0"),
    (["x"], r"layer_ids entry must be an integer, got str 'x'"),
])
def test_ple_ids_refuse_bad_layer_lists_naming_them(layers, match):
    """``ple_ids`` of no layers was a bare ValueError from ``np.stack``; a
    string or a float was parsed or truncated by ``int()``."""
    with pytest.raises(SpecError, match=match):
        ple_ids(SPEC, layers, [1, 2, 3])


@pytest.mark.parametrize("max_requests,match", [
    (2**40, r"max_requests must be in 1\.\.\d+, got 1099511627776"),
    (0, r"max_requests must be in 1\.\.\d+, got 0"),
    ("4", r"max_requests must be an integer, got str '4'"),
    (4.0, r"max_requests must be an integer, got float 4.0"),
])
def test_history_refuses_a_huge_or_non_integer_slot_count(max_requests, match):
    """2**40 slots asked numpy for 16 TiB (MemoryError); "4" was a TypeError."""
    with pytest.raises(SpecError, match=match):
        PLEHistory(SPEC, max_requests)


@pytest.mark.parametrize("restart", [[True], [True, False, True], []])
def test_history_refuses_restart_flags_not_one_per_request(restart):
    """``restart`` of another length was an IndexError from numpy."""
    history = PLEHistory(SPEC, 4)
    with pytest.raises(SpecError, match=r"restart must hold one flag per request \(2\)"):
        history.ids([LAYER], [1, 2, 3], [0, 1, 3], [0, 1], restart=restart)
    assert history.ids([LAYER], [1, 2, 3], [0, 1, 3], [0, 1], restart=[True, False]).shape == \
        (3, 1, SPEC.n_heads)


def test_history_and_numpy_rule_refuse_a_non_integer_layer():
    with pytest.raises(SpecError, match="layer_ids entry must be an integer"):
        PLEHistory(SPEC, 2).ids([2.5], [1], [0, 1], [0])
    with pytest.raises(SpecError, match="layer_id must be an integer, got float"):
        ple_ids_numpy(SPEC, 2.0, [1, 2])  # type: ignore[arg-type]


def test_a_uint64_id_above_2_63_is_named_as_given(writable):
    """It was reported as the negative int64 its bits make."""
    big = np.array([2**63 + 5], dtype=np.uint64)
    with pytest.raises(LookupIdError, match=f"PLE row id {2**63 + 5} "):
        writable.lookup(big)
    with pytest.raises(LookupIdError, match=f"PLE row id {2**63 + 5} "):
        writable.lookup_packed(big)


@pytest.mark.parametrize("bad", [[[1, 2], [3]], ["a"], [1.5], [True], [2**70]],
                         ids=["ragged", "str", "float", "bool", "2**70"])
def test_ids_that_are_not_integers_are_a_lookup_id_error(writable, bad):
    with pytest.raises(LookupIdError, match="PLE row ids must be integers"):
        writable.lookup(bad)


def test_0d_ids_give_one_row_of_head_dim(writable):
    """A scalar id gives ``[head_dim]`` (``[*ids.shape, head_dim]``), not ``[1, head_dim]``."""
    assert tuple(writable.lookup(np.int64(3)).shape) == (SPEC.head_dim,)
    assert tuple(writable.lookup(3).shape) == (SPEC.head_dim,)
    assert writable.lookup_packed(np.int64(3)).shape == (SPEC.row_bytes,)
    assert torch.equal(writable.lookup(3), writable.lookup([3])[0])


@pytest.mark.parametrize("field,value", [("etp_size", 1.5), ("etp_rank", 0.0),
                                         ("etp_size", "2"), ("etp_size", True)])
def test_a_non_integer_etp_size_or_rank_is_named(field, value):
    """``etp_size=1.5`` failed at the group's create step with "required
    argument is not an integer", naming neither."""
    with pytest.raises(SpecError, match=f"{field} must be an integer, got "
                                        f"{type(value).__name__}"):
        SharedPLETable.create(SPEC, LAYER, mode="independent", **{field: value})


def test_a_lookup_racing_close_says_closed(writable):
    """A close() landing between a lookup's read of the table's rows and
    the kernel's read of them (the first call), and lookups after it, say
    closed; they were reported as ids "outside the layer's 0 rows"."""
    rows = writable.rows

    class CloseFirst:
        def __getattr__(self, name):
            method = getattr(rows, name)

            def close_then(*args, **kwargs):
                writable.close()
                return method(*args, **kwargs)
            return close_then

    writable.rows = CloseFirst()
    for call in (lambda: writable.lookup([1, 2]), lambda: writable.lookup_packed([1, 2]),
                 lambda: writable.lookup([1], torch.empty((1, SPEC.head_dim),
                                                          dtype=torch.bfloat16))):
        with pytest.raises(StorageError, match=f"PLE table layer {LAYER} is closed"):
            call()


def test_a_lookup_while_close_is_half_done_says_closed(monkeypatch):
    """A lookup arriving while close() runs (the rows already emptied, the
    workers being stopped) was "outside the layer's 0 rows": the table
    counted as open until close's last line."""
    seen = []
    release = lookupkernel.release_workers

    def release_after_a_lookup(workers) -> None:
        try:
            table.lookup([1, 2])
        except Exception as exc:  # (the assertion names it)
            seen.append(exc)
        release(workers)
    monkeypatch.setattr(lookupkernel, "release_workers", release_after_a_lookup)
    table = SharedPLETable.create(SPEC, LAYER, mode="independent", lookup_threads=2)
    table.close()
    assert len(seen) == 1 and isinstance(seen[0], StorageError), seen
    assert f"PLE table layer {LAYER} is closed" in str(seen[0])


# ------------------------------------------------- item 14: the Tuning --

@pytest.mark.parametrize("fields", [dict(prefetch_ahead=2**40), dict(small_rows=2**70),
                                    dict(stream_bytes=-(2**70)), dict(split_rows=1.5),
                                    dict(job_rows="8"), dict(prefetch_hint=None),
                                    dict(prefetch_ahead=True)])
def test_a_tuning_too_large_or_of_a_wrong_type_names_the_bounds(fields):
    """They were cffi's OverflowError and TypeError."""
    ((name, value),) = fields.items()
    with pytest.raises(SpecError, match=rf"tuning {name}={value!r}.*prefetch_hint in 0\.\.3"):
        lookupkernel.Tuning(**fields).struct()
    lookupkernel.Tuning(prefetch_ahead=np.int64(8)).struct()  # numpy integers are integers

