"""PrefetchScheduler contract on the CPU backend (worker thread + events)."""

import sys
import threading
import time

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint
from numa_engram.errors import LookupIdError
from numa_engram.lookup.prefetch import PrefetchError, PrefetchScheduler
from numa_engram.model.hashing import ngram_hashes


class Recorder:
    """A lookup that sleeps, records its order and fills rows with its layer id."""

    def __init__(self, layer, log, delay=0.0, fail=False, gate=None):
        self.layer, self.log, self.delay, self.fail, self.gate = layer, log, delay, fail, gate

    def __call__(self, ids, out):
        if self.gate is not None:
            self.gate.wait()
        time.sleep(self.delay)
        self.log.append(self.layer)
        if self.fail:
            raise ValueError(f"lookup of layer {self.layer} failed")
        out.fill_(self.layer)
        return out


def _sched(lookups, depth=4, max_tokens=8):
    return PrefetchScheduler(lookups, {k: (2, 4) for k in lookups}, max_tokens=max_tokens,
                             depth=depth)


def _ids(n=4):
    return np.zeros((n, 2), np.int64)


def _until_a_short_lead(sched, layer, ids, tries=100):
    """submit + wait at once until the layer's last lead is shorter than a
    hand-off: its first lookup goes to the worker (no lead known yet), and
    on a loaded machine that wait may come late."""
    for _ in range(tries):
        if not sched.metrics[layer].ahead_pays():
            return
        sched.submit(layer, ids)
        sched.wait(layer)
    raise AssertionError(f"no lead shorter than a hand-off in {tries} steps")


def test_fifo_order_across_layers_and_each_wait_returns_its_own_rows():
    log = []
    with _sched({k: Recorder(k, log, 0.01) for k in (1, 2, 3)}) as s:
        for k in (3, 1, 2):
            s.submit(k, _ids())
        assert (s.wait(1) == 1).all() and (s.wait(2) == 2).all() and (s.wait(3) == 3).all()
    assert log == [3, 1, 2]


def test_wait_blocks_only_until_its_own_layer():
    gate = threading.Event()
    log = []
    with _sched({1: Recorder(1, log), 2: Recorder(2, log, gate=gate)}) as s:
        s.submit(1, _ids())
        s.submit(2, _ids())
        t0 = time.perf_counter()
        s.wait(1)  # layer 2 is still blocked behind the gate (waiting on it: forever)
        assert time.perf_counter() - t0 < 30.0
        gate.set()
        assert (s.wait(2) == 2).all()


def test_error_in_layer_2_is_raised_by_wait_2_only():
    log = []
    with _sched({1: Recorder(1, log), 2: Recorder(2, log, fail=True),
                 3: Recorder(3, log)}) as s:
        for k in (1, 2, 3):
            s.submit(k, _ids())
        s.wait(1)
        s.wait(3)
        with pytest.raises(ValueError, match="layer 2 failed"):
            s.wait(2)
        s.submit(2, _ids())  # the layer is usable again next step
        with pytest.raises(ValueError):
            s.wait(2)


def test_bounded_depth_blocks_the_submitter():
    gate = threading.Event()
    log = []
    s = _sched({k: Recorder(k, log, gate=gate) for k in (1, 2, 3)}, depth=2)
    s.submit(1, _ids())
    s.submit(2, _ids())
    third = threading.Thread(target=s.submit, args=(3, _ids()))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third submit must block at depth 2"
    gate.set()
    s.wait(1)
    third.join(5)
    assert not third.is_alive()
    s.wait(2)
    s.wait(3)
    s.close()


def test_reset_cancels_pending_and_staging_buffers_are_reused():
    gate = threading.Event()
    log = []
    s = _sched({1: Recorder(1, log, gate=gate), 2: Recorder(2, log)})
    buf = s.staging[1].data_ptr()
    s.submit(1, _ids())
    s.submit(2, _ids())
    gate.set()
    s.reset()
    with pytest.raises(PrefetchError, match="without a submit"):
        s.wait(2)
    s.submit(1, _ids(3))
    out = s.wait(1)
    assert out.data_ptr() == buf and out.shape == (3, 2, 4)
    s.close()
    with pytest.raises(PrefetchError, match="closed"):
        s.submit(1, _ids())


def test_misuse_errors():
    with _sched({1: Recorder(1, [])}) as s:
        with pytest.raises(PrefetchError, match="exceed max_tokens"):
            s.submit(1, _ids(9))
        with pytest.raises(PrefetchError, match="has no lookup"):
            s.submit(7, _ids())
        s.submit(1, _ids())
        with pytest.raises(PrefetchError, match="already has a lookup in flight"):
            s.submit(1, _ids())
        s.wait(1)


@pytest.mark.parametrize("lookup_s, lead_s", [(0.20, 0.05), (0.05, 0.20)])
def test_exposed_wait_is_lookup_minus_lead(lookup_s, lead_s):
    with _sched({1: Recorder(1, [], lookup_s)}) as s:
        s.submit(1, _ids())
        time.sleep(lead_s)  # the layers before this one compute
        s.wait(1)
        m = s.stats()[1]
    expected = max(0.0, lookup_s - lead_s)
    assert abs(m.exposed_wait_seconds - expected) < 0.08, (m, expected)
    assert m.lookup_seconds >= lookup_s * 0.9 and m.lead_seconds >= lead_s * 0.9


@pytest.mark.parametrize("packed", [False, True])
def test_with_real_tables(tmp_path, packed):
    from numa_engram.model.fp8 import dequantize_rows

    spec = EngramSpec.small()
    ckpt = str(write_synthetic_checkpoint(tmp_path / "c.safetensors", spec))
    tables = {layer: SharedEngramTable.create(spec, layer,
                                              shard_heads(spec.bucket_sizes(layer), 1, 0),
                                              checkpoint=ckpt) for layer in spec.layer_ids}
    shapes = {layer: (spec.n_hash_cols, spec.head_dim) for layer in spec.layer_ids}
    tokens = np.random.default_rng(0).integers(0, 1000, 50)
    with PrefetchScheduler(tables, shapes, max_tokens=64, packed=packed) as s:
        for layer in spec.layer_ids:
            s.submit(layer, ngram_hashes(spec, tokens, layer))
        for layer in spec.layer_ids:
            got = s.wait(layer)
            want = tables[layer].lookup(ngram_hashes(spec, tokens, layer))
            if packed:  # the rows as stored; dequantised after the copy, the same bits
                rows, scales = got
                assert rows.dtype == torch.uint8 and rows.shape == (50, *shapes[layer])
                got = dequantize_rows(rows, scales, block=spec.block)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for t in tables.values():
        t.close()


def test_packed_staging_needs_tables_on_the_cpu_backend():
    with pytest.raises(PrefetchError, match="needs tables"):
        PrefetchScheduler({1: lambda ids, out: out}, {1: (1, 32)}, max_tokens=1, packed=True)
    with pytest.raises(PrefetchError, match="lookup_cuda"):
        PrefetchScheduler({}, {}, max_tokens=1, backend="cuda", packed=True)


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


def test_a_lookup_waited_for_at_once_runs_on_the_waiting_thread():
    """No hand-off for a small step waited for at once: after the first
    lookup (which goes to the worker: nothing is known yet) the lead is
    shorter than the lookup, so every later one runs on the waiter."""
    from numa_engram.lookup.prefetchmetrics import HANDOFF_S

    threads, short = [], []

    def where(ids, out):
        threads.append(threading.current_thread())
        time.sleep(0.001)  # a lookup longer than the submit -> wait gap
        return out.fill_(1)
    with _sched({1: where}) as sched:
        for _ in range(50):
            # (what the scheduler decides by: the last lead it measured; a
            # busy machine can stretch one past a hand-off, and that one's
            # next lookup may go ahead)
            short.append(sched.metrics[1].last_lead_s < HANDOFF_S)
            sched.submit(1, _ids())
            assert bool((sched.wait(1) == 1).all())
    waiter = threading.current_thread()
    assert len(threads) == 50 and not short[0] and sum(short) >= 40
    assert all(t is waiter for t, s in zip(threads, short) if s)


def test_a_lookup_with_a_long_lead_runs_ahead_on_the_worker():
    """A layer whose waits come long after its submits keeps its lookups on
    the worker (they are done when waited for: nothing exposed)."""
    threads = []

    def where(ids, out):
        threads.append(threading.current_thread())
        return out.fill_(1)
    with _sched({1: where}) as sched:
        for _ in range(5):
            sched.submit(1, _ids())
            time.sleep(0.05)  # the layers before it compute
            assert bool((sched.wait(1) == 1).all())
    assert len(threads) == 5 and threading.current_thread() not in threads


def test_a_long_lookup_goes_ahead_with_any_lead_longer_than_a_hand_off_only():
    """A long lookup (a prefill chunk) waited for at once runs on the
    waiter too (the hand-off would only add to it); with a lead longer than
    a hand-off costs, though shorter than the lookup, it runs ahead."""
    from numa_engram.lookup.prefetchmetrics import HANDOFF_S

    threads, short = [], []

    def where(ids, out):
        threads.append(threading.current_thread())
        time.sleep(8 * HANDOFF_S)  # longer than any lead below
        return out.fill_(1)
    waiter = threading.current_thread()
    with _sched({1: where}) as sched:
        for _ in range(6):  # waited for at once
            # (the last lead as the scheduler measured it: see above)
            short.append(sched.metrics[1].last_lead_s < HANDOFF_S)
            sched.submit(1, _ids())
            assert bool((sched.wait(1) == 1).all())
        assert sum(short) >= 3 and all(t is waiter for t, s in zip(threads, short) if s)
        del threads[:]
        for _ in range(4):  # a lead of 4 hand-offs: half the lookup hidden
            sched.submit(1, _ids())
            time.sleep(4 * HANDOFF_S)
            assert bool((sched.wait(1) == 1).all())
    assert len(threads) == 4 and all(t is not waiter for t in threads[1:])


def test_lookups_left_to_their_waiters_still_finish_on_reset_and_timed_waits():
    """A small lookup no worker was told about: reset() drains it, and a
    wait with a timeout (which runs nothing itself) hands it to the worker."""
    log = []
    with _sched({1: Recorder(1, log, 0.002), 2: Recorder(2, log, 0.002)}) as sched:
        for _ in range(3):  # waits at once: the layer's lookups go to its waiter
            sched.submit(1, _ids())
            sched.wait(1)
        sched.submit(1, _ids())
        sched.reset()  # must not hang on the queued lookup
        sched.submit(1, _ids())
        assert bool((sched.wait(1, timeout_s=10) == 1).all())
        sched.submit(1, _ids())
        sched.submit(2, _ids())
        assert bool((sched.wait(2) == 2).all()) and bool((sched.wait(1) == 1).all())
    assert log[-2:] == [1, 2]


def test_a_waiter_never_runs_its_lookup_ahead_of_an_earlier_one():
    """Layer 2 waited for while layer 1 runs: layer 2 starts only after it."""
    log, gate = [], threading.Event()
    with _sched({1: Recorder(1, log, gate=gate), 2: Recorder(2, log)}) as sched:
        sched.submit(1, _ids())
        sched.submit(2, _ids())
        got = {}
        waiter = threading.Thread(target=lambda: got.setdefault(2, sched.wait(2)))
        waiter.start()
        time.sleep(0.1)
        assert log == [] and waiter.is_alive()  # layer 1 holds the line
        gate.set()
        waiter.join(10)
        assert log == [1, 2] and bool((got[2] == 2).all())
        assert bool((sched.wait(1) == 1).all())


def test_a_fast_lookup_with_a_lead_shorter_than_a_hand_off_stays_on_the_waiter():
    """A lead longer than the lookup but shorter than a hand-off hides
    nothing (the worker is still waking when the wait comes): the lookup
    runs on the waiter, not ahead."""
    from numa_engram.lookup.prefetchmetrics import HANDOFF_S

    threads, short = [], []

    def where(ids, out):
        threads.append(threading.current_thread())
        return out.fill_(1)  # a few us: shorter than the lead below
    waiter = threading.current_thread()
    with _sched({1: where}) as sched:
        for _ in range(20):
            # (the last lead as the scheduler measured it: see above)
            short.append(sched.metrics[1].last_lead_s < HANDOFF_S)
            sched.submit(1, _ids())
            until = time.perf_counter() + HANDOFF_S / 5
            while time.perf_counter() < until:  # the layers before it compute
                pass
            assert bool((sched.wait(1) == 1).all())
    assert len(threads) == 20 and sum(short) >= 15
    assert all(t is waiter for t, s in zip(threads, short) if s)


def test_a_lookup_run_by_its_waiter_frees_its_layer_and_slot_on_success_and_on_error():
    """The waiter that runs its own lookup marks it done and frees the layer
    and its depth slot in one step: with depth 1 every next submit must find
    the slot free at once (else it blocks), after a failed lookup too, and
    each lookup is counted once."""
    fail = [False]

    def lookup(ids, out):
        if fail[0]:
            raise ValueError("bad step")
        return out.fill_(int(ids[0, 0]))
    with _sched({1: lookup}, depth=1) as sched:
        sched.submit(1, _ids())
        sched.wait(1)  # the first goes to the worker; the rest run on this thread
        for step in range(1, 200):
            fail[0] = step % 7 == 0
            sched.submit(1, np.full((4, 2), step, np.int64))  # blocks if the slot were held
            if fail[0]:
                with pytest.raises(ValueError, match="bad step"):
                    sched.wait(1)
            else:
                assert bool((sched.wait(1) == step).all())
        assert sched._outstanding == 0 and not sched._inflight
        stats = sched.stats()[1]
        assert stats.lookups == 200 and stats.errors == len(range(7, 200, 7))
        with pytest.raises(PrefetchError, match="without a submit"):
            sched.wait(1)


@pytest.fixture
def small_table(tmp_path):
    spec = EngramSpec.small()
    ckpt = str(write_synthetic_checkpoint(tmp_path / "c.safetensors", spec))
    layer = spec.layer_ids[0]
    with SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                  checkpoint=ckpt) as table:
        yield spec, layer, table


def test_a_tables_lookup_waited_for_at_once_runs_in_its_submit(small_table):
    """A table's lookup whose wait comes at once, with nothing queued or
    running, runs in its submit (its rows are staged when submit returns;
    the wait only collects them): bit-exact with a direct lookup, a bad id
    raised by the wait (not the submit) and counted once, reset drops it
    and frees its slot; behind a lookup the worker still runs it waits its
    turn (FIFO) instead."""
    spec, layer, table = small_table
    rng = np.random.default_rng(0)
    steps = [ngram_hashes(spec, rng.integers(0, 1000, 6), layer) for _ in range(5)]
    gate, log = threading.Event(), []
    with PrefetchScheduler({layer: table, 99: Recorder(99, log, gate=gate)},
                           {layer: (spec.n_hash_cols, spec.head_dim),
                            99: (spec.n_hash_cols, spec.head_dim)}, max_tokens=6) as sched:
        staged = sched.staging[layer].view(torch.int16)
        for ids in steps[1:]:
            want = table.lookup(ids).view(torch.int16)
            # (a lead is the time from a submit to its wait: on a loaded
            # host the checks between them may outlast a hand-off)
            _until_a_short_lead(sched, layer, steps[0])
            staged.zero_()
            sched.submit(layer, ids)
            assert torch.equal(staged, want)  # done before its wait
            assert torch.equal(sched.wait(layer).view(torch.int16), want)

        bad = steps[1].copy()
        bad[2, 1] = 10**12
        sched.submit(layer, bad)  # refused rows are the wait's error, not the submit's
        with pytest.raises(LookupIdError):
            sched.wait(layer)
        assert sched.stats()[layer].errors == 1

        sched.submit(layer, steps[2])
        sched.reset()  # done, not waited for: dropped, its slot free
        assert sched._outstanding == 0 and not sched._inflight
        with pytest.raises(PrefetchError, match="without a submit"):
            sched.wait(layer)

        sched.submit(99, _ids(6))  # goes to the worker and blocks there
        while not sched._running:
            time.sleep(0.001)
        staged.zero_()
        sched.submit(layer, steps[3])  # behind it: not run now, nor ahead of it
        assert not staged.any()
        gate.set()
        assert bool((sched.wait(99) == 99).all())
        assert torch.equal(sched.wait(layer).view(torch.int16),
                           table.lookup(steps[3]).view(torch.int16))


def test_a_tables_lookup_longer_than_a_hand_off_stays_in_its_submit(small_table, monkeypatch):
    """A lookup run in its submit is not a lead: one that takes longer than
    a hand-off, waited for at once, runs in its submit step after step (the
    lead counted from the submit's call sent every other one to the worker,
    and its wait paid two wake-ups: 256-token steps 1.26-1.42x a direct
    lookup)."""
    from numa_engram.lookup.prefetchmetrics import HANDOFF_S

    spec, layer, table = small_table
    where, bind = [], table.rows.bind_lookup

    def slow_bind(out, **kw):
        run = bind(out, **kw)

        def slow(ids):
            where.append(threading.current_thread())
            time.sleep(2 * HANDOFF_S)
            return run(ids)
        return slow

    monkeypatch.setattr(table.rows, "bind_lookup", slow_bind)
    ids = ngram_hashes(spec, np.arange(6), layer)
    want = table.lookup(ids).view(torch.int16)
    with PrefetchScheduler({layer: table}, {layer: (spec.n_hash_cols, spec.head_dim)},
                           max_tokens=6) as sched:
        sched.submit(layer, ids)
        assert torch.equal(sched.wait(layer).view(torch.int16), want)
        assert where[0] is not threading.current_thread()  # the first: no lead known yet
        _until_a_short_lead(sched, layer, ids)
        where.clear()
        before, short = sched.stats()[layer], []
        for _ in range(8):
            # (the last lead as the scheduler measured it: a preempted one
            # rightly sends the next lookup ahead)
            short.append(sched.metrics[layer].last_lead_s < HANDOFF_S)
            sched.submit(layer, ids)
            assert torch.equal(sched.wait(layer).view(torch.int16), want)
        stats = sched.stats()[layer]
    here = threading.current_thread()
    assert len(where) == 8 and sum(short) >= 6, (where, short)
    assert all(t is here for t, s in zip(where, short) if s), where
    assert stats.lookups - before.lookups == 8
    assert stats.lead_seconds - before.lead_seconds >= 8 * 2 * HANDOFF_S  # (submit -> wait)


def test_wait_reads_the_device_error_record_only_when_asked(small_table, monkeypatch):
    """``wait(check_errors=True)`` reads the source's device record, on the
    worker's path (the first lookup: no lead known yet) and on a done job's
    (run at its submit) alike; what that raises is the wait's, and the layer
    takes its next submit; a plain wait never reads it."""
    spec, layer, table = small_table
    reads, fail = [], [False]

    def check_device_errors() -> None:
        reads.append(1)
        if fail[0]:
            raise LookupIdError("bad ids on the device")

    monkeypatch.setattr(table.rows, "check_device_errors", check_device_errors)
    ids = ngram_hashes(spec, np.arange(6), layer)
    want = table.lookup(ids).view(torch.int16)
    with PrefetchScheduler({layer: table}, {layer: (spec.n_hash_cols, spec.head_dim)},
                           max_tokens=6) as sched:
        for step in range(4):  # step 0 is the worker's, the others run at submit
            sched.submit(layer, ids)
            rows = sched.wait(layer, check_errors=step % 2 == 0)
            assert torch.equal(rows.view(torch.int16), want)
        assert len(reads) == 2
        fail[0] = True
        sched.submit(layer, ids)
        with pytest.raises(LookupIdError, match="on the device"):
            sched.wait(layer, check_errors=True)
        sched.submit(layer, ids)  # the layer is free again
        assert torch.equal(sched.wait(layer).view(torch.int16), want)
    assert len(reads) == 3


def test_a_decode_step_allocates_nothing_and_keeps_no_ids_alive(small_table):
    """No allocation per step on the CPU: a table's lookup waited for at
    once (after the first, the worker's) needs no job at all, only its
    layer's lane (after a failed lookup too); one that goes through a job (a
    callable's, run by its waiter) reuses the job its last wait collected;
    once waited for, the scheduler keeps no reference to the step's ids; a
    job dropped by reset is never reused (reset may still hold it)."""
    import gc
    import weakref

    spec, layer, table = small_table
    rng = np.random.default_rng(1)
    with PrefetchScheduler({layer: table}, {layer: (spec.n_hash_cols, spec.head_dim)},
                           max_tokens=6) as sched:
        warm = ngram_hashes(spec, np.arange(6), layer)
        for step in range(6):
            ids = ngram_hashes(spec, rng.integers(0, 1000, 6), layer)
            if step == 3:
                ids[0, 0] = 10**12
            # each step from a short lead: the last step's checks between its
            # submit and wait may be preempted on a loaded host, and a long
            # lead rightly sends the next lookup to the worker
            _until_a_short_lead(sched, layer, warm)
            counted = sched.stats()[layer].lookups
            sched.submit(layer, ids)
            assert not sched._inflight and layer in sched._ran  # done, no job
            if step == 3:
                with pytest.raises(LookupIdError):
                    sched.wait(layer)
            else:
                assert torch.equal(sched.wait(layer).view(torch.int16),
                                   table.lookup(ids).view(torch.int16))
            assert not sched._ran and sched._outstanding == 0
            assert sched.stats()[layer].lookups - counted == 1
            gone = weakref.ref(ids)
            del ids
            gc.collect()
            assert gone() is None  # the step's ids are the caller's alone again
        assert sched.stats()[layer].errors == 1

    def lookup(ids, out):
        if ids[0, 0] < 0:
            raise ValueError("bad step")
        return out.fill_(int(ids[0, 0]))
    with _sched({1: lookup}) as sched:
        seen = set()
        for step in range(6):
            ids = np.full((4, 2), -1 if step == 3 else step, np.int64)
            sched.submit(1, ids)
            seen.add(id(sched._inflight[1]))
            if step == 3:
                with pytest.raises(ValueError, match="bad step"):
                    sched.wait(1)
            else:
                assert bool((sched.wait(1) == step).all())
            gone = weakref.ref(ids)
            del ids
            gc.collect()
            assert gone() is None
        assert len(seen) == 1  # one job for all six steps

        sched.submit(1, _ids())
        dropped = sched._inflight[1]
        sched.reset()
        sched.submit(1, np.full((4, 2), 7, np.int64))
        assert sched._inflight[1] is not dropped
        assert bool((sched.wait(1) == 7).all())


def test_a_lookup_run_in_its_submit_holds_its_layer_and_a_slot_until_its_wait(small_table):
    """A table's lookup that ran in its submit (no job: its layer's lane)
    is in flight until its wait like any other: a second submit of the layer
    raises, with depth 1 another layer's submit waits for that wait, and
    reset() and close() drop it (its wait then raises)."""
    spec, layer, table = small_table
    ids = ngram_hashes(spec, np.arange(6), layer)
    want = table.lookup(ids).view(torch.int16)
    shape = (spec.n_hash_cols, spec.head_dim)
    with PrefetchScheduler({1: table, 2: table}, {1: shape, 2: shape}, max_tokens=6,
                           depth=1) as sched:
        for lay in (1, 2):
            _until_a_short_lead(sched, lay, ids)
        sched.submit(1, ids)
        assert list(sched._ran) == [1] and sched._outstanding == 0  # (its slot: _ran's)
        with pytest.raises(PrefetchError, match="already has a lookup in flight"):
            sched.submit(1, ids)
        claimed = threading.Event()

        def second():
            sched.submit(2, ids)
            claimed.set()
        other = threading.Thread(target=second)
        other.start()
        assert not claimed.wait(0.2)  # no slot: layer 1 holds the only one
        assert torch.equal(sched.wait(1).view(torch.int16), want)
        assert claimed.wait(10)
        other.join()
        assert torch.equal(sched.wait(2).view(torch.int16), want)

        _until_a_short_lead(sched, 1, ids)  # (its last wait came 0.2 s late: a lead)
        sched.submit(1, ids)
        assert 1 in sched._ran
        sched.reset()
        assert not sched._ran and sched._outstanding == 0
        with pytest.raises(PrefetchError, match="without a submit"):
            sched.wait(1)
        sched.submit(1, ids)
        assert 1 in sched._ran
        sched.close()
        assert sched._outstanding == 0 and not sched._ran
        with pytest.raises(PrefetchError, match="closed"):
            sched.wait(1)
        with pytest.raises(PrefetchError, match="closed"):
            sched.submit(2, ids)


def test_threads_stepping_their_own_layers_through_fewer_slots_get_their_own_rows(small_table):
    """Four threads, each submitting and waiting for its own layer (one
    table) step after step through two slots: lookups run in their submit,
    on the worker or on their waiter as the slots and leads allow, and
    every wait returns its own step's rows, bit-exact; every lookup is
    counted once and no slot is left held."""
    spec, layer, table = small_table
    shape = (spec.n_hash_cols, spec.head_dim)
    layers = (1, 2, 3, 4)
    rng = np.random.default_rng(5)
    steps = [ngram_hashes(spec, rng.integers(0, 1000, 6), layer) for _ in range(8)]
    wants = [table.lookup(ids).view(torch.int16).clone() for ids in steps]
    failures: list = []
    with PrefetchScheduler({k: table for k in layers}, {k: shape for k in layers},
                           max_tokens=6, depth=2) as sched:
        def stepper(lay: int) -> None:
            try:
                for i in range(200):
                    k = (i * lay) % len(steps)
                    sched.submit(lay, steps[k])
                    if i % 17 == 0:
                        time.sleep(0.001)  # a lead now and then: the worker's turn
                    got = sched.wait(lay).view(torch.int16)
                    if not torch.equal(got, wants[k]):
                        failures.append((lay, i))
            except BaseException as exc:  # (reported below)
                failures.append((lay, exc))
        threads = [threading.Thread(target=stepper, args=(k,)) for k in layers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures[:5]
        assert sched._outstanding == 0 and not sched._inflight
        assert not sched._ran and sched._outstanding == 0
        assert all(s.lookups == 200 and s.errors == 0 for s in sched.stats().values())



def test_waits_racing_resets_each_get_their_own_rows_or_a_clear_error(small_table):
    """A lookup run in its submit is taken by its wait without the lock:
    with another thread resetting all the while (and the threads switching
    between any two bytecodes), each wait gets its own step's outcome (a
    good step's rows bit-exact, a bad step's LookupIdError) or
    PrefetchError (its lookup was dropped), never another step's (a
    dropped bad step's error surfacing later); no record and no slot is
    left behind, and the scheduler keeps stepping."""
    spec, layer, table = small_table
    shape = (spec.n_hash_cols, spec.head_dim)
    rng = np.random.default_rng(9)
    steps = [ngram_hashes(spec, rng.integers(0, 1000, 6), layer) for _ in range(5)]
    wants = [table.lookup(ids).view(torch.int16).clone() for ids in steps]
    bad = steps[2].copy()
    bad[0, 0] = 10**12
    steps[2], wants[2] = bad, None  # (its wait raises LookupIdError)
    outcomes = {"rows": 0, "bad ids": 0, "dropped": 0}
    wrong: list = []
    stop = threading.Event()
    with PrefetchScheduler({1: table, 2: table}, {1: shape, 2: shape}, max_tokens=6,
                           depth=1) as sched:
        _until_a_short_lead(sched, 1, steps[0])

        def resetter() -> None:
            while not stop.is_set():
                sched.reset()
                time.sleep(0)
        other = threading.Thread(target=resetter)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the threads interleave between any two bytecodes
        other.start()
        try:
            for i in range(20000):
                if outcomes["dropped"] >= 20 and outcomes["rows"] >= 200:
                    break
                k = i % len(steps)
                try:
                    sched.submit(1, steps[k])
                    _busy(2e-5)  # (a short lead: a reset may come in between)
                    got = sched.wait(1).view(torch.int16)
                except PrefetchError:
                    outcomes["dropped"] += 1
                    continue
                except LookupIdError:
                    outcomes["bad ids"] += 1
                    if wants[k] is not None:
                        wrong.append((i, "a bad id raised for a good step"))
                    continue
                outcomes["rows"] += 1
                if wants[k] is None or not torch.equal(got, wants[k]):
                    wrong.append((i, "rows"))
        finally:
            stop.set()
            other.join(10)
            sys.setswitchinterval(switch)
        assert not wrong, wrong[:5]
        assert min(outcomes.values()) > 0, outcomes
        assert not sched._ran and sched._outstanding == 0 and not sched._inflight
        other = threading.Thread(target=sched.submit, args=(2, steps[1]))
        other.start()  # (depth 1: blocks for good if a slot were left held)
        other.join(10)
        assert not other.is_alive()
        assert torch.equal(sched.wait(2).view(torch.int16), wants[1])


def test_stats_count_every_decode_step_once_while_other_threads_read_them(small_table,
                                                                          monkeypatch):
    """A decode step's wait only queues its lookup's times
    (``LayerMetrics.unsettled``); ``stats()`` counts them, and so does the
    wait once ``SETTLE_AT`` are queued (4 here, so waits and readers
    settle all the while).  With another thread reading the stats and the
    threads switching as often as they can: every step is counted once
    (lookups and latency histogram alike), no read fails, and the waits
    leave fewer than SETTLE_AT queued."""
    from numa_engram.lookup import cpuprefetch, scheduler

    for module in (scheduler, cpuprefetch):  # (the modules that read it)
        monkeypatch.setattr(module, "SETTLE_AT", 4)
    spec, layer, table = small_table
    ids = ngram_hashes(spec, np.arange(6), layer)
    steps, reads, failed = 3000, [0], []
    stop = threading.Event()
    with PrefetchScheduler({1: table}, {1: (spec.n_hash_cols, spec.head_dim)},
                           max_tokens=6) as sched:
        _until_a_short_lead(sched, 1, ids)
        before = sched.stats()[1]

        def reader() -> None:
            try:
                while not stop.is_set():
                    sched.stats()
                    sched.metrics_report()
                    reads[0] += 1
            except BaseException as exc:  # (asserted below)
                failed.append(exc)
        other = threading.Thread(target=reader)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        other.start()
        try:
            for _ in range(steps):
                sched.submit(1, ids)
                sched.wait(1)
        finally:
            stop.set()
            other.join(10)
            sys.setswitchinterval(switch)
        for _ in range(10):  # no reader now: the waits settle what they queue
            sched.submit(1, ids)
            sched.wait(1)
        assert len(sched.metrics[1].unsettled) < 4
        after = sched.stats()[1]
    assert not failed and reads[0] > 0, failed
    assert after.lookups - before.lookups == steps + 10
    assert after.latency[0][-1][1] == after.lookups  # the histogram's +Inf count
    assert after.lookup_seconds > before.lookup_seconds
    assert after.lead_seconds > before.lead_seconds
    assert after.errors == 0


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_histogram_buckets_are_a_bisects_whatever_the_last_bucket_was():
    """observe() tries the last observation's bucket first (a layer's
    settle() observes its lookups one after another); every value, a
    bound's own value and its neighbours included, in any order, lands
    where bisect puts it."""
    from bisect import bisect_left

    from numa_engram.histogram import LOOKUP_BUCKETS, Histogram

    rng = np.random.default_rng(5)
    bounds = np.asarray(LOOKUP_BUCKETS)
    edges = np.concatenate([bounds, np.nextafter(bounds, 0), np.nextafter(bounds, 2)])
    values = np.concatenate([edges, edges[::-1], rng.uniform(0, 2, 500),
                             10.0 ** rng.uniform(-7, 0.5, 500), [0.0, -1.0, 5.0, float("inf")]])
    rng.shuffle(values)
    h, expected = Histogram(), [0] * (len(bounds) + 1)
    for v in values:
        h.observe(float(v))
        expected[bisect_left(LOOKUP_BUCKETS, float(v))] += 1
    assert h.counts == expected
    assert h.total == pytest.approx(float(np.sum(values)))


def test_counts_given_to_submit_reach_a_callables_lookup_and_no_tables(small_table):
    """The DP-sharded step's token counts travel with its submit: a
    callable's lookup gets them as its third argument (and none when the
    submit passes none), in the worker and in the waiter alike; a table's
    lookup takes none and gives its rows."""
    spec, layer, table = small_table
    seen = []

    def lookup(ids, out, *counts):
        seen.append(counts)
        out.zero_()
        return out

    ids = ngram_hashes(spec, np.arange(6), layer)
    shape = (spec.n_hash_cols, spec.head_dim)
    with PrefetchScheduler({"fn": lookup, layer: table}, {"fn": shape, layer: shape},
                           max_tokens=6) as sched:
        for counts in ([6, 2], None, [6, 0]):
            sched.submit("fn", ids, counts)
            sched.submit(layer, ids, counts)
            sched.wait("fn")
            got = sched.wait(layer)
            assert torch.equal(got.view(torch.int16), table.lookup(ids).view(torch.int16))
    assert seen == [([6, 2],), (), ([6, 0],)]
