"""PrefetchScheduler: Engram lookups issued ahead of the layer that needs
them, in FIFO order on one side stream, each layer with its own completion
event.

``submit(layer, hash_ids)`` enqueues the layer's lookup after the work
already queued; ``wait(layer)`` blocks (CPU) or makes the consumer stream
wait (CUDA) on that layer's event only, and returns its staged rows.
Depth is bounded: a submit beyond ``depth`` outstanding lookups blocks until
the oldest completes.  An error in a lookup is raised by that layer's
``wait``.  Staging buffers are allocated once per layer (``max_tokens``
rows) and reused every step, so a CUDA graph can be captured around them.

Backends: ``cpu`` (a worker thread; the fully tested contract) and
``cuda`` (a side stream and CUDA events).  On the CPU a lookup of a layer
whose last wait came sooner after its submit returned than ``HANDOFF_S``
(a lookup run in its submit is no lead), so that running ahead would have
hidden less than the hand-off to the worker and back costs, is not handed
to an idle worker: a table's runs in its ``submit`` when no job is in
flight and a slot is free (no job is made for it: it leaves a record of
its rows, error and times, which its ``wait`` only takes), else its
``wait`` runs it on the waiting thread (with any such lookups queued before
it, in order).  Every other lookup runs on the worker, ahead
of its wait.

Threads: ``submit``, ``wait``, ``reset`` and ``close`` may be called from any
thread; every state change happens under one lock, except a wait's taking
of a lookup run in its submit: one ``dict.pop`` of an immutable record
(atomic: exactly one of that wait, a reset and a close gets it).  A layer
has at most one lookup in flight (a second ``submit`` of it, from any
thread, raises), and ``close()`` wakes every thread blocked in ``submit``
or ``wait`` with PrefetchError.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..errors import PrefetchError
from ..histogram import Histogram
from ..literals import IdFormat, check_id_format
from .outputs import aligned_empty

if TYPE_CHECKING:
    import torch

    Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

LookupFn = Callable[[Any, Any], Any]  # (hash_ids, out) -> out
# A layer's staged rows of one size: (rows, run(ids) into them, whether run
# may run under the scheduler's lock)
_Staged = tuple[Any, Any, bool]
# What handing a lookup to the worker and back may cost: two thread
# wake-ups, each up to ~200 us in a VM guest (a 1,024-token lookup waited for
# at once took 1.8x a direct one through the worker).  A lead (submit ->
# wait) shorter than this hides less than it costs.
HANDOFF_S = 0.0005


@dataclass(frozen=True)
class LayerStats:
    """Totals of one layer's lookups (``scheduler.stats()``)."""

    lookups: int
    lookup_seconds: float        # the lookups themselves (CUDA: from events, when done)
    lead_seconds: float          # submit -> wait: how far ahead they were issued
    exposed_wait_seconds: float  # wait -> rows ready: what the consumer lost
    errors: int = 0              # lookups that raised (bad ids included)
    timeouts: int = 0            # waits that gave up (wait(timeout_s=))
    latency: tuple = ()          # the lookups' own times: Histogram.snapshot()


# Waited-for lookups a layer's metrics hold before they are counted into
# its totals at the latest (LayerMetrics.unsettled): a scheduler whose
# stats are never read keeps at most this many, and the wait that counts
# them pays for all at once (~0.17 us each: 1,024 stalled one decode step
# 0.17 ms, 64 stall it ~12 us).
SETTLE_AT = 64


@dataclass(slots=True)
class LayerMetrics:
    """A layer's totals.  A wait only appends its lookup's times to
    ``unsettled`` (one deque append: counting them there made a 1-token
    decode step's submit+wait 3-9% slower, A/B in one process); ``settle()``
    counts them, under the scheduler's lock, when the stats are read or
    ``SETTLE_AT`` are waiting, so the totals have one writer at a time.
    ``errors``, ``timeouts`` and ``last_lead_s`` are kept at once."""

    lookups: int = 0
    lead_s: float = 0.0     # submit -> wait call
    exposed_s: float = 0.0  # wait call -> rows ready (what the consumer lost)
    errors: int = 0
    timeouts: int = 0
    latency: Histogram = field(default_factory=Histogram)
    # the last lookup's free lead (its submit's return -> its wait: a
    # lookup run in its submit is not a lead): whether running the next one
    # ahead can hide anything
    last_lead_s: float = float("inf")
    # waited for, not yet in the totals: (lead_s, exposed_s, ran_s) each
    unsettled: deque = field(default_factory=deque)

    def count(self, lead_s: float, free_lead_s: float, exposed_s: float,
              ran_s: float | None) -> None:
        """One lookup waited for: ``lead_s`` from its submit's call to its
        wait, ``free_lead_s`` from its submit's return (what decides where
        the next one runs), ``exposed_s`` from the wait to its rows, and
        ``ran_s`` the lookup's own time (None: a CUDA one's, read from its
        events later).  Counted in the totals by the next ``settle()``."""
        self.last_lead_s = free_lead_s
        self.unsettled.append((lead_s, exposed_s, ran_s))

    def settle(self) -> LayerMetrics:
        """Count the waited-for lookups into the totals (the caller holds
        the scheduler's lock: waits only append meanwhile); returns self."""
        unsettled = self.unsettled
        while unsettled:
            lead_s, exposed_s, ran_s = unsettled.popleft()
            self.lookups += 1
            self.lead_s += lead_s
            self.exposed_s += exposed_s
            if ran_s is not None:
                self.latency.observe(ran_s)
        return self

    @property
    def lookup_s(self) -> float:
        """Time the lookups themselves ran: their histogram's sum."""
        return self.latency.total

    def ahead_pays(self) -> bool:
        """Whether the layer's next lookup should go to the worker: when the
        last lead was longer than a hand-off costs.  A shorter lead hides
        nothing even if the lookup is shorter still: the worker is still
        waking when the wait comes (1-token lookups with a lead of a few us
        handed to the worker cost ~100 us each)."""
        return self.last_lead_s >= HANDOFF_S

    def as_dict(self) -> dict:
        n = max(1, self.lookups)
        return {"lookups": self.lookups, "mean_lookup_s": self.lookup_s / n,
                "mean_lead_s": self.lead_s / n, "mean_exposed_s": self.exposed_s / n}


@dataclass(slots=True)
class _Job:
    layer: Any
    ids: Any
    out: Any  # the staged rows wait() returns
    run: Any  # CPU: run(ids) looks up into out (a table's bind_lookup of it)
    submitted: float
    done: bool = False  # under the scheduler's lock; waiters wait on its condition
    started: float = 0.0
    finished: float = 0.0
    error: BaseException | None = None
    cancelled: bool = False
    slot: bool = False  # holds one of the scheduler's `depth` slots
    woken: bool = False  # the worker was told to run it (else its waiter does)
    retired: bool = False  # its layer and slot are free again (under the lock)
    event: Any = None  # CUDA event: the lookup is done
    start_event: Any = None  # CUDA event: the lookup started (timing)

    def rearm(self, ids: Any, out: Any, run: Any, submitted: float) -> None:
        """The layer's next CPU lookup in this (retired) job: no allocation
        per step."""
        self.ids, self.out, self.run = ids, out, run
        self.submitted = submitted
        self.done = self.cancelled = self.slot = self.woken = self.retired = False
        self.started = self.finished = 0.0
        self.error = None


@dataclass(slots=True)
class _Lane:
    """A layer's views of its staging buffer and its metrics."""

    views: dict[int, _Staged]  # staged rows by token count (_staged)
    metrics: LayerMetrics


# A lookup that ran in its submit (a table's, with no job in flight and its
# wait due at once: a decode step's), which needs no job: (the rows wait()
# returns, its error or None, the clock when it started and when it ended,
# its layer's metrics).  Its rows wait in the staging buffer; the record
# waits in the scheduler's ``_ran`` until the layer's wait takes it, and
# holds one of the ``depth`` slots meanwhile.
_Ran = tuple[Any, BaseException | None, float, float, LayerMetrics]


def _as_lookup(source: Any, backend: str = "cpu", max_sms: int | None = None,
               background: bool = True, packed: bool = False,
               id_format: IdFormat = "bucket") -> LookupFn:
    if backend == "cuda" and hasattr(source, "lookup_cuda"):
        # the fused kernel on the side stream, its grid capped so the
        # consumer's kernels keep SMs (vLLM: half in background mode)
        return lambda ids, out: source.lookup_cuda(ids, out=out, max_sms=max_sms,
                                                   background=background, id_format=id_format)
    if hasattr(source, "lookup"):
        return lambda ids, out: source.lookup(ids, out=out, packed=packed, id_format=id_format)
    if packed:
        raise PrefetchError("packed=True needs tables (with .lookup(packed=True)), not "
                            f"callables: got {source!r}")
    if callable(source):
        return source
    raise PrefetchError(f"{source!r} is neither a table (with .lookup) nor a callable")


def _staging(torch: Any, max_tokens: int, row_shape: tuple[int, int], dtype: Any, device: Any,
             table: Any) -> Rows:
    """The layer's static buffer: BF16 rows, or (FP8 rows, scales) of
    ``table``'s block size when packed.  On the CPU from ``aligned_empty``,
    as a table's own outputs: 64-byte aligned for the streaming stores, and
    transparent huge pages for a prefill's scattered rows (torch's
    allocator asks for neither: a 16,384-token step took 1.2x a direct
    lookup)."""
    heads, dim = row_shape
    if table is None:
        dtype = dtype or torch.bfloat16
        if device.type != "cpu" or dtype != torch.bfloat16:
            return torch.empty((max_tokens, heads, dim), dtype=dtype, device=device)
        return _cpu_buffer(torch, (max_tokens, heads, dim), torch.bfloat16)
    return (_cpu_buffer(torch, (max_tokens, heads, dim), torch.uint8),
            _cpu_buffer(torch, (max_tokens, heads, dim // table.spec.block), torch.uint8))


def _cpu_buffer(torch: Any, shape: tuple[int, ...], dtype: Any) -> torch.Tensor:
    """A CPU tensor of ``shape`` on ``aligned_empty`` memory (BF16 or uint8)."""
    if dtype == torch.uint8:
        return torch.from_numpy(aligned_empty(math.prod(shape), "uint8").reshape(shape))
    return torch.from_numpy(aligned_empty(math.prod(shape)).reshape(shape)).view(torch.bfloat16)


class PrefetchScheduler:
    """``lookups`` maps each Engram layer to its table (or a callable
    ``(hash_ids, out) -> out``); ``row_shape`` maps each layer to
    ``(heads_in_shard, head_dim)`` of its rows.  ``packed=True`` (CPU
    backend, tables): stage the rows as stored, ``wait`` returns
    ``(weights uint8 [T, heads, head_dim], scales uint8 [T, heads,
    head_dim/block])``: half the host writes and 48% fewer bytes to copy to
    a GPU that dequantises them (``fp8.dequantize_rows``).  ``id_format``:
    what the submitted hash ids count, for tables ("global": rows of the
    layer's whole table, as vLLM's hashing gives them)."""

    def __init__(self, lookups: Mapping[Any, Any], row_shape: Mapping[Any, tuple[int, int]], *,
                 max_tokens: int, depth: int = 2, backend: str = "cpu", device: Any = None,
                 dtype: Any = None, max_sms: int | None = None,
                 background: bool = True, packed: bool = False,
                 id_format: IdFormat = "bucket") -> None:
        import torch

        if depth < 1:
            raise PrefetchError(f"depth must be >= 1, got {depth}")
        if backend not in ("cpu", "cuda"):
            raise PrefetchError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
        if packed and backend != "cpu":
            raise PrefetchError("packed=True stages packed rows on the CPU backend; on the GPU "
                                "call table.lookup_cuda(ids, packed=True) instead")
        self._torch = torch
        self.backend, self.depth, self.max_tokens = backend, depth, max_tokens
        self._sources = dict(lookups)
        check_id_format(id_format)
        self._lookups = {layer: _as_lookup(src, backend, max_sms, background, packed, id_format)
                         for layer, src in lookups.items()}
        self._gpu_times: list[tuple[Any, Any, Any]] = []  # (layer, start, end) not yet read
        dev = torch.device("cpu") if backend == "cpu" else torch.device(device or "cuda")
        self.staging = {layer: _staging(torch, max_tokens, row_shape[layer], dtype, dev,
                                        self._sources[layer] if packed else None)
                        for layer in self._lookups}
        self.metrics = {layer: LayerMetrics() for layer in self._lookups}
        self._lanes = {layer: _Lane({}, self.metrics[layer]) for layer in self._lookups}
        self._packed, self._id_format = packed, id_format
        self._inflight: dict[Any, _Job] = {}
        self._spare: dict[Any, _Job] = {}  # CPU: a layer's collected job, for its next submit
        self._outstanding = 0  # jobs holding one of the `depth` slots
        # by layer, the lookups that ran in their submit, not yet waited for
        # (each holds a slot too): put in under the lock, taken out by their
        # wait with one dict.pop and no lock (atomic, and the record is
        # immutable: exactly one of a wait, a reset and a close takes it)
        self._ran: dict[Any, _Ran] = {}
        self._sleepers = 0  # threads waiting on the lock (_sleep)
        # state changes hold the mutex (a Condition's `with` runs Python code,
        # the lock's does not: the decode budget, docs/design.md)
        self._mutex = mutex = threading.Lock()
        self._lock = threading.Condition(mutex)  # waiters, submitters
        self._work = threading.Condition(mutex)  # the worker: a job queued, or stop
        self._closed = self._stopping = False
        self._queue: deque[_Job] = deque()  # CPU: submitted, not started, in order
        self._running = False  # CPU: a lookup runs (on the worker or a waiter)
        self._cpu = backend == "cpu"  # (read every call: the decode budget)
        if backend == "cpu":
            self._worker = threading.Thread(target=self._run_cpu, name="engram-prefetch",
                                            daemon=True)
            self._worker.start()
        else:
            self._stream = torch.cuda.Stream(device=dev)

    # -------------------------------------------------------------- api --
    def submit(self, layer: Any, hash_ids: Any) -> None:
        """Queue the layer's lookup after everything already submitted."""
        try:
            lane = self._lanes[layer]
        except KeyError:
            self._check_open()
            raise PrefetchError(f"layer {layer!r} has no lookup; layers are "
                                f"{list(self._lookups)}") from None
        n = len(hash_ids)
        made = lane.views.get(n)
        if made is None:
            if n > self.max_tokens:
                raise PrefetchError(f"{n} tokens for layer {layer!r} exceed max_tokens "
                                    f"{self.max_tokens} of the static staging buffer")
            made = self._staged(layer, n)
        out, run, now_ok = made
        mutex = self._mutex
        mutex.acquire()
        try:
            # a decode step's case, in the fewest steps (its lookup is a few
            # us): a table's lookup with no job in flight (none queued,
            # running, waiting for a slot or not yet collected: every job is
            # in _inflight from its claim to its retirement, so no job holds
            # a slot either), whose wait comes too soon for the worker to
            # run it ahead (metrics.ahead_pays(), inline), runs now, under
            # the lock (a table's kernel never calls back); its wait only
            # takes its record
            ran = self._ran
            if now_ok and not self._inflight and layer not in ran \
                    and lane.metrics.last_lead_s < HANDOFF_S \
                    and len(ran) < self.depth and not self._closed:
                error = None
                submitted = perf_counter()
                try:
                    run(hash_ids)
                except BaseException as exc:  # surfaces at this layer's wait()
                    error = exc
                ran[layer] = (out, error, submitted, perf_counter(), lane.metrics)
                return
        finally:
            mutex.release()
        self._submit_job(layer, lane, hash_ids, out, run)

    def _submit_job(self, layer: Any, lane: _Lane, hash_ids: Any, out: Any, run: Any) -> None:
        """submit() of a lookup that goes through a job: queued for the
        worker (a long lead, or behind its work) or for its waiter (the
        waiter runs it when it is next), or launched on the side stream."""
        job = self._spare.pop(layer, None)  # the layer's last job, collected by its wait
        now = perf_counter()
        if job is None:
            job = _Job(layer, hash_ids, out, run, now)
        else:
            job.rearm(hash_ids, out, run, now)
        mutex = self._mutex
        mutex.acquire()  # check and claim the layer in one step
        try:
            if self._closed or layer in self._inflight or layer in self._ran or \
                    self._outstanding + len(self._ran) >= self.depth:
                self._claim_slowly(job)  # refused, or waits for a slot
            self._inflight[layer] = job
            self._outstanding += 1
            job.slot = True
            if self._cpu:  # under the lock: close() stops the worker after it
                queue = self._queue
                queue.append(job)
                if lane.metrics.ahead_pays() or self._running or \
                        len(queue) > 1 and queue[-2].woken:
                    job.woken = True  # the worker runs it (after what it has)
                    self._work.notify()
        finally:
            mutex.release()
        if not self._cpu:
            self._launch_cuda(job)

    def _claim_slowly(self, job: _Job) -> None:
        """Under the lock, for a submit that cannot claim its layer at once:
        PrefetchError when the scheduler is closed or the layer has a lookup
        in flight; else wait for one of the ``depth`` slots (backpressure)."""
        layer = job.layer
        self._check_open()
        if layer in self._inflight or layer in self._ran:
            raise PrefetchError(f"layer {layer!r} already has a lookup in flight; wait() "
                                "for it or reset() first")
        self._inflight[layer] = job  # (claimed while it waits: a second submit is refused)
        self._sleep(lambda: self._outstanding + len(self._ran) < self.depth or self._closed
                    or job.cancelled)
        if self._closed or job.cancelled:
            del self._inflight[layer]
            raise PrefetchError(f"the scheduler was closed or reset while layer {layer!r} "
                                "waited for a slot")

    def wait(self, layer: Any, *, check_errors: bool = False,
             timeout_s: float | None = None) -> Rows:
        """The layer's staged rows ``[T, heads, head_dim]`` once its lookup is
        done (CPU) or ordered before the consumer's next work (CUDA).
        ``check_errors``: also read the table's device error record (one
        sync) and raise LookupIdError for bad ids.  ``timeout_s`` (CPU): give
        up after that long with PrefetchError; the lookup stays in flight
        (wait again, or reset())."""
        # a decode step's case first, in the fewest steps (the decode
        # budget): a lookup run in its submit is collected without the lock
        record = self._ran.pop(layer, None)
        if record is None:  # (a job's lookup, or none)
            return self._wait_job(layer, check_errors, timeout_s)
        if self._sleepers:  # a submit waits for the slot this frees
            with self._mutex:
                self._lock.notify_all()
        called = perf_counter()
        out, error, submitted, returned, m = record
        # LayerMetrics.count, inline (found done: nothing exposed)
        m.last_lead_s = called - returned
        unsettled = m.unsettled
        unsettled.append((called - submitted, 0.0, returned - submitted))
        if len(unsettled) >= SETTLE_AT:
            self._settle(m)
        if error is not None:
            m.errors += 1
            raise error
        if check_errors:
            self._check_device_errors(layer)
        return out

    def _wait_job(self, layer: Any, check_errors: bool, timeout_s: float | None) -> Rows:
        """wait() for a lookup that went through a job: a CPU job already
        done (on the worker) and never dropped (close() drops every job in
        flight) is retired and collected in one lock round trip; anything
        else takes _wait_slowly."""
        mutex = self._mutex
        mutex.acquire()
        try:
            job = self._inflight.get(layer)
            collect = job is not None and job.done and self._cpu and not job.cancelled
            if job is not None and collect:
                self._retire_locked(job)
        finally:
            mutex.release()
        if job is None or not collect:
            return self._wait_slowly(layer, check_errors, timeout_s)
        called = perf_counter()
        self._account(job, called, called)
        out, error = job.out, job.error
        job.ids = job.error = None  # nothing else refers to it: the next submit's
        self._spare[layer] = job
        if error is not None:
            self.metrics[layer].errors += 1
            raise error
        if check_errors:
            self._check_device_errors(layer)
        return out

    def _wait_slowly(self, layer: Any, check_errors: bool, timeout_s: float | None) -> Rows:
        """wait() for a job not yet done (run here when it is next and no
        worker was told to, else waited for), dropped, or on CUDA."""
        mutex = self._mutex
        mutex.acquire()
        try:
            if self._closed:
                self._check_open()
            job = self._inflight.get(layer)
            # settled in this round trip: the job is done (a CUDA one, or
            # dropped) and is retired here; or it is next, no worker was
            # told to run it and none runs: it runs here, below
            done = job is not None and job.done
            if job is not None and done:
                self._retire_locked(job)
            queue = self._queue
            here = not done and job is not None and timeout_s is None and \
                not self._running and bool(queue) and queue[0] is job and not job.woken
            if here:
                queue.popleft()
                self._running = True
        finally:
            mutex.release()
        if job is None:
            raise PrefetchError(f"wait({layer!r}) without a submit({layer!r}) this step")
        called = perf_counter()
        if done:
            pass
        elif here:
            self._execute(job, retire=True, started=called)  # done and retired: one round trip
        elif self._cpu and not self._wait_cpu(job, timeout_s):
            with self._mutex:
                self.metrics[layer].timeouts += 1
            raise PrefetchError(f"the lookup of layer {layer!r} did not finish in {timeout_s} s;"
                                " it is still in flight: wait again or reset()")
        try:
            if not self._cpu:  # (the CPU lookup is done: above)
                self._torch.cuda.current_stream(job.out.device).wait_event(job.event)
            if job.cancelled:
                raise PrefetchError(f"the lookup of layer {layer!r} was dropped: the scheduler "
                                    "was closed or reset while it was awaited")
            self._account(job, called, called if done else job.finished if here else
                          perf_counter())
            if job.error is not None:
                self.metrics[layer].errors += 1
                raise job.error
            if check_errors:
                self._check_device_errors(layer)
            return job.out
        finally:
            if not job.retired:  # (set by this thread when the lookup ran here)
                self._retire(job)
            if self._cpu and not job.cancelled:
                # retired and never cancelled: nothing refers to it now (a
                # reset or close only holds the jobs it cancelled), so the
                # layer's next submit reuses it
                job.ids = job.error = None
                self._spare[layer] = job

    def _check_device_errors(self, layer: Any) -> None:
        source = self._sources[layer]
        if hasattr(source, "check_device_errors"):
            source.check_device_errors()

    def reset(self) -> None:
        """Drop every lookup not yet waited for (e.g. between steps after an
        abort); a running one finishes but its rows are discarded."""
        with self._mutex:
            pending = self._cancel_all()
            if self._cpu:  # the worker drains what no waiter will run now
                for job in self._queue:
                    job.woken = True
                self._work.notify()
        for job in pending:
            if self._cpu:
                self._wait_done(job)
            else:
                job.event.synchronize()
            self._retire(job)

    def close(self) -> None:
        """Drop what is queued, let a running lookup finish, wake every
        waiter (PrefetchError) and stop the worker.  Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._cancel_all()
        if self._cpu:
            with self._mutex:
                self._stopping = True
                self._work.notify()
            self._worker.join()  # skipped jobs and the running one set `done`

    def stats(self) -> dict[Any, LayerStats]:
        """Per layer totals since the scheduler started (no sync: CUDA
        lookup times are counted once their events have completed)."""
        with self._mutex:
            self._read_gpu_times()
            return {layer: LayerStats(m.lookups, m.lookup_s, m.lead_s, m.exposed_s, m.errors,
                                      m.timeouts, m.latency.snapshot())
                    for layer, m in self._settled()}

    def metrics_report(self) -> dict:
        with self._mutex:
            self._read_gpu_times()
            return {str(layer): m.as_dict() for layer, m in self._settled()}

    def _settled(self) -> list[tuple[Any, LayerMetrics]]:
        """Under the lock: every layer's metrics, settled."""
        return [(layer, m.settle()) for layer, m in self.metrics.items()]

    def _settle(self, m: LayerMetrics) -> None:
        with self._mutex:
            m.settle()

    def _read_gpu_times(self) -> None:
        """Under the lock: CUDA lookup times from their events, for those
        already done (``query()``, never a sync).  A wait appends to the
        list without the lock: the read ones go in one slice assignment
        (atomic), and what was appended meanwhile stays."""
        times = self._gpu_times
        n = len(times)
        pending = []
        for layer, start, end in times[:n]:
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                self.metrics[layer].latency.observe(seconds)
            else:
                pending.append((layer, start, end))
        times[:n] = pending

    def __enter__(self) -> PrefetchScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------- internals --
    def _sleep(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Under the lock: wait on it until ``predicate``, counted, so that
        state changes wake threads only when some sleep (a notify costs a
        few us even with no one to wake: the decode budget)."""
        self._sleepers += 1
        try:
            return self._lock.wait_for(predicate, timeout_s)
        finally:
            self._sleepers -= 1

    def _wake_all(self) -> None:
        """Under the lock: wake the threads sleeping on it, if any."""
        if self._sleepers:
            self._lock.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise PrefetchError("the scheduler is closed")

    def _staged(self, layer: Any, n: int) -> _Staged:
        """The first ``n`` rows of the layer's staging buffer, (CPU) the
        lookup into them, ``run(ids)``: a table's ``bind_lookup`` (the
        buffer checked once, a call is the kernel), else the layer's lookup
        with the buffer as ``out``; and whether ``run`` may run under the
        scheduler's lock (a table's: it never calls back).  Made once per
        size, the same every step."""
        views = self._lanes[layer].views
        made = views.get(n)
        if made is not None:
            return made
        staged = self.staging[layer]
        view: Any = tuple(b[:n] for b in staged) if isinstance(staged, tuple) else staged[:n]
        source, run = self._sources[layer], None
        now_ok = self._cpu and hasattr(source, "bind_lookup")
        if now_ok:
            run = source.bind_lookup(view, packed=self._packed, id_format=self._id_format)
        elif self._cpu:
            lookup = self._lookups[layer]

            def run(ids: Any) -> Any:
                return lookup(ids, view)
        made = (view, run, now_ok)
        if len(views) >= 64:  # many sizes: keep the recent ones
            views.clear()
        views[n] = made
        return made

    def _cancel_all(self) -> list[_Job]:
        """Under the lock: mark every lookup not yet waited for dropped, wake
        submitters waiting for a slot; the ones holding a slot (queued or
        running) are returned."""
        for job in self._inflight.values():
            job.cancelled = True
        self._ran.clear()  # done already: their slots are free at once
        self._wake_all()
        return [job for job in self._inflight.values() if job.slot]

    def _retire(self, job: _Job) -> None:
        with self._mutex:
            self._retire_locked(job)

    def _retire_locked(self, job: _Job) -> None:
        """Under the lock: the job's layer and slot are free again."""
        job.retired = True
        if self._inflight.get(job.layer) is job:
            del self._inflight[job.layer]
        if job.slot:
            job.slot = False
            self._outstanding -= 1
            self._wake_all()

    def _account(self, job: _Job, called: float, ready: float) -> None:
        m = self.metrics[job.layer]  # (finished after started: the clock is monotonic)
        m.count(called - job.submitted, called - job.submitted, ready - called,
                job.finished - job.started if self._cpu else None)
        if len(m.unsettled) >= SETTLE_AT:
            self._settle(m)
        if not self._cpu and job.start_event is not None:
            self._gpu_times.append((job.layer, job.start_event, job.event))

    def _run_cpu(self) -> None:
        """The worker: the oldest queued job whenever no lookup runs; after
        close() it still drains the queue (dropped jobs are only marked done)."""
        while True:
            with self._work:
                # only what it was told to run: a small lookup of an idle
                # scheduler is its waiter's
                self._work.wait_for(lambda: not self._running and (
                    self._stopping or bool(self._queue) and self._queue[0].woken))
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = True
            self._execute(job)

    def _wait_cpu(self, job: _Job, timeout_s: float | None = None) -> bool:
        """Run the small lookups queued up to this one here, in order, while
        the worker is idle (no hand-off); wait for the worker for anything
        else.  False when ``timeout_s`` passed first (a wait that may give
        up runs nothing itself: the worker is told to run it)."""
        while True:
            with self._mutex:
                if job.done:
                    return True
                head = self._queue[0] if self._queue and not self._running else None
                if head is None or head.woken or timeout_s is not None:
                    return self._wait_for_worker(job, timeout_s)
                self._queue.popleft()
                self._running = True
            self._execute(head)
            if head is job:  # done, here: no lock round trip to read that
                return True

    def _wait_for_worker(self, job: _Job, timeout_s: float | None) -> bool:
        """Under the lock: make sure the worker runs what is queued, then wait
        for the job."""
        if not job.woken:
            for queued in self._queue:
                queued.woken = True
            self._work.notify()
        return self._sleep(lambda: job.done, timeout_s)

    def _wait_done(self, job: _Job) -> None:
        with self._mutex:
            self._sleep(lambda: job.done)

    def _execute(self, job: _Job, retire: bool = False, started: float | None = None) -> None:
        """Run the job's lookup (an error is kept for its wait), then mark
        it done (and with ``retire``, its layer and slot free: a waiter
        running its own lookup) in one lock round trip.  ``started``: the
        clock's reading just now, when the caller has one."""
        job.started = perf_counter() if started is None else started
        if not job.cancelled:
            try:
                job.run(job.ids)
            except BaseException as exc:  # surfaces at this layer's wait()
                job.error = exc
        job.finished = perf_counter()
        mutex = self._mutex
        mutex.acquire()
        try:
            job.done, self._running = True, False
            if retire:
                self._retire_locked(job)
            if self._sleepers:  # (_wake_all, inline: the decode budget)
                self._lock.notify_all()
            if self._stopping or self._queue and self._queue[0].woken:
                # only when there is work for it: a woken worker that finds
                # none still takes the GIL from the thread doing the work
                self._work.notify()
        finally:
            mutex.release()

    def _launch_cuda(self, job: _Job) -> None:
        torch = self._torch
        consumer = torch.cuda.current_stream(job.out.device)
        self._stream.wait_stream(consumer)  # after the work already queued
        job.event = torch.cuda.Event(enable_timing=True)
        job.start_event = torch.cuda.Event(enable_timing=True)
        job.started = perf_counter()
        if torch.is_tensor(job.ids) and job.ids.is_cuda:
            # made on the consumer stream, read on ours: keep the allocator
            # from reusing its memory before our lookup has run
            job.ids.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            job.start_event.record(self._stream)
            try:
                self._lookups[job.layer](job.ids, job.out)
            except BaseException as exc:
                job.error = exc
            job.event.record(self._stream)
        job.finished = perf_counter()
