"""A decode step's lookups of several layers in one C call
(``lookup.stepgather``): bit-exact with each layer's own lookup for both
families (Engram BF16 and packed, bucket and global ids; PLE FP8 and BF16),
and every guard of the one-layer lookup kept: bad ids named with their
layer, outputs over ids or a table refused before anything is written, a
closed table refused, ids of the wrong shape refused."""

import os

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.errors import LookupIdError, PrefetchError, SpecError, StorageError
from numa_engram.lookup.stepgather import StepGather, bind_step
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable

ROWS = 400
GUARD = 0xA5


def _engram_tables(rng, n_shards=2, shard=1):
    spec = EngramSpec.small(rows_per_head=ROWS)
    tables = []
    for layer in spec.layer_ids:
        t = SharedEngramTable.create(spec, layer,
                                     shard_heads(spec.bucket_sizes(layer), n_shards, shard))
        t.weights[:] = rng.integers(0, 0x7F, t.weights.shape, dtype=np.uint8)
        t.scales[:] = rng.integers(100, 140, t.scales.shape, dtype=np.uint8)
        tables.append(t)
    return spec, tables


def _ple_tables(rng, dtype="float8_e4m3fn"):
    spec = PLESpec(layer_ids=[3, 7], ple_embed_dim=2560, vocab_size=151_936, eos_token_id=2,
                   ngram_vocab_size_base=1000, dtype=dtype)
    tables = [SharedPLETable.create(spec, layer, mode="independent") for layer in spec.layer_ids]
    for t in tables:
        t.weights[:] = rng.integers(0, 256, t.weights.shape, dtype=np.uint8)
    return spec, tables


@pytest.fixture(scope="module")
def layers():
    rng = np.random.default_rng(11)
    spec, engram = _engram_tables(rng)
    pspec, ple = _ple_tables(rng)
    bspec, ple_bf16 = _ple_tables(rng, "bfloat16")
    yield spec, engram, pspec, ple, bspec, ple_bf16
    for t in (*engram, *ple, *ple_bf16):
        t.close()


def _engram_ids(spec, tokens, rng, dead=True):
    ids = rng.integers(0, ROWS, (tokens, spec.n_hash_cols))
    if dead and tokens > 1:
        ids[1, ::3] = -1  # DEAD ids: zero rows
    return ids


def _bf16(tokens, heads, dim):
    return torch.empty((tokens, heads, dim), dtype=torch.bfloat16)


def _bits(x):
    return x.view(torch.int16)


@pytest.mark.parametrize("tokens", [1, 3, 8, 200])
def test_a_step_equals_each_layers_own_lookup_for_both_families(layers, tokens):
    spec, engram, pspec, ple, bspec, ple_bf16 = layers
    rng = np.random.default_rng(tokens)
    pairs = [(t, _bf16(tokens, t.shard.num_heads, spec.head_dim)) for t in engram]
    pairs += [(t, _bf16(tokens, s.n_heads, s.head_dim))
              for s, ts in ((pspec, ple), (bspec, ple_bf16)) for t in ts]
    step = StepGather(pairs)
    for _ in range(3):  # the same outputs, step after step
        ids = [_engram_ids(spec, tokens, rng) for _ in engram]
        ids += [rng.integers(0, s.rows(t.layer_id), (tokens, s.n_heads))
                for s, ts in ((pspec, ple), (bspec, ple_bf16)) for t in ts]
        got = step(ids)
        assert got is step.results and len(got) == len(pairs)
        for (t, out), layer_ids, rows in zip(pairs, ids, got):
            assert rows is out
            want = t.lookup(layer_ids)
            assert torch.equal(_bits(rows), _bits(want)), t.layer_id


def test_packed_rows_and_global_ids_equal_the_tables_own(layers):
    spec, engram, *_ = layers
    rng = np.random.default_rng(2)
    tokens = 5
    pairs = []
    for t in engram:
        shape = (tokens, t.shard.num_heads, spec.head_dim)
        pairs.append((t, (torch.empty(shape, dtype=torch.uint8),
                          torch.empty((*shape[:2], spec.head_dim // spec.block),
                                      dtype=torch.uint8))))
    step = bind_step(pairs, id_format="global")
    ids = []
    for t in engram:
        bucket = _engram_ids(spec, tokens, rng)
        base = np.zeros(spec.n_hash_cols, dtype=np.int64)
        base[t.shard.head_start:t.shard.head_end] = t.id_base("global")
        ids.append(np.where(bucket >= 0, bucket + base, -1))
    got = step(ids)
    for t, layer_ids, (rows, scales) in zip(engram, ids, got):
        want_rows, want_scales = t.lookup(layer_ids, packed=True, id_format="global")
        assert torch.equal(rows, want_rows) and torch.equal(scales, want_scales)


def test_strided_and_int32_ids_are_taken_as_the_one_layer_lookup_takes_them(layers):
    spec, engram, *_ = layers
    rng = np.random.default_rng(3)
    tokens = 4
    step = StepGather([(t, _bf16(tokens, t.shard.num_heads, spec.head_dim)) for t in engram])
    wide = rng.integers(0, ROWS, (tokens, 2 * spec.n_hash_cols))
    strided = wide[:, :spec.n_hash_cols]  # tokens apart, columns adjacent
    narrow = rng.integers(0, ROWS, (tokens, spec.n_hash_cols)).astype(np.int32)
    got = step([strided, narrow])
    assert torch.equal(_bits(got[0]), _bits(engram[0].lookup(np.ascontiguousarray(strided))))
    assert torch.equal(_bits(got[1]), _bits(engram[1].lookup(narrow.astype(np.int64))))


def test_a_bad_id_in_layer_k_is_named_with_its_layer_and_the_layers_before_have_rows(layers):
    spec, engram, pspec, ple, *_ = layers
    rng = np.random.default_rng(4)
    tokens = 3
    pairs = [(t, _bf16(tokens, t.shard.num_heads, spec.head_dim)) for t in engram]
    pairs += [(t, _bf16(tokens, pspec.n_heads, pspec.head_dim)) for t in ple]
    step = StepGather(pairs)
    ids = [_engram_ids(spec, tokens, rng, dead=False) for _ in engram]
    ids += [rng.integers(0, pspec.rows(t.layer_id), (tokens, pspec.n_heads)) for t in ple]
    column = engram[1].shard.head_start + 2
    ids[1][2, column] = 10**6
    failures = engram[1].stats().bad_id_lookups
    with pytest.raises(LookupIdError) as err:
        step(ids)
    text = str(err.value)
    assert f"Engram layer {engram[1].layer_id} (step layer 1)" in text
    assert "hash id 1000000 at token 2" in text and f"column {column}" in text
    assert torch.equal(_bits(pairs[0][1]), _bits(engram[0].lookup(ids[0])))  # layer 0 ran
    assert engram[1].stats().bad_id_lookups == failures + 1  # counted as the table's own
    ids[1][2, column] = 0
    past = pspec.rows(ple[1].layer_id)  # one past the layer's rows
    ids[3][1, 5] = past
    with pytest.raises(LookupIdError, match=rf"PLE layer {ple[1].layer_id} \(step layer 3\): "
                       rf"PLE row id {past} \(position {pspec.n_heads + 5}\)"):
        step(ids)


def test_a_bad_id_is_named_after_the_table_let_go_of_the_kernel_the_step_bound(layers):
    """A table's thread setters drop its kernel (its next lookup binds a new
    one) while the step keeps the one it bound: a bad id is still named as
    one, not taken for a closed table."""
    spec, engram, *_ = layers
    t = engram[0]
    step = StepGather([(t, _bf16(2, t.shard.num_heads, spec.head_dim))])
    t.lookup_threads = t.lookup_threads  # (the table's kernel dropped)
    ids = _engram_ids(spec, 2, np.random.default_rng(10), dead=False)
    ids[1, t.shard.head_start] = 10**6
    with pytest.raises(LookupIdError, match="hash id 1000000 at token 1"):
        step([ids])


def test_ids_of_the_wrong_shape_or_count_are_refused_naming_the_layer(layers):
    spec, engram, pspec, ple, *_ = layers
    rng = np.random.default_rng(5)
    step = StepGather([(engram[0], _bf16(2, engram[0].shard.num_heads, spec.head_dim)),
                       (ple[0], _bf16(2, pspec.n_heads, pspec.head_dim))])
    good = [_engram_ids(spec, 2, rng), rng.integers(0, 100, (2, pspec.n_heads))]
    with pytest.raises(SpecError, match="3 tokens of ids for Engram layer"):
        step([_engram_ids(spec, 3, rng), good[1]])
    with pytest.raises(SpecError, match=r"PLE layer \d+ \(step layer 1\): PLE ids of shape"):
        step([good[0], rng.integers(0, 100, (1, pspec.n_heads))])
    with pytest.raises(LookupIdError, match="dtype float64"):
        step([good[0].astype(np.float64), good[1]])
    with pytest.raises(SpecError, match="1 ids arrays for a step of 2 layers"):
        step(good[:1])
    step(good)  # the step works on


def _guarded(shape, dtype=torch.bfloat16, pad=4096):
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    whole = torch.full((n + 2 * pad,), GUARD, dtype=torch.uint8)
    return whole[pad:pad + n].view(dtype).view(shape), whole, pad, n


def test_a_step_writes_its_outputs_and_nothing_around_them(layers):
    spec, engram, pspec, ple, *_ = layers
    rng = np.random.default_rng(6)
    tokens = 7
    made = [_guarded((tokens, t.shard.num_heads, spec.head_dim)) for t in engram]
    made += [_guarded((tokens, pspec.n_heads, pspec.head_dim)) for _ in ple]
    step = StepGather(list(zip([*engram, *ple], [m[0] for m in made])))
    ids = [_engram_ids(spec, tokens, rng) for _ in engram]
    ids += [rng.integers(0, 1000, (tokens, pspec.n_heads)) for _ in ple]
    step(ids)
    for _, whole, pad, n in made:
        raw = whole.numpy()
        assert (raw[:pad] == GUARD).all() and (raw[pad + n:] == GUARD).all()


def test_an_output_over_another_layers_ids_is_refused_before_any_layer_runs(layers):
    spec, engram, pspec, ple, *_ = layers
    rng = np.random.default_rng(7)
    tokens = 2
    outs = [_bf16(tokens, t.shard.num_heads, spec.head_dim) for t in engram]
    pout = _bf16(tokens, pspec.n_heads, pspec.head_dim)
    step = StepGather([*zip(engram, outs), (ple[0], pout)])
    ids = [_engram_ids(spec, tokens, rng) for _ in engram]
    ids.append(rng.integers(0, 1000, (tokens, pspec.n_heads)))
    # layer 0's ids in the bytes of the PLE layer's output, layer 1's in layer 0's
    over = pout.view(torch.int64).numpy().reshape(-1)
    moved0 = over[:ids[0].size].reshape(ids[0].shape)
    moved0[:] = ids[0]
    outs[0].view(torch.uint8).fill_(GUARD)
    with pytest.raises(SpecError, match=r"PLE layer \d+ \(step layer 2\)'s out and Engram "
                       r"layer \d+ \(step layer 0\)'s ids share bytes"):
        step([moved0, ids[1], ids[2]])
    assert (outs[0].view(torch.uint8).numpy() == GUARD).all(), "a layer ran"
    assert np.array_equal(moved0, ids[0]), "the ids were written"
    # a layer's own ids in its own output: its kernel's check
    own = outs[1].view(torch.int64).numpy().reshape(-1)[:ids[1].size].reshape(ids[1].shape)
    own[:] = ids[1]
    with pytest.raises(SpecError, match=r"Engram layer \d+ \(step layer 1\): out and the ids "
                       "share bytes"):
        step([ids[0], own, ids[2]])
    assert np.array_equal(own, ids[1])


def test_outputs_sharing_bytes_or_over_a_table_are_refused_when_bound(layers):
    spec, engram, pspec, ple, *_ = layers
    shape = (2, engram[0].shard.num_heads, spec.head_dim)
    one = torch.empty((2 * int(np.prod(shape)),), dtype=torch.bfloat16)
    with pytest.raises(SpecError, match=r"layer \d+ \(step layer 0\)'s out and .*layer \d+ "
                       r"\(step layer 1\)'s out share bytes"):
        StepGather([(engram[0], one[:int(np.prod(shape))].view(shape)),
                    (engram[1], one[int(np.prod(shape)) // 2:][:int(np.prod(shape))]
                     .view(shape))])
    # an output over another layer's table (a writable mapping: would overwrite it)
    rows = ple[0].weights.reshape(-1)[:2 * pspec.n_heads * pspec.head_dim * 2]
    over = torch.from_numpy(rows).view(torch.bfloat16).view(2, pspec.n_heads, pspec.head_dim)
    before = ple[0].weights.copy()
    with pytest.raises(SpecError, match=rf"PLE layer {ple[1].layer_id} \(step layer 2\)'s out "
                       rf"and PLE layer {ple[0].layer_id} \(step layer 1\)'s table mapping"):
        StepGather([(engram[0], _bf16(*shape)),
                    (ple[0], _bf16(2, pspec.n_heads, pspec.head_dim)), (ple[1], over)])
    assert np.array_equal(ple[0].weights, before)
    with pytest.raises(SpecError, match="at least one"):
        StepGather([])
    with pytest.raises(SpecError, match="Engram or PLE tables"):
        StepGather([(object(), _bf16(*shape))])


def test_a_closed_table_is_refused_naming_its_layer():
    rng = np.random.default_rng(8)
    spec, engram = _engram_tables(rng, 1, 0)
    pspec, ple = _ple_tables(rng)
    try:
        tokens = 2
        step = StepGather([*((t, _bf16(tokens, t.shard.num_heads, spec.head_dim))
                             for t in engram),
                           *((t, _bf16(tokens, pspec.n_heads, pspec.head_dim)) for t in ple)])
        ids = [_engram_ids(spec, tokens, rng) for _ in engram]
        ids += [rng.integers(0, 1000, (tokens, pspec.n_heads)) for _ in ple]
        step(ids)
        ple[1].close()
        with pytest.raises(StorageError, match=rf"PLE layer {ple[1].layer_id} \(step layer 3\):"
                           " the table is closed"):
            step(ids)
        engram[0].close()
        with pytest.raises(StorageError, match=rf"Engram layer {engram[0].layer_id} \(step "
                           r"layer 0\): the table is closed"):
            step(ids)
        with pytest.raises(StorageError, match="closed"):
            StepGather([(engram[0], _bf16(tokens, engram[0].shard.num_heads, spec.head_dim))])
        with pytest.raises(StorageError, match=rf"layer {ple[1].layer_id}'s table is closed"):
            StepGather([(ple[1], _bf16(tokens, pspec.n_heads, pspec.head_dim))])
    finally:
        for t in (*engram, *ple):
            t.close()


def test_two_threads_at_once_are_refused_and_a_forked_child_binds_its_own(layers):
    """The C step names the threads of its process's kernels: a forked child
    binds again (a table with lookup threads: its kernel's pool)."""
    import threading

    spec, engram, *_ = layers
    rng = np.random.default_rng(9)
    tokens = 200  # past a call's split: the workers run parts
    for t in engram:
        t.lookup_threads = 2
    try:
        step = StepGather([(t, _bf16(tokens, t.shard.num_heads, spec.head_dim))
                           for t in engram])
        ids = [_engram_ids(spec, tokens, rng) for _ in engram]
        step(ids)
        step._busy.acquire()  # another thread's call in flight
        errors = []
        worker = threading.Thread(target=lambda: _catch(errors, step, ids))
        worker.start()
        worker.join()
        step._busy.release()
        assert len(errors) == 1 and isinstance(errors[0], PrefetchError)
        pid = os.fork()
        if pid == 0:  # the child: the same step, its own kernels and threads
            code = 1
            try:  # (compared in numpy: torch's OpenMP threads hang a forked child)
                got = step(ids)
                code = 0 if all(np.array_equal(_bits(r).numpy(), _bits(t.lookup(i)).numpy())
                                for r, t, i in zip(got, engram, ids)) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert all(torch.equal(_bits(r), _bits(t.lookup(i)))
                   for r, t, i in zip(step(ids), engram, ids))
    finally:
        for t in engram:
            t.lookup_threads = 1


def _catch(errors, step, ids):
    try:
        step(ids)
    except Exception as exc:  # noqa: BLE001 (the test reads it)
        errors.append(exc)
