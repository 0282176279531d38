"""Scheduler: what the prefetch backends share (``prefetch.PrefetchScheduler``
makes one): Engram lookups issued ahead of the layer that needs them, in
FIFO order, each layer with its own completion.

``submit(layer, hash_ids)`` enqueues the layer's lookup after the work
already queued; ``wait(layer)`` blocks (CPU) or makes the consumer stream
wait (CUDA) on that layer's lookup only, and returns its staged rows.
Depth is bounded: a submit beyond ``depth`` outstanding lookups blocks until
the oldest is waited for.  An error in a lookup is raised by that layer's
``wait``.  Staging buffers are allocated once per layer (``max_tokens``
rows) and reused every step, so a CUDA graph can be captured around them.

``prefetch.PrefetchScheduler(..., backend=)`` makes the backend's
scheduler, one interface: ``cpu`` (``cpuprefetch.CPUScheduler``: a worker thread, or the
caller's own where a hand-off would cost more than it hides) or ``cuda``
(``cudaprefetch.CUDAScheduler``: a side stream and CUDA events).  This
module holds what both share: the layers' lookups and staging buffers,
the ``depth`` slots and the layer claims, the metrics and the statistics.

Threads: ``submit``, ``wait``, ``reset`` and ``close`` may be called from any
thread.  A layer has at most one lookup in flight (a second ``submit`` of
it, from any thread, raises), and ``close()`` wakes every thread blocked in
``submit`` or ``wait`` with PrefetchError.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..errors import PrefetchError
from ..literals import IdFormat, check_id_format
from .outputs import aligned_empty
from .prefetchmetrics import SETTLE_AT, LayerMetrics, LayerStats
from .shardrows import ShardRows

if TYPE_CHECKING:
    import torch

    from .shardrows import Rows

# (hash_ids, out) -> out; called (hash_ids, out, counts) when a submit
# passes counts (the DP-sharded step's EDP token counts)
LookupFn = Callable[..., Any]
# A layer's staged rows of one size: (rows, run(ids) into them, whether run
# may run under the scheduler's lock)
Staged = tuple[Any, Any, bool]


@dataclass(slots=True)
class Job:
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
    event: Any = None  # CUDA event: the lookup is done
    start_event: Any = None  # CUDA event: the lookup started (timing)
    counts: Any = None  # what the submit passed on to a callable's lookup

    def rearm(self, ids: Any, out: Any, run: Any, submitted: float, counts: Any) -> None:
        """The layer's next CPU lookup in this (retired) job: no allocation
        per step."""
        self.ids, self.out, self.run, self.counts = ids, out, run, counts
        self.submitted = submitted
        self.done = self.cancelled = self.slot = self.woken = False
        self.started = self.finished = 0.0
        self.error = None


@dataclass(slots=True)
class Lane:
    """A layer's views of its staging buffer and its metrics."""

    views: dict[int, Staged]  # staged rows by token count (staged())
    metrics: LayerMetrics


def rows_of(source: Any) -> ShardRows | None:
    """The ``ShardRows`` a scheduler's source is (or a table's ``rows``),
    None for a callable."""
    rows = getattr(source, "rows", source)
    return rows if isinstance(rows, ShardRows) else None


def _as_lookup(source: Any, rows: ShardRows | None, backend: str = "cpu",
               max_sms: int | None = None, background: bool = True, packed: bool = False,
               id_format: IdFormat = "bucket") -> LookupFn:
    if rows is not None and backend == "cuda":
        # the fused kernel on the side stream, its grid capped so the
        # consumer's kernels keep SMs (vLLM: half in background mode)
        return lambda ids, out: rows.lookup_cuda(ids, out=out, max_sms=max_sms,
                                                 background=background, id_format=id_format)
    if rows is not None:
        return lambda ids, out: rows.lookup(ids, out=out, packed=packed, id_format=id_format)
    if packed:
        raise PrefetchError("packed=True needs tables (ShardRows, or a table's rows), not "
                            f"callables: got {source!r}")
    if callable(source):
        return cast(LookupFn, source)
    raise PrefetchError(f"{source!r} is neither a table's rows (ShardRows) nor a callable")


def _read_ahead_of(source: Any, id_format: IdFormat) -> Callable[[Any], tuple[int, int]] | None:
    """A mapped Engram table's ``readahead`` for the ids its lookups take
    (None for any other source: resident rows are in memory already; a
    PLE table, which is no scheduler's source, reads ahead by its own
    ``readahead``)."""
    if getattr(source, "tier", "resident") != "mapped" or rows_of(source) is None:
        return None
    return lambda ids: source.readahead(ids, id_format=id_format)


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


class Scheduler:
    """``lookups`` maps each Engram layer to its table (or a callable
    ``(hash_ids, out) -> out``); ``row_shape`` maps each layer to
    ``(heads_in_shard, head_dim)`` of its rows.  ``packed=True`` (CPU
    backend, tables): stage the rows as stored, ``wait`` returns
    ``(weights uint8 [T, heads, head_dim], scales uint8 [T, heads,
    head_dim/block])``: half the host writes and 48% fewer bytes to copy to
    a GPU that dequantises them (``fp8.dequantize_rows``).  ``id_format``:
    what the submitted hash ids count, for tables ("global": rows of the
    layer's whole table, as vLLM's hashing gives them)."""

    backend = "cpu"

    def __init__(self, lookups: Mapping[Any, Any], row_shape: Mapping[Any, tuple[int, int]], *,
                 max_tokens: int, depth: int = 2, backend: str | None = None,
                 device: Any = None, dtype: Any = None, max_sms: int | None = None,
                 background: bool = True, packed: bool = False,
                 id_format: IdFormat = "bucket") -> None:
        import torch

        backend = self.backend if backend is None else backend
        if depth < 1:
            raise PrefetchError(f"depth must be >= 1, got {depth}")
        if backend != self.backend:
            raise PrefetchError(f"backend must be {self.backend!r} for {type(self).__name__}, "
                                f"got {backend!r}")
        if packed and backend != "cpu":
            raise PrefetchError("packed=True stages packed rows on the CPU backend; on the GPU "
                                "call table.lookup_cuda(ids, packed=True) instead")
        self._torch = torch
        self.depth, self.max_tokens = depth, max_tokens
        # each layer's rows (a table's ShardRows), None for a callable
        self._rows = {layer: rows_of(src) for layer, src in lookups.items()}
        check_id_format(id_format)
        self._lookups = {layer: _as_lookup(src, self._rows[layer], backend, max_sms, background,
                                           packed, id_format)
                         for layer, src in lookups.items()}
        self._device = torch.device("cpu") if backend == "cpu" else \
            torch.device(device or "cuda")
        self.staging = {layer: _staging(torch, max_tokens, row_shape[layer], dtype,
                                        self._device, self._rows[layer] if packed else None)
                        for layer in self._lookups}
        self.metrics = {layer: LayerMetrics() for layer in self._lookups}
        self._lanes = {layer: Lane({}, self.metrics[layer]) for layer in self._lookups}
        # mapped tables (tier="mapped"): their rows' pages asked for ahead of
        # each lookup, counted per layer as [pages resident before, pages]
        self._read_ahead = {layer: fn for layer, src in lookups.items()
                            if (fn := _read_ahead_of(src, id_format)) is not None}
        self._read_ahead_counts = {layer: [0, 0] for layer in self._read_ahead}
        self._packed, self._id_format = packed, id_format
        self._inflight: dict[Any, Job] = {}
        self._outstanding = 0  # jobs holding one of the `depth` slots
        self._sleepers = 0  # threads waiting on the lock (_sleep)
        # state changes hold the mutex (a Condition's `with` runs Python code,
        # the lock's does not: the decode budget, docs/design.md)
        self._mutex = mutex = threading.Lock()
        self._lock = threading.Condition(mutex)  # waiters, submitters
        self._closed = False
        self._start()

    def _start(self) -> None:
        """The backend's own state and thread or stream, once the shared
        state is made (the last step of ``__init__``)."""
        raise NotImplementedError

    # -------------------------------------------------------------- api --
    def submit(self, layer: Any, hash_ids: Any, counts: Any = None) -> None:
        """Queue the layer's lookup after everything already submitted.
        ``counts`` (e.g. the DP-sharded step's EDP token counts) go to a
        callable's lookup as its third argument; a table's takes none."""
        raise NotImplementedError

    def wait(self, layer: Any, *, check_errors: bool = False,
             timeout_s: float | None = None) -> Rows:
        """The layer's staged rows ``[T, heads, head_dim]`` once its lookup is
        done (CPU) or ordered before the consumer's next work (CUDA).
        ``check_errors``: also read the table's device error record (one
        sync) and raise LookupIdError for bad ids.  ``timeout_s`` (CPU): give
        up after that long with PrefetchError; the lookup stays in flight
        (wait again, or reset())."""
        raise NotImplementedError

    def reset(self) -> None:
        """Drop every lookup not yet waited for (e.g. between steps after an
        abort); a running one finishes but its rows are discarded."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop what is queued, let a running lookup finish, wake every
        waiter (PrefetchError) and stop the backend's thread.  Idempotent."""
        raise NotImplementedError

    def read_ahead(self, layer: Any, hash_ids: Any) -> tuple[int, int]:
        """Ask the kernel for the pages of ``layer``'s rows that ``hash_ids``
        name (a mapped table's; nothing for a resident one), ahead of its
        lookup: as soon as the ids are known (a layer ahead, the next
        step's), so the reads overlap what runs meanwhile; ``submit`` does
        it too, so a lookup's reads at least go in parallel, not one page
        fault at a time.  Returns (pages resident before, pages), counted
        in ``read_ahead_stats``."""
        fn = self._read_ahead.get(layer)
        if fn is None:
            return 0, 0
        resident, pages = fn(hash_ids)
        counts = self._read_ahead_counts[layer]
        counts[0] += resident
        counts[1] += pages
        return resident, pages

    def read_ahead_stats(self) -> dict[Any, dict[str, int]]:
        """Per mapped layer: the pages its read-ahead met (``pages``),
        those already in memory (``hits``) and those it asked for (``misses``)."""
        return {layer: {"pages": pages, "hits": hits, "misses": pages - hits}
                for layer, (hits, pages) in self._read_ahead_counts.items()}

    def stats(self) -> dict[Any, LayerStats]:
        """Per layer totals since the scheduler started (no sync: CUDA
        lookup times are counted once their events have completed)."""
        with self._mutex:
            self._collect_times()
            return {layer: LayerStats(m.lookups, m.lookup_s, m.lead_s, m.exposed_s, m.errors,
                                      m.timeouts, m.latency.snapshot())
                    for layer, m in self._settled()}

    def metrics_report(self) -> dict:
        with self._mutex:
            self._collect_times()
            return {str(layer): m.as_dict() for layer, m in self._settled()}

    def _settled(self) -> list[tuple[Any, LayerMetrics]]:
        """Under the lock: every layer's metrics, settled."""
        return [(layer, m.settle()) for layer, m in self.metrics.items()]

    def _settle(self, m: LayerMetrics) -> None:
        with self._mutex:
            m.settle()

    def _collect_times(self) -> None:
        """Under the lock: lookup times the backend counts late (CUDA events)."""

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------ for the backends --
    def _staged_rows(self, layer: Any, n: int) -> tuple[Lane, Staged]:
        """The layer's lane and its staged rows for ``n`` tokens (refused:
        an unknown layer, more than ``max_tokens``)."""
        try:
            lane = self._lanes[layer]
        except KeyError:
            self._check_open()
            raise PrefetchError(f"layer {layer!r} has no lookup; layers are "
                                f"{list(self._lookups)}") from None
        made = lane.views.get(n)
        if made is None:
            if n > self.max_tokens:
                raise PrefetchError(f"{n} tokens for layer {layer!r} exceed max_tokens "
                                    f"{self.max_tokens} of the static staging buffer")
            staged = self.staging[layer]
            view: Any = tuple(b[:n] for b in staged) if isinstance(staged, tuple) \
                else staged[:n]
            made = self._staged(layer, view)
            if len(lane.views) >= 64:  # many sizes: keep the recent ones
                lane.views.clear()
            lane.views[n] = made
        return lane, made

    def _staged(self, layer: Any, view: Any) -> Staged:
        """(``view``, the backend's ``run(ids)`` into it or None, whether
        ``run`` may run under the scheduler's lock); made once per size."""
        raise NotImplementedError

    def _claim(self, job: Job, held: Mapping[Any, Any]) -> None:
        """Under the lock: the job takes its layer and one of the ``depth``
        slots, waiting for a slot (backpressure); PrefetchError once closed
        or when the layer has a lookup in flight.  ``held``: the lookups the
        backend keeps outside jobs, by layer (each holds a slot)."""
        layer = job.layer
        if self._closed or layer in self._inflight or layer in held or \
                self._outstanding + len(held) >= self.depth:
            self._claim_slowly(job, held)
        self._inflight[layer] = job
        self._outstanding += 1
        job.slot = True

    def _claim_slowly(self, job: Job, held: Mapping[Any, Any]) -> None:
        """Under the lock, for a submit that cannot claim its layer at once:
        PrefetchError when the scheduler is closed or the layer has a lookup
        in flight; else wait for one of the ``depth`` slots (backpressure)."""
        layer = job.layer
        self._check_open()
        if layer in self._inflight or layer in held:
            raise PrefetchError(f"layer {layer!r} already has a lookup in flight; wait() "
                                "for it or reset() first")
        self._inflight[layer] = job  # (claimed while it waits: a second submit is refused)
        self._sleep(lambda: self._outstanding + len(held) < self.depth or self._closed
                    or job.cancelled)
        if self._closed or job.cancelled:
            del self._inflight[layer]
            raise PrefetchError(f"the scheduler was closed or reset while layer {layer!r} "
                                "waited for a slot")

    def _check_device_errors(self, layer: Any) -> None:
        source = self._rows[layer]
        if source is not None:
            source.check_device_errors()

    def _account(self, job: Job, called: float, ready: float, ran_s: float | None) -> None:
        """The job's lookup waited for: ``called`` when its wait was called,
        ``ready`` when its rows were; ``ran_s`` its own time (None: counted
        later by the backend)."""
        m = self.metrics[job.layer]
        m.count(called - job.submitted, called - job.submitted, ready - called, ran_s)
        if len(m.unsettled) >= SETTLE_AT:
            self._settle(m)

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

    def _cancel_all(self) -> list[Job]:
        """Under the lock: mark every lookup not yet waited for dropped, wake
        submitters waiting for a slot; the ones holding a slot (queued or
        running) are returned."""
        for job in self._inflight.values():
            job.cancelled = True
        self._wake_all()
        return [job for job in self._inflight.values() if job.slot]

    def _retire(self, job: Job) -> None:
        with self._mutex:
            self._retire_locked(job)

    def _retire_locked(self, job: Job) -> None:
        """Under the lock: the job's layer and slot are free again."""
        if self._inflight.get(job.layer) is job:
            del self._inflight[job.layer]
        if job.slot:
            job.slot = False
            self._outstanding -= 1
            self._wake_all()

