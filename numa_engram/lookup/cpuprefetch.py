"""CPUScheduler: the prefetch scheduler's CPU backend.

Where a lookup runs: one whose layer's last wait came sooner after its
submit returned than ``HANDOFF_S`` (running ahead would hide less than the
hand-off to the worker and back costs) is not handed to an idle worker: a
table's runs in its ``submit`` when no job is in flight, else its
``wait`` runs it on the waiting thread (with any such lookups queued before
it, in order).  Every other lookup runs on the worker, ahead of its wait.

How it completes: a lookup run in its submit leaves a record (its rows,
error and times) that its wait only takes: no job, no lock (one
``dict.pop`` of an immutable record, atomic: exactly one of that wait, a
reset and a close gets it; a job's claim, lock round trips and retirement
cost a 1-token decode step a third more, docs/design.md, "The decode
budget").  Every other lookup is a job (one per layer, reused step after
step), marked done under the scheduler's lock wherever it ran, and
collected by its wait in one way: retired (its layer and slot free),
counted, its rows returned.
"""

from __future__ import annotations

import threading
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..errors import PrefetchError
from .prefetchmetrics import HANDOFF_S, SETTLE_AT, LayerMetrics
from .scheduler import Job, Lane, Scheduler, Staged

if TYPE_CHECKING:
    from .scheduler import Rows

# A lookup that ran in its submit: (the rows wait() returns, its error or
# None, the clock when it started and when it ended, its layer's metrics).
# It waits in the scheduler's ``_ran`` until its layer's wait takes it, and
# holds one of the ``depth`` slots meanwhile.
_Ran = tuple[Any, BaseException | None, float, float, LayerMetrics]


class CPUScheduler(Scheduler):
    """``PrefetchScheduler(..., backend="cpu")``."""

    backend = "cpu"

    def _start(self) -> None:
        self._spare: dict[Any, Job] = {}  # a layer's collected job, for its next submit
        self._ran: dict[Any, _Ran] = {}  # by layer: the lookups run in their submit
        self._work = threading.Condition(self._mutex)  # the worker: a job queued, or stop
        self._stopping = False
        self._queue: deque[Job] = deque()  # submitted, not started, in order
        self._running = False  # a lookup runs (on the worker or a waiter)
        self._worker = threading.Thread(target=self._run_worker, name="engram-prefetch",
                                        daemon=True)
        self._worker.start()

    def submit(self, layer: Any, hash_ids: Any, counts: Any = None) -> None:
        if self._read_ahead and layer in self._read_ahead:  # a mapped table's pages, in parallel
            self.read_ahead(layer, hash_ids)
        lane, (out, run, now_ok) = self._staged_rows(layer, len(hash_ids))
        mutex = self._mutex
        mutex.acquire()
        try:
            # a table's lookup whose wait comes too soon for the worker to
            # run it ahead (a decode step's), with no job in flight (none
            # queued, running, waiting for a slot or not yet collected)
            # runs now, under the lock (a table's kernel never calls back)
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
        self._submit_job(layer, lane, hash_ids, out, run, None if now_ok else counts)

    def _submit_job(self, layer: Any, lane: Lane, hash_ids: Any, out: Any, run: Any,
                    counts: Any) -> None:
        """submit() of a lookup that goes through a job: queued for the
        worker (a long lead, or behind its work) or for its waiter."""
        job = self._spare.pop(layer, None)  # the layer's last job, collected by its wait
        now = perf_counter()
        if job is None:
            job = Job(layer, hash_ids, out, run, now, counts=counts)
        else:
            job.rearm(hash_ids, out, run, now, counts)
        with self._mutex:
            self._claim(job, self._ran)  # refused, or waits for a slot
            queue = self._queue
            queue.append(job)
            if lane.metrics.ahead_pays() or self._running or \
                    len(queue) > 1 and queue[-2].woken:
                job.woken = True  # the worker runs it (after what it has)
                self._work.notify()

    def wait(self, layer: Any, *, check_errors: bool = False,
             timeout_s: float | None = None) -> Rows:
        record = self._ran.pop(layer, None)  # (a decode step's: no lock)
        if record is None:
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
        """wait() for a job, however it ran: done already, run here, or
        waited for; then retired, counted and collected, in one lock round
        trip when it was done."""
        called = perf_counter()
        with self._mutex:
            job = self._inflight.get(layer)
            if job is None:
                self._check_open()
                raise PrefetchError(f"wait({layer!r}) without a submit({layer!r}) this step")
            ready = called if job.done else self._until_done(job, timeout_s, called)
            self._retire_locked(job)
            if job.cancelled:  # (reset or close hold it: not reused)
                raise PrefetchError(f"the lookup of layer {layer!r} was dropped: the scheduler "
                                    "was closed or reset while it was awaited")
        # retired and not dropped: nothing else refers to the job now
        self._account(job, called, ready, job.finished - job.started)
        out, error = job.out, job.error
        job.ids = job.error = None
        self._spare[layer] = job  # the layer's next submit's
        if error is not None:
            self.metrics[layer].errors += 1
            raise error
        if check_errors:
            self._check_device_errors(layer)
        return out

    def reset(self) -> None:
        with self._mutex:
            pending = self._cancel_all()
            self._ran.clear()  # done already: their slots are free at once
            for job in self._queue:  # the worker drains what no waiter will run now
                job.woken = True
            self._work.notify()
        with self._mutex:
            self._sleep(lambda: all(job.done for job in pending))
            for job in pending:
                self._retire_locked(job)

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._cancel_all()
            self._ran.clear()
            self._stopping = True
            self._work.notify()
        self._worker.join()  # skipped jobs and the running one are marked done

    # --------------------------------------------------------- internals --
    def _staged(self, layer: Any, view: Any) -> Staged:
        """(``view``, the lookup into it, ``run(ids)``: a table's
        ``bind_lookup`` (the buffer checked once, a call is the kernel), else
        the layer's lookup with the buffer as ``out``; whether ``run`` may
        run under the scheduler's lock: a table's, which never calls back)."""
        rows = self._rows[layer]
        if rows is not None:
            return view, rows.bind_lookup(view, packed=self._packed,
                                          id_format=self._id_format), True
        lookup = self._lookups[layer]

        def run(ids: Any, *counts: Any) -> Any:
            return lookup(ids, view, *counts)
        return view, run, False

    def _until_done(self, job: Job, timeout_s: float | None, called: float) -> float:
        """Under the lock: run the lookups queued up to ``job`` here, in
        order, while the worker is idle and was not told to run them (no
        hand-off); else have the worker run what is queued and wait for it.
        A wait that may give up (``timeout_s``) runs nothing itself.  The
        clock when the rows were ready; PrefetchError after ``timeout_s``
        (the lookup stays in flight).  ``called``: the clock at the wait's
        call, the start of a lookup it runs at once."""
        queue = self._queue
        while not job.done:
            head = queue[0] if queue and not self._running else None
            if head is not None and not head.woken and timeout_s is None:
                queue.popleft()
                self._running = True
                self._mutex.release()
                try:
                    head.started = called if head is job else perf_counter()
                    self._run(head)
                finally:
                    self._mutex.acquire()
                self._finish(head)
                continue
            if not job.woken:
                for queued in queue:
                    queued.woken = True
                self._work.notify()
            if not self._sleep(lambda: job.done, timeout_s):
                self.metrics[job.layer].timeouts += 1
                raise PrefetchError(f"the lookup of layer {job.layer!r} did not finish in "
                                    f"{timeout_s} s; it is still in flight: wait again or "
                                    "reset()")
        return perf_counter()

    def _run(self, job: Job) -> None:
        """The job's lookup (skipped once dropped); an error is kept for its
        wait."""
        if not job.cancelled:
            try:
                if job.counts is None:
                    job.run(job.ids)
                else:
                    job.run(job.ids, job.counts)
            except BaseException as exc:  # surfaces at this layer's wait()
                job.error = exc
        job.finished = perf_counter()

    def _finish(self, job: Job) -> None:
        """Under the lock: the job is done; whoever waits for it (or for a
        slot) is woken, and the worker if there is work for it."""
        job.done, self._running = True, False
        self._wake_all()
        if self._stopping or self._queue and self._queue[0].woken:
            # only then: a woken worker that finds nothing still takes the
            # GIL from the thread doing the work
            self._work.notify()

    def _run_worker(self) -> None:
        """The worker: the oldest queued job it was told to run whenever no
        lookup runs; after close() it drains the queue (dropped jobs are
        only marked done)."""
        while True:
            with self._work:
                self._work.wait_for(lambda: not self._running and (
                    self._stopping or bool(self._queue) and self._queue[0].woken))
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = True
            job.started = perf_counter()
            self._run(job)
            with self._mutex:
                self._finish(job)
