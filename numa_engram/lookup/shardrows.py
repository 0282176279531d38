"""ShardRows: the lookups of one Engram shard's rows, CPU and GPU.

It holds what a lookup needs and nothing of how the rows came to be: the
kernel's geometry (cast once), the kernel bound to its threads and CPUs,
the pooled outputs, the counters (CPU lookups counted by the kernel's
``TableState``; GPU launches and failures here) and the bad-id message.
``SharedEngramTable`` delegates its lookups here; the prefetch scheduler is
handed a table's ``rows`` and binds its staging buffers with
``bind_lookup``.  Every CPU lookup reaches the kernel through ``_run``, and
every id array through ``ids_for_kernel``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..bindings import lookupkernel, native
from ..errors import LookupIdError, SpecError, StorageError
from ..histogram import LOOKUP_BUCKETS
from ..literals import IdFormat, check_id_format
from ..model.sharding import ShardInfo, prefix_offsets
from ..model.spec import EngramSpec
from .cpu import bad_id_text, default_lookup_threads, id_base, ids_for_kernel
from .outputs import (
    Named,
    OutputPool,
    PreparedOutput,
    Span,
    array_span,
    check_apart,
    check_bf16_out,
    check_packed_pair,
    ids_span,
    packed_out,
    prepare_out,
)

if TYPE_CHECKING:
    import torch

    from .gpu import DeviceShard

    Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

_NULL = native.ffi.NULL
_INT64 = np.dtype(np.int64)
_from_buffer = native.ffi.from_buffer
_cast = native.ffi.cast


class ShardRows:
    """Lookups of ``shard``'s rows of ``layer_id`` (``weights`` uint8
    ``[rows, head_dim]``, ``scales`` ``[rows, scales_per_row]``, views the
    owner keeps mapped until ``close()``).  ``registration``: the CUDA
    registration of those rows, for ``lookup_cuda``; ``mapped``: the bytes
    of the mapping they lie in (None: theirs), which no ``out=`` may share."""

    def __init__(self, spec: EngramSpec, layer_id: int, shard: ShardInfo, weights: np.ndarray,
                 scales: np.ndarray, *, lookup_threads: int | None = None,
                 lookup_cpus: Sequence[int] = (), registration: Any = None,
                 tuning: lookupkernel.Tuning | None = None, mapped: Span | None = None) -> None:
        self.spec, self.layer_id, self.shard = spec, layer_id, shard
        if mapped is None:
            (w_start, w_end), (s_start, s_end) = array_span(weights), array_span(scales)
            mapped = min(w_start, s_start), max(w_end, s_end)
        self._mapped_span = mapped
        self._mapped: tuple[Named] = (("the table's mapping", mapped),)
        self.registration = registration
        self._weights: np.ndarray | None = weights
        self._scales: np.ndarray | None = scales
        self._bucket_sizes = np.asarray(
            spec.bucket_sizes(layer_id)[shard.head_start:shard.head_end], dtype=np.int64)
        # the kernel's fixed arguments, cast once: a call adds only ids and output
        self._geometry: lookupkernel.Geometry | None = lookupkernel.Geometry.of(
            weights, scales, prefix_offsets(self._bucket_sizes), self._bucket_sizes,
            self.id_base("global"), spec.block)
        self._kernel: lookupkernel.ShardKernel | None = None  # bound at the first lookup
        self._last_out: tuple[int, Any] = (0, _NULL)  # a caller's out=: (address, its cast)
        self._lookup_cpus = tuple(lookup_cpus)
        self._lookup_threads = default_lookup_threads(self._lookup_cpus) \
            if lookup_threads is None else max(1, int(lookup_threads))
        self._tuning = tuning
        self._n_cols, self._row_shape = spec.n_hash_cols, (shard.num_heads, spec.head_dim)
        self._scales_per_row = spec.head_dim // spec.block
        self._device_shard: DeviceShard | None = None
        self._closed = False
        # GPU lookups in flight (CPU ones: the kernel's count): close() waits
        # for them (they finish normally), on this condition
        self._active = 0
        self._idle = threading.Condition(threading.Lock())
        # lookup(ids) without out= reuses freed outputs (the pool's own lock)
        self._outputs = OutputPool()
        self._packed_pools = (OutputPool(packed=True), OutputPool(packed=True))  # rows, scales
        # the CPU lookups that ran are counted by the kernel (rows, time),
        # which refuses them once closed; here, under the lock, the GPU
        # launches and their rows, and the lookups that failed, by why
        self.state = lookupkernel.TableState(LOOKUP_BUCKETS)
        self._failures = {"bad_ids": 0, "failed": 0}
        self._gpu_lookups = self._gpu_rows = 0

    # --------------------------------------------------------- CPU lookups --
    def lookup(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
               packed: bool = False) -> Rows:
        """What ``SharedEngramTable.lookup`` documents."""
        global_ids = id_format == "global"
        if not global_ids and id_format != "bucket":
            check_id_format(id_format)
        try:
            ids, address, stride, tokens = ids_for_kernel(hash_ids, self._n_cols)
            if out is None and not packed:  # the default, a decode step's: pooled
                result, _, rows = self._outputs.take_with_buffer((tokens, *self._row_shape))
                scales = _NULL
            else:
                result, rows, scales = self._outputs_for(out, tokens, packed)
        except Exception as exc:
            self._count_refused(exc)
            raise
        self._run(address, tokens, stride, global_ids, rows, scales)
        return result

    def _outputs_for(self, out: Any, tokens: int, packed: bool) -> tuple[Any, Any, Any]:
        """(what the lookup returns, the kernel's rows and scales outputs)
        for ``out`` (a caller's tensor or pair, a PreparedOutput, or None
        with ``packed``).  The kernel refuses an output over the ids or the
        table (NE_OVERLAP: ``_overlap_error`` names them)."""
        shape = (tokens, *self._row_shape)
        if type(out) is PreparedOutput:
            if out.shape != shape or out.packed != packed:
                _prepared(out, shape, packed)  # (raises)
            return out.result, *out.args
        if packed:
            if out is None:
                return self._packed_outputs(shape)
            if not (isinstance(out, tuple) and len(out) == 2):
                packed_out(out, shape, self.spec.block)  # (raises, naming what it got)
            rows, scales = out
            check_packed_pair(rows, scales, shape, self.spec.block)
            # their addresses, not numpy views (~1 us a call)
            return out, _cast("uint8_t *", rows.data_ptr()), _cast("uint8_t *", scales.data_ptr())
        # a caller's tensor: its address, not a numpy view (~3 us a call)
        check_bf16_out(out, shape)
        start = out.data_ptr()
        last = self._last_out
        if last[0] != start:  # (a cast is ~0.15 us: a caller passes the same buffer)
            last = self._last_out = (start, _cast("uint16_t *", start))
        return out, last[1], _NULL

    def bind_lookup(self, out: Any, *, packed: bool = False,
                    id_format: IdFormat = "bucket") -> Callable[[Any], Rows]:
        """``lookup(ids, out=out, packed=packed, id_format=id_format)`` with
        everything but the ids bound once: ``out`` (``out.shape[0]``
        tokens) checked and cast here, so a call checks only the ids and runs
        the kernel (a staging buffer filled step after step: the prefetch
        scheduler's).  Calls return what ``lookup`` returns, raise what it
        raises and are counted alike."""
        check_id_format(id_format)
        prepared = out if isinstance(out, PreparedOutput) else self.prepare_out(out, packed=packed)
        result = _prepared(prepared, prepared.shape, packed)[0]  # (packed checked)
        prepared.check_table(self._mapped_span)  # now, not at the first call
        rows, scales = prepared.args
        tokens, n_cols, run = prepared.shape[0], self._n_cols, self._run
        global_ids, want = id_format == "global", (tokens, n_cols)

        def lookup_into(hash_ids: Any) -> Rows:
            # ids_for_kernel's common case, inline (the decode budget): the
            # kernel checks the ids apart from the output
            if type(hash_ids) is np.ndarray and hash_ids.dtype is _INT64 and \
                    hash_ids.shape == want:
                try:
                    address = _from_buffer(hash_ids)
                except ValueError:  # strided: the general path below
                    address = None
                if address is not None:
                    run(address, tokens, n_cols, global_ids, rows, scales)
                    return result
            try:
                ids, address, stride, given = ids_for_kernel(hash_ids, n_cols)
                if given != tokens:
                    raise SpecError(f"{given} tokens of ids for a lookup bound to an "
                                    f"output of {tokens}; bind one for this many tokens")
            except Exception as exc:
                self._count_refused(exc)
                raise
            run(address, tokens, stride, global_ids, rows, scales)
            return result
        return lookup_into

    def prepare_out(self, out: Any, *, packed: bool = False) -> PreparedOutput:
        """``out`` (what ``lookup(ids, out=out, packed=packed)`` takes, for
        ``out.shape[0]`` tokens) checked and cast once: pass the result as
        ``out=`` to every lookup of that many tokens into it (a staging
        buffer), and the per-call checks are skipped."""
        rows = out[0] if packed and isinstance(out, tuple) and out else out
        if not hasattr(rows, "shape") or len(rows.shape) == 0:
            raise SpecError("out must be " + ("a (rows, scales) pair of uint8 CPU tensors"
                                               if packed else "a CPU bfloat16 tensor") +
                             f" [tokens, {', '.join(map(str, self._row_shape))}], got "
                             f"{type(out).__name__}")
        return prepare_out(out, (int(rows.shape[0]), *self._row_shape), packed, self.spec.block,
                           self._mapped)

    def _run(self, address: Any, tokens: int, stride: int, global_ids: bool, rows: Any,
             scales: Any) -> None:
        """The kernel over ids and outputs already cast: the one call site.
        Bad ids raise LookupIdError, a closed table StorageError, an output
        over the ids or the table SpecError (the kernel's check); failures
        are counted (the kernel counts the lookups, with their time)."""
        kernel = self._kernel
        try:
            if kernel is None:
                kernel = self._shard_kernel()
            bad = kernel.run(address, tokens, stride, global_ids, rows, scales)
        except StorageError:  # closed: not a lookup
            raise
        except BaseException:
            self._count_failure("failed")
            raise
        if bad:
            self._kernel_failed(kernel, bad, tokens, global_ids,
                                (address, stride, rows, scales))

    def _kernel_failed(self, kernel: lookupkernel.ShardKernel, bad: int, tokens: int,
                       global_ids: bool,
                       call: tuple[Any, int, Any, Any] | None = None) -> NoReturn:
        """The kernel's call of ``tokens`` tokens returned ``bad`` (not 0):
        LookupIdError for bad ids, StorageError once closed, SpecError
        naming the buffers for an output over the ids or the table (``call``:
        the call's ids address, stride and outputs), else why it failed;
        counted."""
        try:
            if bad == lookupkernel.NE_OVERLAP and call is not None:
                self._overlap_error(tokens, *call)
            count, first, value = kernel.bad_ids(bad, tokens)
            t, h = divmod(first, self.shard.num_heads)
            base = self.id_base("global") if global_ids else None
            raise LookupIdError(bad_id_text(value, t, self.shard.head_start + h,
                                             int(self._bucket_sizes[h]), base, h, count))
        except LookupIdError:
            self._count_failure("bad_ids")
            raise
        except StorageError:  # closed: not a lookup
            raise
        except BaseException:
            self._count_failure("failed")
            raise

    def _overlap_error(self, tokens: int, address: Any, stride: int, rows: Any,
                       scales: Any) -> None:
        """The SpecError naming the buffers of a call the kernel refused
        (NE_OVERLAP): its outputs and the ids or the table's mapping."""
        n = tokens * self._row_shape[0] * self._row_shape[1]
        written: tuple[Named, ...] = (("out", _span(rows, 2 * n)),)
        if scales != _NULL:
            written = (("out's rows", _span(rows, n)),
                       ("out's scales", _span(scales, n // self.spec.block)))
        check_apart(written, (("the ids", ids_span(address, tokens, stride, self._n_cols)),
                              ("the table's mapping", self._mapped_span)))

    def step_layer(self, out: Any, *, packed: bool = False,
                   id_format: IdFormat = "bucket") -> StepLayer:
        """This shard's part of a step gather (``lookup.stepgather``): its
        kernel and ``out`` (what ``bind_lookup`` takes) checked and cast once."""
        check_id_format(id_format)
        prepared = out if isinstance(out, PreparedOutput) else self.prepare_out(out, packed=packed)
        _prepared(prepared, prepared.shape, packed)
        prepared.check_table(self._mapped_span)
        return StepLayer(self, prepared, (prepared.shape[0], self._n_cols), id_format == "global")

    def _packed_outputs(self, shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
        """Pooled (rows, scales) uint8 tensors for a packed lookup, and the
        kernel's buffers of them."""
        rows, _, rows_buffer = self._packed_pools[0].take_with_buffer(shape)
        scales, _, scales_buffer = self._packed_pools[1].take_with_buffer(
            (*shape[:2], self._scales_per_row))
        return (rows, scales), rows_buffer, scales_buffer

    # ------------------------------------------------------------ threads --
    @property
    def lookup_cpus(self) -> tuple[int, ...]:
        return self._lookup_cpus

    @lookup_cpus.setter
    def lookup_cpus(self, cpus: Sequence[int]) -> None:
        self._lookup_cpus = tuple(cpus)
        self._drop_kernel()  # its threads are pinned to the old CPUs

    @property
    def lookup_threads(self) -> int:
        return self._lookup_threads

    @lookup_threads.setter
    def lookup_threads(self, threads: int) -> None:
        self._lookup_threads = max(1, int(threads))
        self._drop_kernel()

    @property
    def tuning(self) -> lookupkernel.Tuning | None:
        """The kernel's thresholds (None: the measured defaults), for
        benchmarks and tests: set, later calls bind a kernel with them."""
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: lookupkernel.Tuning | None) -> None:
        if tuning is not None:
            tuning.struct()  # refused here, not at the next lookup
        self._tuning = tuning
        self._drop_kernel()

    def _shard_kernel(self) -> lookupkernel.ShardKernel:
        """This shard's kernel, bound to its threads and CPUs (made at the
        first lookup; its workers stop with close())."""
        with self._idle:
            self._check_open()
            if self._kernel is None:
                assert self._geometry is not None  # (None only once closed)
                self._kernel = lookupkernel.ShardKernel(self._geometry, self._lookup_threads,
                                                        self._lookup_cpus, self.shard.head_start,
                                                        state=self.state, tuning=self._tuning,
                                                        mapped=self._mapped_span,
                                                        ids_cols=self._n_cols)
            return self._kernel

    def _drop_kernel(self, stop: bool = False) -> None:
        """Forget the kernel; the next lookup binds anew.  Its threads stop
        when the last lookup still using it lets go of it (a setter may run
        while other threads look up: stopping them under a running call
        would free its pool), or at once with ``stop`` (close(), when no
        lookup runs)."""
        kernel, self._kernel = self._kernel, None
        if kernel is not None and stop:
            kernel.close()

    def id_base(self, id_format: IdFormat) -> np.ndarray | None:
        """Each shard head's first global row (None for bucket ids)."""
        return id_base(self.spec, self.layer_id, self.shard.head_start, self.shard.head_end,
                       id_format)

    # --------------------------------------------------------- GPU lookups --
    def device_view(self) -> DeviceShard:
        """Zero-copy CUDA views of this shard (needs the registration)."""
        from .gpu import DeviceShard

        self._check_open()
        if self.registration is None:
            raise StorageError("the table is not registered with CUDA; create it with "
                               "register_device=<cuda device index>")
        if self._device_shard is None:
            assert self._weights is not None and self._scales is not None  # (open)
            self._device_shard = DeviceShard(self._weights, self._scales,
                                             self.registration.device, self.shard.head_start,
                                             self._bucket_sizes, self.spec.block,
                                             self.registration, self.id_base("global"))
        return self._device_shard

    def lookup_cuda(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
                    packed: bool = False, max_sms: int | None = None,
                    background: bool = False) -> Rows:
        """What ``SharedEngramTable.lookup_cuda`` documents."""
        self._enter_lookup()
        rows = -1  # -1: failed, not counted
        try:
            result = self.device_view().lookup(hash_ids, out=out, id_format=id_format,
                                               packed=packed, max_sms=max_sms,
                                               background=background)
            rows = hash_ids.shape[0] * self.shard.num_heads
            return result
        finally:
            self._leave_lookup(rows)

    def check_device_errors(self) -> None:
        """Raise LookupIdError for bad ids the GPU lookups met since the last
        check (reads the device record: one sync), and clear it."""
        if self._device_shard is not None:
            self._device_shard.check_errors()

    # ----------------------------------------------------------- counting --
    def counts(self) -> tuple[int, int, float, list[int], dict[str, int]]:
        """(lookups, rows, CPU seconds, the CPU latency buckets, failures by
        why): CPU lookups and GPU launches together."""
        with self._idle:
            failures, gpu_lookups, gpu_rows = dict(self._failures), self._gpu_lookups, \
                self._gpu_rows
        lookups, rows, seconds, buckets = self.state.counts()
        return lookups + gpu_lookups, rows + gpu_rows, seconds, buckets, failures

    def _count_refused(self, exc: Exception) -> None:
        """A lookup refused before the kernel (``exc``), counted; a closed
        table raises StorageError instead."""
        self._enter_lookup()
        self._leave_lookup(-1, "bad_ids" if isinstance(exc, LookupIdError) else "failed")

    def _enter_lookup(self) -> None:
        """A GPU lookup (or a failed CPU one, to be counted) begins: refused
        once closed; close() waits until it ends.  (CPU lookups that run are
        counted, and refused once closed, by the kernel.)"""
        with self._idle:
            self._check_open()
            self._active += 1

    def _leave_lookup(self, rows: int, failure: str = "failed") -> None:
        """A lookup from ``_enter_lookup`` ended: a GPU launch of ``rows``
        rows, or (rows -1) one that failed, counted as ``failure``; wakes a
        waiting close()."""
        with self._idle:
            self._active -= 1
            if rows < 0:
                self._failures[failure] += 1
            else:
                self._gpu_lookups += 1
                self._gpu_rows += rows
            if self._closed:
                self._idle.notify_all()

    def _count_failure(self, failure: str) -> None:
        """A CPU lookup that reached the kernel failed (bad ids, an error)."""
        with self._idle:
            self._failures[failure] += 1

    # -------------------------------------------------------------- close --
    def close(self) -> None:
        """Wait for the GPU lookups running, refuse later lookups (running
        CPU ones finish), stop the threads and let go of the rows
        (idempotent)."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._active == 0)  # GPU lookups
        self.state.close()  # CPU lookups: later ones refused, running ones finish
        self._drop_kernel(stop=True)  # no lookup runs now: the threads stop here
        self._device_shard = self._geometry = self._weights = self._scales = None
        self.registration = None

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the table is closed")


def _span(pointer: Any, nbytes: int) -> Span:
    """The bytes ``[pointer, pointer + nbytes)`` of a cast output."""
    start = int(native.ffi.cast("uintptr_t", pointer))
    return start, start + nbytes


class StepLayer:
    """A shard's layer of a step gather (``ShardRows.step_layer``): what
    ``lookup.stepgather`` fills the C step with, the ids' shape a call
    takes, and the shard, which names a failure as its own lookup would."""

    family = "Engram"

    def __init__(self, rows: ShardRows, prepared: PreparedOutput, ids_shape: tuple[int, int],
                 global_ids: bool) -> None:
        self.rows, self.prepared, self.ids_shape = rows, prepared, ids_shape
        self.global_ids, self.result, self.spans = global_ids, prepared.result, prepared.spans
        self.mapped: Named = ("the table's mapping", rows._mapped_span)
        self.layer_id = rows.layer_id
        self._kernel: lookupkernel.ShardKernel | None = None  # the one fill() bound

    def fill(self, step: lookupkernel.StepKernel, i: int) -> None:
        """Layer ``i`` of ``step``: the shard's kernel (bound here, in this
        process) into the prepared output."""
        self._kernel = self.rows._shard_kernel()
        step.set_engram(i, self._kernel, self.ids_shape[0], self.global_ids,
                        *self.prepared.args)

    def ids_arg(self, hash_ids: Any) -> tuple[Any, Any, int]:
        """(the ids kept alive, the kernel's view, their row stride) of a
        call's ids, checked as ``lookup`` checks them; their token count
        must be the output's."""
        ids, address, stride, given = ids_for_kernel(hash_ids, self.ids_shape[1])
        if given != self.ids_shape[0]:
            raise SpecError(f"{given} tokens of ids for Engram layer {self.layer_id}'s output "
                            f"of {self.ids_shape[0]}; bind a step for this many tokens")
        return ids, address, stride

    def failed(self, code: int, address: Any, stride: int) -> NoReturn:
        """The error the shard's own lookup raises for the kernel's ``code``
        (``address``, ``stride``: the call's ids), counted as its own."""
        assert self._kernel is not None  # (a step fills its layers before it runs)
        self.rows._kernel_failed(self._kernel, code, self.ids_shape[0], self.global_ids,
                                 (address, stride, *self.prepared.args))

    def count_refused(self, exc: Exception) -> None:
        """A call's ids refused before the kernel, counted as the shard's."""
        self.rows._count_refused(exc)


def _prepared(out: PreparedOutput, shape: tuple[int, ...], packed: bool) -> tuple[Any, Any, Any]:
    """A prepared output's (result, bits, buffer), if it fits the call."""
    if out.shape != shape or out.packed != packed:
        raise SpecError(f"a prepared output of shape {list(out.shape)} (packed={out.packed}) "
                        f"for a lookup of shape {list(shape)} (packed={packed}); prepare one "
                        "for this many tokens")
    return out.result, out.bits, out.buffer
