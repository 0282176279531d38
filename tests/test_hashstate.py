"""HashState against a plain restatement of DeepSeek V4.1's serving rule,
on hypothesis-made streams of packed prefill chunks and decode steps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_engram import EngramSpec, HashState, ngram_hashes
from numa_engram.errors import SpecError

SPEC = EngramSpec.small(rows_per_head=97, n_head_per_ngram=3, max_ngram_size=4)
MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def v41_rule(spec: EngramSpec, seq: list[int], layer: int, p: int) -> list[int]:
    """The rule as written (docs/design.md, "Hashes"), one token at a time: source
    at p-s; blocked from the first s before the start or DEAD (< 0);
    blocked tokens are pad_id; XOR of products, floor modulo per head."""
    m = [int(x) for x in spec.multipliers(layer)]
    primes = spec.bucket_sizes(layer)
    blocked, toks = False, []
    for s in range(spec.max_ngram_size):
        src = seq[p - s] if p - s >= 0 else None
        blocked = blocked or src is None or src < 0
        toks.append(spec.pad_id if blocked else src)
    out, mix = [], _signed(toks[0] * m[0])
    for n in range(2, spec.max_ngram_size + 1):
        mix = _signed(mix ^ _signed(toks[n - 1] * m[n - 1]))
        base = (n - 2) * spec.n_head_per_ngram
        out += [mix % primes[base + j] for j in range(spec.n_head_per_ngram)]
    return out


def expected(seq, p, layers=SPEC.layer_ids):
    return np.array([v41_rule(SPEC, seq, layer, p) for layer in layers])


# ------------------------------------------------------- stream model --

@st.composite
def streams(draw):
    """Requests (ids with DEAD spans), each cut into a prefill chunk and
    decode steps, some preempted and resumed in another slot, some with
    speculative (uncommitted) tokens, packed into steps in random order."""
    n_req = draw(st.integers(1, 5))
    requests = []
    for _ in range(n_req):
        length = draw(st.integers(1, 12))
        seq = draw(st.lists(st.integers(0, 60), min_size=length, max_size=length))
        for _ in range(draw(st.integers(0, 2))):  # DEAD spans (images)
            a = draw(st.integers(0, length - 1))
            b = draw(st.integers(a, min(length, a + 3)))
            seq[a:b] = [-1] * (b - a)
        cuts, p = [], 0
        first = draw(st.integers(1, length))
        cuts.append((0, first))
        p = first
        while p < length:
            step = draw(st.sampled_from([1, 1, 1, 2, 3]))
            cuts.append((p, min(length, p + step)))
            p = min(length, p + step)
        requests.append({"seq": seq, "chunks": cuts,
                         "preempt_at": draw(st.integers(0, len(cuts))),
                         "speculate": draw(st.booleans())})
    order_seed = draw(st.integers(0, 2**32 - 1))
    return requests, order_seed


def run_stream(requests, order_seed, max_requests=8, id_format="bucket"):
    """Drive HashState through the stream; check every token's row."""
    rng = np.random.default_rng(order_seed)
    state = HashState(SPEC, max_requests=max_requests)
    free = list(range(max_requests))
    rng.shuffle(free)
    live = {i: {"next_chunk": 0, "slot": None} for i in range(len(requests))}
    checked = 0
    while live:
        batch = []  # (request, position, token id, commit, expected-sequence)
        for i in list(live):
            req, st_ = requests[i], live[i]
            if st_["next_chunk"] == len(req["chunks"]):
                state.release(st_["slot"])
                free.append(st_["slot"])
                del live[i]
                continue
            a, b = req["chunks"][st_["next_chunk"]]
            if st_["slot"] is None or st_["next_chunk"] == req["preempt_at"] and a > 0:
                if st_["slot"] is not None:  # preempted: resumed in another slot
                    state.release(st_["slot"])
                    free.append(st_["slot"])
                st_["slot"] = free.pop(0)
                if a > 0:
                    state.restore(st_["slot"], a, req["seq"][:a])
            if rng.random() < 0.3:  # this request sits this step out
                continue
            spec_ids = [int(x) for x in rng.integers(0, 60, 2)] if req["speculate"] else []
            hypothetical = req["seq"][:b] + spec_ids
            for p in range(a, b):
                batch.append((i, p, req["seq"][p], True, hypothetical))
            for k, tok in enumerate(spec_ids):
                batch.append((i, b + k, tok, False, hypothetical))
            st_["next_chunk"] += 1
        if not batch:
            continue
        # interleave requests at random, each request's tokens in order
        keys = rng.random(len(batch))
        by_req = {}
        for item in batch:
            by_req.setdefault(item[0], []).append(item)
        packed, cursors = [], {r: 0 for r in by_req}
        for j in np.argsort(keys):  # a random request order, each request's tokens in order
            r = batch[j][0]
            packed.append(by_req[r][cursors[r]])
            cursors[r] += 1
        ids = [it[2] for it in packed]
        slots = [live[it[0]]["slot"] for it in packed]
        positions = [it[1] for it in packed]
        commit = np.array([it[3] for it in packed])
        out = state.hash(np.array(ids), slots, positions, commit=commit, id_format=id_format)
        for row, it in zip(out, packed):
            want = expected(it[4], it[1])
            if id_format == "global":
                want = want + np.array([SPEC.head_offsets(layer) for layer in SPEC.layer_ids])
            np.testing.assert_array_equal(row, want)
            checked += 1
    return checked


@settings(max_examples=150, deadline=None)
@given(streams())
def test_packed_streams_equal_hashing_each_whole_sequence(stream):
    requests, seed = stream
    assert run_stream(requests, seed) >= sum(len(r["seq"]) for r in requests)


@settings(max_examples=30, deadline=None)
@given(streams())
def test_global_rows_are_bucket_ids_plus_head_offsets(stream):
    requests, seed = stream
    run_stream(requests, seed, id_format="global")


def test_one_unmasked_sequence_from_zero_equals_ngram_hashes():
    ids = np.random.default_rng(0).integers(0, 1000, 300)
    state = HashState(SPEC, max_requests=1)
    out = state.hash(ids, np.zeros(300, int), np.arange(300), threads=2)
    g = HashState(SPEC, max_requests=1).hash(ids, np.zeros(300, int), np.arange(300),
                                             id_format="global")
    for i, layer in enumerate(SPEC.layer_ids):
        np.testing.assert_array_equal(out[:, i], ngram_hashes(SPEC, ids, layer))
        np.testing.assert_array_equal(g[:, i], ngram_hashes(SPEC, ids, layer)
                                      + SPEC.head_offsets(layer))


def test_decode_steps_continue_the_prefill():
    seq = [5, 9, 2, 7, 7, 1]
    state = HashState(SPEC, max_requests=2)
    state.hash(np.array(seq[:4]), [1] * 4, [0, 1, 2, 3])
    for p in (4, 5):
        row = state.hash(np.array([seq[p]]), [1], [p])[0]
        np.testing.assert_array_equal(row, expected(seq, p))
    assert state.next_position(1) == 6 and state.next_position(0) == 0


def test_uncommitted_tokens_leave_the_history_as_it_was():
    state = HashState(SPEC, max_requests=1)
    state.hash(np.array([1, 2, 3]), [0, 0, 0], [0, 1, 2])
    state.hash(np.array([40, 41]), [0, 0], [3, 4], commit=False)
    assert state.next_position(0) == 3
    row = state.hash(np.array([4]), [0], [3])[0]
    np.testing.assert_array_equal(row, expected([1, 2, 3, 4], 3))


def test_token_map_dead_ids_and_mask_make_dead_tokens():
    token_map = np.array([0, 3, 3, 7, -1, 9])
    state = HashState(SPEC, max_requests=1, token_map=token_map, dead_ids=[5])
    ids = np.array([1, 2, 4, 3, 99, 5, 3, -2, 1])
    mask = np.ones(len(ids), bool)
    mask[-1] = False
    out = state.hash(ids, np.zeros(len(ids), int), np.arange(len(ids)), token_mask=mask)
    seq = [3, 3, -1, 7, -1, -1, 7, -1, -1]
    for p in range(len(ids)):
        np.testing.assert_array_equal(out[p], expected(seq, p))


@pytest.mark.parametrize("slots, positions, text", [
    ([0, 0], [0, 2], "token 1: slot 0 position 2 does not continue its sequence (a gap: "
                     "expected 1"),
    ([0, 0], [0, 0], None),  # position 0 restarts: allowed
    ([0, 1], [0, 3], "token 1: slot 1 position 3 does not continue its sequence (a gap"),
    ([0, 4], [0, 0], "token 1: slot 4 is outside 0..3"),
])
def test_misuse_names_the_token(slots, positions, text):
    state = HashState(SPEC, max_requests=4)
    if text is None:
        state.hash(np.array([1, 2]), slots, positions)
        return
    with pytest.raises(SpecError, match=text.replace("(", r"\(").replace(")", r"\)")):
        state.hash(np.array([1, 2]), slots, positions)
    assert state.next_position(0) == 0, "a refused call changes nothing"


def test_replay_and_shape_errors():
    state = HashState(SPEC, max_requests=2)
    state.hash(np.array([1, 2, 3]), [0, 0, 0], [0, 1, 2])
    with pytest.raises(SpecError, match="a replay: expected 3"):
        state.hash(np.array([9]), [0], [1])
    with pytest.raises(SpecError, match="slots has shape"):
        state.hash(np.array([1, 2]), [0], [3, 4])
    with pytest.raises(SpecError, match="commit must be"):
        state.hash(np.array([4]), [0], [3], commit=[1])
    with pytest.raises(SpecError, match="restore"):
        state.restore(1, 5, [1, 2])
    state.restore(1, 5, [1, 2, 3, 4, 5])
    row = state.hash(np.array([6]), [1], [5])[0]
    np.testing.assert_array_equal(row, expected([1, 2, 3, 4, 5, 6], 5))


@pytest.mark.parametrize("call, text", [
    (lambda s: s.hash([1, 2, 3], [0.9, 0.9, 1.7], [0, 1, 0]), "slots must be integers"),
    (lambda s: s.hash([1, 2], [0, 0], [0.0, 1.99]), "positions must be integers"),
    (lambda s: s.hash([1, 2], [0, 0], np.array([0, np.nan])), "positions must be integers"),
    (lambda s: s.hash([1, 2], [True, True], [0, 1]), "slots must be integers"),
    (lambda s: s.restore(0, 2, [1.7, 2.2]), "prefix_ids must be integers"),
    (lambda s: s.restore(0, 2.0, [1, 2]), "position must be an integer, got float"),
    (lambda s: s.release(1.5), "slot must be an integer, got float 1.5"),
    (lambda s: s.hash([1], [0], [2**63 - 1]), "positions must be in 0..4611686018427387904"),
    (lambda s: s.restore(0, 2**63 - 1, [1, 2, 3]), "restore position must be in 0.."),
    (lambda s: s.hash([1], [0], np.array([2**64 - 1], dtype=np.uint64)), "beyond int64"),
    (lambda s: s.hash([1], [0], [-1]), "positions must be in 0.."),
])
def test_floats_nan_and_wrapping_positions_are_refused_never_truncated(call, text):
    state = HashState(SPEC, max_requests=4)
    before = (state._hist.copy(), state._next.copy())
    with pytest.raises(SpecError, match=text.replace("(", r"\(").replace(")", r"\)")):
        call(state)
    np.testing.assert_array_equal(state._hist, before[0])  # nothing half-done
    np.testing.assert_array_equal(state._next, before[1])


def test_integer_inputs_of_any_integer_kind_still_work():
    state = HashState(SPEC, max_requests=4)
    a = state.hash(np.array([5, 6], np.int32), np.array([1, 1], np.uint8), [0, 1])
    state.release(np.int64(1))
    b = state.hash([5, 6], [1, 1], np.array([0, 1], np.int16))
    np.testing.assert_array_equal(a, b)
    state.restore(2, 3, np.array([4, 5, 6], np.int32))
    assert state.next_position(2) == 3


@pytest.mark.parametrize("dead", [[], [5], list(range(0, 300, 7))])
def test_the_kernels_token_map_and_dead_ids_equal_compressed(dead):
    """hash() maps tokens in the kernel (one call a step); the same rule as
    compressed(): hashing compressed() ids in a state without a map gives
    the same hashes, for ids inside and outside the map, negative ones,
    masked ones and many dead ids (a binary search)."""
    rng = np.random.default_rng(len(dead))
    token_map = rng.integers(-1, 99, 300)  # some map to DEAD
    mapped = HashState(SPEC, max_requests=4, token_map=token_map, dead_ids=dead)
    plain = HashState(SPEC, max_requests=4)
    ids = rng.integers(-5, 320, 200)
    mask = rng.random(200) > 0.1
    slots = np.repeat(np.arange(4), 50)
    positions = np.tile(np.arange(50), 4)
    got = mapped.hash(ids, slots, positions, token_mask=mask)
    want = plain.hash(mapped.compressed(ids, mask), slots, positions)
    np.testing.assert_array_equal(got, want)


def test_hash_reuses_its_last_result_only_once_nothing_refers_to_it():
    """hash() hands its last array out again only when the caller dropped
    it and every view of it: a kept result, a numpy view of it, a tensor
    made from it or a memoryview keeps its values, whatever later calls
    hash; a dropped one is reused (no allocation per decode step)."""
    import torch

    spec = EngramSpec.small()
    state = HashState(spec, max_requests=4)
    slots = np.arange(4, dtype=np.int64)

    def step(position, tokens):
        return state.hash(np.asarray(tokens, np.int64), slots, np.full(4, position, np.int64),
                          commit=False)
    want = step(0, [5, 6, 7, 8]).copy()
    holders = {"array": lambda a: a, "view": lambda a: a[1:], "tensor": torch.from_numpy,
               "memoryview": memoryview}
    for name, hold in holders.items():
        result = step(0, [5, 6, 7, 8])
        held = hold(result)
        del result  # only the holder refers to it now
        for _ in range(3):
            other = step(0, [9, 10, 11, 12])
            assert not np.shares_memory(other, want) and not np.array_equal(other, want)
        kept = np.asarray(held)
        assert np.array_equal(kept, want[1:] if name == "view" else want), name
        del kept, held, other
    address = step(0, [1, 2, 3, 4]).ctypes.data  # dropped at once
    again = step(0, [5, 6, 7, 8])
    assert again.ctypes.data == address and np.array_equal(again, want)
