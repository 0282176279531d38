"""CPUScheduler: the prefetch scheduler's CPU backend.

A lookup of a layer
whose last wait came sooner after its submit returned than ``HANDOFF_S``
(a lookup run in its submit is no lead), so that running ahead would have
hidden less than the hand-off to the worker and back costs, is not handed
to an idle worker: a table's runs in its ``submit`` when no job is in
flight and a slot is free (no job is made for it: it leaves a record of
its rows, error and times, which its ``wait`` only takes), else its
``wait`` runs it on the waiting thread (with any such lookups queued before
it, in order).  Every other lookup runs on the worker, ahead
of its wait.

Threads: every state change happens under the scheduler's lock, except a
wait's taking of a lookup run in its submit: one ``dict.pop`` of an
immutable record (atomic: exactly one of that wait, a reset and a close
gets it).
"""

from __future__ import annotations

import threading
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any

from ..errors import PrefetchError
from .prefetch import Job, Lane, PrefetchScheduler, Staged
from .prefetchmetrics import HANDOFF_S, SETTLE_AT, LayerMetrics

if TYPE_CHECKING:
    from .prefetch import Rows

# A lookup that ran in its submit (a table's, with no job in flight and its
# wait due at once: a decode step's), which needs no job: (the rows wait()
# returns, its error or None, the clock when it started and when it ended,
# its layer's metrics).  Its rows wait in the staging buffer; the record
# waits in the scheduler's ``_ran`` until the layer's wait takes it, and
# holds one of the ``depth`` slots meanwhile.
_Ran = tuple[Any, BaseException | None, float, float, LayerMetrics]


class CPUScheduler(PrefetchScheduler):
    """``PrefetchScheduler(..., backend="cpu")``."""

    backend = "cpu"

    def _start(self) -> None:
        self._spare: dict[Any, Job] = {}  # a layer's collected job, for its next submit
        # by layer, the lookups that ran in their submit, not yet waited for
        # (each holds a slot too): put in under the lock, taken out by their
        # wait with one dict.pop and no lock (atomic, and the record is
        # immutable: exactly one of a wait, a reset and a close takes it)
        self._ran: dict[Any, _Ran] = {}
        self._work = threading.Condition(self._mutex)  # the worker: a job queued, or stop
        self._stopping = False
        self._queue: deque[Job] = deque()  # submitted, not started, in order
        self._running = False  # a lookup runs (on the worker or a waiter)
        self._worker = threading.Thread(target=self._run_cpu, name="engram-prefetch",
                                        daemon=True)
        self._worker.start()

    def submit(self, layer: Any, hash_ids: Any, counts: Any = None) -> None:
        lane, (out, run, now_ok) = self._staged_rows(layer, len(hash_ids))
        mutex = self._mutex
        mutex.acquire()
        try:
            # a decode step's case, in the fewest steps (the decode budget):
            # a table's lookup with no job in flight (none queued,
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
        self._submit_job(layer, lane, hash_ids, out, run, None if now_ok else counts)

    def _submit_job(self, layer: Any, lane: Lane, hash_ids: Any, out: Any, run: Any,
                    counts: Any) -> None:
        """submit() of a lookup that goes through a job: queued for the
        worker (a long lead, or behind its work) or for its waiter (the
        waiter runs it when it is next), or launched on the side stream."""
        job = self._spare.pop(layer, None)  # the layer's last job, collected by its wait
        now = perf_counter()
        if job is None:
            job = Job(layer, hash_ids, out, run, now, counts=counts)
        else:
            job.rearm(hash_ids, out, run, now, counts)
        mutex = self._mutex
        mutex.acquire()  # check and claim the layer in one step
        try:
            self._claim(job, self._ran)  # refused, or waits for a slot
            # under the lock: close() stops the worker after it
            queue = self._queue
            queue.append(job)
            if lane.metrics.ahead_pays() or self._running or \
                    len(queue) > 1 and queue[-2].woken:
                job.woken = True  # the worker runs it (after what it has)
                self._work.notify()
        finally:
            mutex.release()

    def wait(self, layer: Any, *, check_errors: bool = False,
             timeout_s: float | None = None) -> Rows:
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
            collect = job is not None and job.done and not job.cancelled
            if job is not None and collect:
                self._retire_locked(job)
        finally:
            mutex.release()
        if job is None or not collect:
            return self._wait_slowly(layer, check_errors, timeout_s)
        called = perf_counter()
        self._account(job, called, called, job.finished - job.started)
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
        worker was told to, else waited for) or dropped."""
        mutex = self._mutex
        mutex.acquire()
        try:
            if self._closed:
                self._check_open()
            job = self._inflight.get(layer)
            # settled in this round trip: the job is done (or dropped) and is
            # retired here; or it is next, no worker was
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
        elif not self._wait_cpu(job, timeout_s):
            with self._mutex:
                self.metrics[layer].timeouts += 1
            raise PrefetchError(f"the lookup of layer {layer!r} did not finish in {timeout_s} s;"
                                " it is still in flight: wait again or reset()")
        try:
            if job.cancelled:
                raise PrefetchError(f"the lookup of layer {layer!r} was dropped: the scheduler "
                                    "was closed or reset while it was awaited")
            self._account(job, called, called if done else job.finished if here else
                          perf_counter(), job.finished - job.started)
            if job.error is not None:
                self.metrics[layer].errors += 1
                raise job.error
            if check_errors:
                self._check_device_errors(layer)
            return job.out
        finally:
            if not job.retired:  # (set by this thread when the lookup ran here)
                self._retire(job)
            if not job.cancelled:
                # retired and never cancelled: nothing refers to it now (a
                # reset or close only holds the jobs it cancelled), so the
                # layer's next submit reuses it
                job.ids = job.error = None
                self._spare[layer] = job

    def reset(self) -> None:
        with self._mutex:
            pending = self._cancel_all()
            self._ran.clear()  # done already: their slots are free at once
            for job in self._queue:  # the worker drains what no waiter will run now
                job.woken = True
            self._work.notify()
        for job in pending:
            self._wait_done(job)
            self._retire(job)

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._cancel_all()
            self._ran.clear()
            self._stopping = True
            self._work.notify()
        self._worker.join()  # skipped jobs and the running one set `done`

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

    def _wait_cpu(self, job: Job, timeout_s: float | None = None) -> bool:
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

    def _wait_for_worker(self, job: Job, timeout_s: float | None) -> bool:
        """Under the lock: make sure the worker runs what is queued, then wait
        for the job."""
        if not job.woken:
            for queued in self._queue:
                queued.woken = True
            self._work.notify()
        return self._sleep(lambda: job.done, timeout_s)

    def _wait_done(self, job: Job) -> None:
        with self._mutex:
            self._sleep(lambda: job.done)

    def _execute(self, job: Job, retire: bool = False, started: float | None = None) -> None:
        """Run the job's lookup (an error is kept for its wait), then mark
        it done (and with ``retire``, its layer and slot free: a waiter
        running its own lookup) in one lock round trip.  ``started``: the
        clock's reading just now, when the caller has one."""
        job.started = perf_counter() if started is None else started
        if not job.cancelled:
            try:
                if job.counts is None:
                    job.run(job.ids)
                else:
                    job.run(job.ids, job.counts)
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

