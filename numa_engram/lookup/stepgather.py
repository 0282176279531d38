"""StepGather: a decode step's lookups of several layers, Engram shards and
PLE shards alike, in one C call (``ne_gather_step``): the GIL released and
cffi crossed once per step, not once per layer.

Built once from ``(table, out)`` pairs (a table, or its ``rows``; ``out``
what the table's ``bind_lookup`` or ``prepare_out`` takes: a BF16 tensor,
an Engram ``(rows, scales)`` pair for packed rows, or a ``PreparedOutput``),
each output checked there once: its shape, dtype and layout, apart from
every other output and from every layer's table mapping.  A call passes
the step's ids, one array per layer, in the order of the pairs (an Engram
layer's ``[tokens, n_hash_cols]`` hash ids, a PLE layer's ids of its
output's shape but the last), and each layer runs its table's own kernel,
row for row what its one-layer lookup computes; the kernel checks every id
(a bad one is a LookupIdError naming the layer, the token, the column and
the id), refuses a closed table, and refuses an output over its layer's
ids or table, and the call refuses one over another layer's ids, before
any layer runs.  Layers before a failed one have their rows.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from ..bindings import lookupkernel, native
from ..errors import NumaEngramError, PrefetchError, SpecError, StorageError
from ..literals import IdFormat, check_id_format
from .outputs import Named, PreparedOutput, check_apart
from .ple import PLERows, PLEStepLayer
from .shardrows import ShardRows, StepLayer

_INT64 = np.dtype(np.int64)
_from_buffer = native.ffi.from_buffer


def bind_step(layers: Sequence[tuple[Any, Any]], *,
              id_format: IdFormat = "bucket") -> StepGather:
    """``StepGather(layers, id_format=id_format)``."""
    return StepGather(layers, id_format=id_format)


def _step_layer(source: Any, out: Any, id_format: IdFormat) -> StepLayer | PLEStepLayer:
    """The layer of ``source`` (a table or its rows) into ``out``; a closed
    table is refused (a PLE table's rows are then an empty stand-in)."""
    if getattr(source, "closed", False) is True:
        raise StorageError(f"layer {getattr(source, 'layer_id', '?')}'s table is closed; a "
                           "step gathers from open tables (create or attach it again)")
    rows = getattr(source, "rows", source)
    if isinstance(rows, ShardRows):
        packed = isinstance(out, tuple) or isinstance(out, PreparedOutput) and out.packed
        return rows.step_layer(out, packed=packed, id_format=id_format)
    if isinstance(rows, PLERows):
        return rows.step_layer(out)
    raise SpecError(f"a step gather's layers are Engram or PLE tables (or their rows), got "
                    f"{type(source).__name__}")


class StepGather:
    """A step's lookups of ``layers`` (``(table, out)`` pairs) in one C
    call; ``id_format``: what the Engram layers' hash ids count.  Call it
    with the step's ids (one per layer, in order); it returns the outputs
    (``results``: the same tuple each call, the rows in them).  One thread
    at a time calls it (a second at once gets PrefetchError)."""

    def __init__(self, layers: Sequence[tuple[Any, Any]], *,
                 id_format: IdFormat = "bucket") -> None:
        check_id_format(id_format)
        if not layers:
            raise SpecError("a step gather needs at least one (table, out) layer")
        self._layers = [_step_layer(source, out, id_format) for source, out in layers]
        self.names = [_name(source, layer, i)
                      for i, ((source, _), layer) in enumerate(zip(layers, self._layers))]
        for name, layer in zip(self.names, self._layers):
            if 0 in layer.ids_shape:
                raise SpecError(f"{name}'s out holds no rows; a step looks up at least one "
                                "token")
        _check_outputs(self.names, self._layers)
        self.results = tuple(layer.result for layer in self._layers)
        n = len(self._layers)
        self._shapes = [layer.ids_shape for layer in self._layers]
        # an Engram layer's row stride of contiguous ids: its column count
        self._contiguous = [shape[-1] if layer.family == "Engram" else 1
                            for shape, layer in zip(self._shapes, self._layers)]
        self._strides = list(self._contiguous)
        self._keep: list[Any] = [None] * n  # a call's ids (and their buffers) while it runs
        self._busy = threading.Lock()
        self._pid = -1
        self._step = lookupkernel.StepKernel(n)
        self._bind()

    def _bind(self) -> None:
        """Fill the C step with each layer's kernel, bound in this process
        (again in a forked child: the parent's kernels name its threads)."""
        step = self._step
        for i, layer in enumerate(self._layers):
            layer.fill(step, i)
            step.strides[i] = self._strides[i]
        self._pid = lookupkernel.this_pid()

    def __len__(self) -> int:
        return len(self._layers)

    def __call__(self, ids: Sequence[Any]) -> tuple[Any, ...]:
        """Every layer's rows for its ids (``ids[i]`` for layer ``i``) into
        its output, in one C call; returns ``results``."""
        if not self._busy.acquire(blocking=False):
            raise PrefetchError("a StepGather was called from two threads at once; make one "
                                "per thread")
        try:
            if self._pid != lookupkernel.this_pid():
                self._bind()
            if len(ids) != len(self._layers):
                raise SpecError(f"{len(ids)} ids arrays for a step of {len(self._layers)} "
                                "layers; pass one per layer, in the order bound")
            step, keep, shapes = self._step, self._keep, self._shapes
            slots, strides, contiguous = step.ids, self._strides, self._contiguous
            for i, layer_ids in enumerate(ids):
                # the common case (C-contiguous int64 of the bound shape) in a
                # type check and the buffer (the decode budget, docs/design.md)
                buffer = None
                if type(layer_ids) is np.ndarray and layer_ids.dtype is _INT64 and \
                        layer_ids.shape == shapes[i]:
                    try:
                        buffer = _from_buffer(layer_ids)
                        stride = contiguous[i]
                    except ValueError:  # strided: the layer's own checks
                        pass
                if buffer is None:
                    layer_ids, buffer, stride = self._ids_of(i, layer_ids)
                keep[i] = (layer_ids, buffer)
                slots[i] = buffer
                if stride != strides[i]:
                    strides[i] = step.strides[i] = stride
            failed = step.run()
            if failed >= 0:
                self._failed(failed)
        finally:
            self._busy.release()
        return self.results

    def _ids_of(self, i: int, layer_ids: Any) -> tuple[Any, Any, int]:
        """Layer ``i``'s ids as its own lookup checks them (widened, strided,
        refused), the refusal named and counted as the layer's."""
        layer = self._layers[i]
        try:
            return layer.ids_arg(layer_ids)
        except Exception as exc:
            layer.count_refused(exc)
            _reraise_named(exc, self.names[i])

    def _failed(self, i: int) -> NoReturn:
        """The error of layer ``i``'s failure in the last run: the layer's
        own lookup's, its name in front."""
        code, other = lookupkernel.StepKernel.failure()
        layer, name = self._layers[i], self.names[i]
        if code == lookupkernel.NE_OVERLAP and other >= 0:
            ids, buffer = self._keep[other]
            start = int(native.ffi.cast("uintptr_t", buffer))
            end = start + np.asarray(ids).nbytes
            check_apart(tuple((f"{name}'s {what}", span) for what, span in layer.spans),
                        ((f"{self.names[other]}'s ids", (start, end)),))
            raise SpecError(f"{name}'s out shares bytes with {self.names[other]}'s ids")
        _, buffer = self._keep[i]
        try:
            layer.failed(code, buffer, self._strides[i])
        except Exception as exc:
            _reraise_named(exc, name)


def _name(source: Any, layer: StepLayer | PLEStepLayer, i: int) -> str:
    """How messages name step layer ``i``: its family and layer id."""
    layer_id = getattr(source, "layer_id", getattr(layer, "layer_id", None))
    return f"{layer.family} layer {layer_id} (step layer {i})" if layer_id is not None \
        else f"{layer.family} step layer {i}"


def _check_outputs(names: Sequence[str], layers: Sequence[StepLayer | PLEStepLayer]) -> None:
    """No layer's output shares a byte with another's, or with any layer's
    table mapping (its own was checked by its table)."""
    written: list[Named] = [(f"{name}'s {what}", span)
                            for name, layer in zip(names, layers) for what, span in layer.spans]
    mappings = {layer.mapped[1]: f"{name}'s table mapping" for name, layer in zip(names, layers)}
    check_apart(written, [(what, span) for span, what in mappings.items()])


def _reraise_named(exc: Exception, name: str) -> NoReturn:
    """``exc`` again with the layer's name in front (the same class)."""
    if isinstance(exc, NumaEngramError):
        raise type(exc).rebuild(f"{name}: {exc}", exc.fields()) from exc
    raise exc
