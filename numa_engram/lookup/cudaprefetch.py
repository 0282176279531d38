"""CUDAScheduler: the prefetch scheduler's CUDA backend.

A submit launches the layer's lookup on one side stream, after the work
the consumer stream has queued, between two timing events; a wait makes
the consumer stream wait for the lookup's end event (no host sync) and
frees the layer.  Lookup times are read from the events once they have
completed (``query()``, never a sync), when the statistics are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..errors import PrefetchError
from .scheduler import Job, Scheduler, Staged

if TYPE_CHECKING:
    from .scheduler import Rows

_NONE_HELD: Mapping[Any, Any] = {}  # no lookup is held outside a job here


class CUDAScheduler(Scheduler):
    """``PrefetchScheduler(..., backend="cuda")``."""

    backend = "cuda"

    def _start(self) -> None:
        self._stream = self._torch.cuda.Stream(device=self._device)
        self._gpu_times: list[tuple[Any, Any, Any]] = []  # (layer, start, end) not yet read

    def submit(self, layer: Any, hash_ids: Any, counts: Any = None) -> None:
        """Launch the layer's lookup on the side stream after the consumer's
        queued work."""
        _, (out, _, _) = self._staged_rows(layer, len(hash_ids))
        job = Job(layer, hash_ids, out, None, perf_counter(), counts=counts)
        with self._mutex:
            self._claim(job, _NONE_HELD)
        self._launch(job)

    def wait(self, layer: Any, *, check_errors: bool = False,
             timeout_s: float | None = None) -> Rows:  # noqa: ARG002 (a CPU wait's)
        with self._mutex:
            self._check_open()
            job = self._inflight.get(layer)
        if job is None:
            raise PrefetchError(f"wait({layer!r}) without a submit({layer!r}) this step")
        called = perf_counter()
        try:
            self._torch.cuda.current_stream(job.out.device).wait_event(job.event)
            if job.cancelled:
                raise PrefetchError(f"the lookup of layer {layer!r} was dropped: the scheduler "
                                    "was closed or reset while it was awaited")
            self._account(job, called, perf_counter(), None)
            if job.start_event is not None:
                self._gpu_times.append((job.layer, job.start_event, job.event))
            if job.error is not None:
                self.metrics[layer].errors += 1
                raise job.error
            if check_errors:
                self._check_device_errors(layer)
            return job.out
        finally:
            self._retire(job)

    def reset(self) -> None:
        with self._mutex:
            pending = self._cancel_all()
        for job in pending:
            job.event.synchronize()
            self._retire(job)

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._cancel_all()

    # --------------------------------------------------------- internals --
    def _staged(self, layer: Any, view: Any) -> Staged:  # noqa: ARG002 (the CPU's binds it)
        return view, None, False

    def _launch(self, job: Job) -> None:
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
                lookup = self._lookups[job.layer]
                if job.counts is None or self._rows[job.layer] is not None:
                    lookup(job.ids, job.out)
                else:
                    lookup(job.ids, job.out, job.counts)
            except BaseException as exc:
                job.error = exc
            job.event.record(self._stream)
        job.finished = perf_counter()

    def _collect_times(self) -> None:
        """Under the lock: CUDA lookup times from their events, for those
        already done (``query()``, never a sync).  A wait appends to the
        list without the lock: the read ones go in one slice assignment
        (atomic), and what was appended meanwhile stays."""
        times = self._gpu_times
        n = len(times)
        pending = []
        for layer, start, end in times[:n]:
            if end.query():
                self.metrics[layer].latency.observe(start.elapsed_time(end) / 1e3)
            else:
                pending.append((layer, start, end))
        times[:n] = pending
