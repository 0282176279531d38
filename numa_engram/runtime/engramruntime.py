"""EngramRuntime: the Engram layers of one model replica rank, from a
model directory, one call per step.

What it wires (each piece is also public on its own): the token map and
the spec from the directory (``ModelDirectory``), the sharing groups from
where the ranks really are (``sharing_groups``), one table per Engram
layer for this rank's TP shard (``SharedEngramTable.create``, loaded from
the directory's checkpoint), the per-request hashing (``HashState``), the
lookups issued ahead in layer order (``PrefetchScheduler``) and the TP
gather (``HeadGather``).

A step, as vLLM 0.31.0's Engram runs one::

    rt.begin_step(token_ids, slots, positions)   # hash every layer, submit lookups
    rows = rt.embed(layer_id)                    # at the layer: [T, n_hash_cols, head_dim]

Every rank of a replica (its TP ranks) passes the same tokens; in the
DP-sharded mode every replica of the EDP group takes part in every step
(an idle one with no tokens).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from ..errors import PrefetchError, SpecError, TopologyError
from ..groups.group import Group
from ..host.topology import Topology
from ..literals import DEFAULT_DIRECTORY, RUNTIME_SHARING, PageSize, RuntimeSharing
from ..lookup.prefetch import PrefetchScheduler
from ..lookup.scheduler import Scheduler
from ..model.hashstate import HashState
from ..tables.request import TableOptions
from .layers import (
    RuntimeLayer,
    attached_layer,
    make_layer,
    runtime_groups,
    service_path,
)
from .modeldir import ModelDirectory
from .tpgather import HeadGather, TPGroup, head_part

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

UNKNOWN_LOOKBACK_ID = -1  # what vLLM's runner puts in a look-back window where it has no id


class EngramRuntime:
    """Use ``EngramRuntime.from_pretrained(model_dir, ...)``; then
    ``begin_step`` and ``embed`` every step, ``release``/``restore`` as
    requests end and resume, ``close()`` at the end (or ``with``).

    One thread drives a step: a step begun by one thread is embedded by
    that thread, and two calls at once (from any threads) are refused with
    a PrefetchError rather than serialised, since interleaved steps would
    hand each thread the other's rows.  Any thread may begin the next step
    once the last one's layers are embedded."""

    def __init__(self, model: ModelDirectory, layers: dict[int, RuntimeLayer],
                 hash_state: HashState, scheduler: Scheduler, gather: HeadGather, *,
                 sharing: str, tp: TPGroup, edp: Group | None, max_tokens: int,
                 device: int | None, phases: dict[str, float]) -> None:
        self.model, self.spec = model, model.spec
        self.layer_ids: tuple[int, ...] = tuple(layers)
        self._layers, self.hash_state = layers, hash_state
        self._scheduler, self._gather = scheduler, gather
        self.sharing, self.tp, self._edp = sharing, tp, edp
        self.max_tokens, self.device = max_tokens, device
        self.startup_s = dict(phases)
        self.service: str | None = None  # the table service's socket the tables came from
        self._counts: list[int] | None = None  # this step's EDP token counts, if given
        self._pending: set[int] = set()  # layers submitted this step, not yet embedded
        self._busy = threading.Lock()  # held by the one call in progress
        self._step_thread: int | None = None  # the thread whose step is pending
        self._steps = self._tokens = 0
        self._hash_s = self._gather_s = 0.0
        self._closed = False

    # ---------------------------------------------------------- startup --
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, *, tp_group: Any = None,
                        world_group: Any = None, sharing: RuntimeSharing = "auto",
                        edp_group: Any = None, placement: str = "gpu-local",
                        page_size: PageSize | int = "4K", device: int | None = None,
                        max_tokens: int = 8192, max_requests: int = 256,
                        sequence_parallel: bool = False, background: bool = True,
                        tokenizer: Any = None, directory: str = DEFAULT_DIRECTORY,
                        timeout_s: float = 300.0, load_threads: int | None = None,
                        service: str | None = None) -> EngramRuntime:
        """Collective: every rank of ``world_group`` (default: the whole
        world, when torch.distributed is initialised) calls it with the same
        arguments.

        tp_group: the stack's TP group (a ProcessGroup, a vLLM
        GroupCoordinator, or None: TP 1).  sharing: ``dp_shared`` (one copy
        per node-local group of DP peers with the same TP rank; fails when
        it cannot share), ``auto`` (shares when it can, else independent
        copies, with a warning), ``independent`` (a copy per rank) or
        ``dp_sharded`` (the EDP group's members each hold a slice of the TP
        rank's heads and exchange rows every step).  edp_group: the
        node-local EDP group for ``dp_sharded`` (None: formed from where the
        ranks are); for the sharing modes an optional limit (ranks outside
        it never share with this one).  device: a CUDA index: tables are
        registered for it and looked up on it.  max_tokens: the most tokens
        of one step (the staging buffers' size); max_requests: request slots
        of the hashing.  sequence_parallel: ``embed`` returns this rank's
        window of ``ceil(T / tp)`` tokens with every head.  tokenizer: a
        tokenizers or transformers tokenizer (None: the directory's
        tokenizer.json).  service: a table service's socket path
        (``numa-engram serve``): attach its tables instead of building them
        (O(1): a restart costs no load); ``"auto"``: the service at
        ``$NUMA_ENGRAM_SOCKET`` (default ``/run/numa-engram/engram.sock``)
        when every rank reaches one that holds this model, else build;
        ``mode_report()["source"]`` says which."""
        started = time.perf_counter()
        if sharing not in RUNTIME_SHARING:
            raise SpecError(f"sharing must be one of {RUNTIME_SHARING}, got {sharing!r}")
        _check_count("max_tokens", max_tokens, MAX_STEP_TOKENS)
        _check_count("max_requests", max_requests, MAX_REQUESTS)
        if device is not None and sharing == "dp_sharded":
            raise TopologyError("the DP-sharded exchange runs on host tensors (gloo): use "
                                "sharing='dp_shared' with device=, or device=None")
        model = ModelDirectory.open(model_dir, tokenizer)
        tp = TPGroup.of(tp_group)
        head_part(model.spec.n_hash_cols, tp.size)  # refuses a TP size vLLM refuses
        phases = {"read": time.perf_counter() - started}
        socket_path = service_path(service, sharing, model, tp, page_size, world_group,
                                   timeout_s)
        group, edp = (None, None) if socket_path else runtime_groups(
            sharing, world_group, edp_group, tp.rank, device, directory, timeout_s)
        # what every layer's table needs, found once: the checkpoint's
        # tensors (refused before any table is made) and the host's topology
        plans = {} if socket_path else model.checkpoint_plans()
        options = TableOptions(placement=placement, page_size=page_size, directory=directory,
                               timeout_s=timeout_s, load_threads=load_threads,
                               register_device=device,
                               topology=None if socket_path else Topology.detect())
        layers: dict[int, RuntimeLayer] = {}
        try:
            for layer in model.spec.layer_ids:
                if socket_path:
                    layers[layer] = attached_layer(model, layer, tp, socket_path, page_size,
                                                   device)
                else:
                    layers[layer] = make_layer(model, layer, tp, group, edp, sharing,
                                               max_tokens, plans[layer], options)
                _add_phases(phases, layers[layer].table.startup_phases)
            hash_state = HashState(model.spec, max_requests, token_map=model.token_map,
                                   dead_ids=model.dead_ids)
            runtime = cls._assemble(model, layers, hash_state, tp, edp, sharing, max_tokens,
                                    device, sequence_parallel, background, phases)
            runtime.service = socket_path
        except BaseException:
            for made in layers.values():
                made.table.close()
            raise
        runtime.startup_s["total"] = time.perf_counter() - started
        log.info("Engram runtime: %s", runtime.mode_report())
        return runtime

    @classmethod
    def _assemble(cls, model: ModelDirectory, layers: dict[int, RuntimeLayer],
                  hash_state: HashState, tp: TPGroup, edp: Group | None, sharing: str,
                  max_tokens: int, device: int | None, sequence_parallel: bool,
                  background: bool, phases: dict[str, float]) -> EngramRuntime:
        spec = model.spec

        def sharded_lookup(made: RuntimeLayer) -> Callable[..., Any]:
            assert made.sharded is not None
            sharded = made.sharded

            def run(ids: Any, out: Any, counts: Sequence[int] | None = None) -> Any:
                return sharded.lookup(ids, id_format="global", counts=counts, out=out)
            return run

        sources = {layer: made.table.rows if made.sharded is None else sharded_lookup(made)
                   for layer, made in layers.items()}
        shapes = {layer: (made.heads[1] - made.heads[0], spec.head_dim)
                  for layer, made in layers.items()}
        scheduler = PrefetchScheduler(
            sources, shapes, max_tokens=max_tokens, depth=len(layers),
            backend="cpu" if device is None else "cuda",
            device=None if device is None else f"cuda:{device}", background=background,
            id_format="global")
        gather = HeadGather(tp, spec.n_hash_cols, spec.head_dim, max_tokens, tuple(layers),
                            sequence_parallel=sequence_parallel,
                            device=None if device is None else f"cuda:{device}")
        return cls(model, layers, hash_state, scheduler, gather, sharing=sharing, tp=tp, edp=edp,
                   max_tokens=max_tokens, device=device, phases=phases)

    # ------------------------------------------------------------- step --
    def begin_step(self, token_ids: ArrayLike, slots: ArrayLike, positions: ArrayLike,
                   token_mask: ArrayLike | None = None, *, commit: bool | ArrayLike = True,
                   counts: Sequence[int] | None = None) -> np.ndarray:
        """Hash the step's packed tokens (tokenizer ids, one slot and
        position each: see ``HashState.hash``) for every layer and submit
        every layer's lookup, in layer order.  ``counts``: in the DP-sharded
        mode, every EDP member's token count this step (vLLM's
        ``num_tokens_across_dp`` of the group), which spares a collective.
        Returns the hash ids ``[T, layers, n_hash_cols]`` (global rows).
        Lookups of the last step not yet embedded are dropped."""
        self._enter(starts_step=True)
        try:
            return self._begin_step(token_ids, slots, positions, token_mask, commit, counts)
        finally:
            self._busy.release()

    def _begin_step(self, token_ids: ArrayLike, slots: ArrayLike, positions: ArrayLike,
                    token_mask: ArrayLike | None, commit: bool | ArrayLike,
                    counts: Sequence[int] | None) -> np.ndarray:
        n = int(np.shape(token_ids)[0]) if np.ndim(token_ids) else 0
        if n > self.max_tokens:
            raise SpecError(f"{n} tokens in one step exceed max_tokens {self.max_tokens} (the "
                            "staging buffers' size); split the step or raise max_tokens")
        started = time.perf_counter()
        hash_ids = self.hash_state.hash(token_ids, slots, positions, token_mask, commit=commit,
                                        id_format="global")
        self._hash_s += time.perf_counter() - started
        self._new_step(n, counts)
        for i, layer in enumerate(self.layer_ids):
            self._submit(layer, hash_ids[:, i])
        return hash_ids

    def prepare(self, layer_id: int, hash_ids: Any, *,
                counts: Sequence[int] | None = None) -> None:
        """Submit one layer's lookup for hash ids computed elsewhere (e.g. by
        vLLM's hashing kernel): global rows ``[T, n_hash_cols]``, or ``[T,
        layers, n_hash_cols]`` of which this layer's column is taken; int32
        or int64.  Then ``embed(layer_id)``."""
        self._enter(starts_step=True)
        try:
            self._prepare(layer_id, hash_ids, counts)
        finally:
            self._busy.release()

    def _prepare(self, layer_id: int, hash_ids: Any, counts: Sequence[int] | None) -> None:
        index = self._index(layer_id)
        ids = _host_ids(hash_ids)
        if ids.ndim == 3:
            ids = ids[:, index]
        if ids.ndim != 2 or ids.shape[1] != self.spec.n_hash_cols:
            raise SpecError(f"hash ids of shape {list(ids.shape)}: pass [T, "
                            f"{self.spec.n_hash_cols}] or [T, {len(self.layer_ids)}, "
                            f"{self.spec.n_hash_cols}] global rows")
        if not self._pending:
            self._new_step(int(ids.shape[0]), counts)
        elif counts is not None:
            self._counts = list(counts)
        self._submit(layer_id, ids)

    def embed(self, layer_id: int) -> torch.Tensor:
        """The layer's rows once its lookup is done: BF16 ``[T, n_hash_cols,
        head_dim]`` for every token of the step (with sequence parallelism
        this rank's window ``[ceil(T / tp), n_hash_cols, head_dim]``; rows past
        the last token are zeros), as vLLM's ``Engram.embed`` returns them.
        The tensor is a persistent buffer: the next step overwrites it."""
        self._enter(starts_step=False)
        try:
            return self._embed(layer_id)
        finally:
            self._busy.release()

    def _embed(self, layer_id: int) -> torch.Tensor:
        self._index(layer_id)
        if layer_id not in self._pending:
            raise PrefetchError(f"embed({layer_id}) without begin_step() or prepare({layer_id}) "
                                "this step")
        self._pending.discard(layer_id)
        if not self._pending:
            self._step_thread = None  # the step is over: any thread may begin the next
        rows = self._scheduler.wait(layer_id, check_errors=self.device is not None)
        assert not isinstance(rows, tuple)  # the runtime stages BF16 rows, never packed ones
        started = time.perf_counter()
        out = self._gather.gather(layer_id, rows)
        self._gather_s += time.perf_counter() - started
        return out

    # ---------------------------------------------------------- requests --
    def release(self, slot: int) -> None:
        """The request in ``slot`` finished; its slot's next token starts a new one."""
        self._enter(starts_step=False, own_step=False)
        try:
            self.hash_state.release(slot)
        finally:
            self._busy.release()

    def restore(self, slot: int, position: int, prefix_ids: ArrayLike,
                prefix_mask: ArrayLike | None = None, *,
                unknown_id: int | None = UNKNOWN_LOOKBACK_ID) -> None:
        """A request resumed at ``position`` (prefix-cache hit, preemption,
        P/D): ``prefix_ids`` are the tokenizer ids just before it, as a runner
        supplies a look-back window (longer is fine).  ``unknown_id`` (-1,
        as vLLM's runner writes it) marks an id the runner does not know:
        hashed as the pad id, the look-back goes on past it to older ids.
        DEAD is distinct: ``prefix_mask`` False or the image token id stop
        the look-back there (see ``HashState.restore``)."""
        self._enter(starts_step=False, own_step=False)
        try:
            self.hash_state.restore(slot, position, prefix_ids, prefix_mask,
                                    unknown_id=unknown_id)
        finally:
            self._busy.release()

    # ------------------------------------------------------------ report --
    def stats(self) -> dict:
        """Steps, tokens, seconds spent hashing and gathering, and per layer
        the table's counters and the prefetch's lead and exposed wait."""
        prefetch = self._scheduler.stats()
        return {"steps": self._steps, "tokens": self._tokens,
                "hash_seconds": self._hash_s, "gather_seconds": self._gather_s,
                "layers": {layer: {"table": vars(made.table.stats()),
                                   "prefetch": vars(prefetch[layer])}
                           for layer, made in self._layers.items()}}

    def mode_report(self) -> dict:
        """What a deployment log must record (JSON-ready): the mode that
        runs, the effective embedding DP size, TP size and rank, the EDP
        group's members, per layer the head and row ranges, sharing group,
        placement and startup seconds, and the startup phases in total."""
        first = next(iter(self._layers.values()))
        mode = "dp_sharded" if self.sharing == "dp_sharded" else first.table.mode
        return {"model_dir": self.model.path, "requested_sharing": self.sharing, "mode": mode,
                "source": "service" if self.service else "built", "service": self.service,
                "embedding_dp_size": 1 if self._edp is None else self._edp.size,
                "edp_group": None if self._edp is None else list(self._edp.ranks),
                "tp_size": self.tp.size, "tp_rank": self.tp.rank,
                "sequence_parallel": self._gather.sequence_parallel,
                "device": self.device, "max_tokens": self.max_tokens,
                "max_requests": self.hash_state.max_requests,
                "dead_ids": list(self.model.dead_ids),
                "layers": {layer: made.report() for layer, made in self._layers.items()},
                "startup_s": {k: round(v, 6) for k, v in self.startup_s.items()}}

    # ------------------------------------------------------------- close --
    def close(self) -> None:
        """Stop the prefetch and close every table (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._scheduler.close()
        for made in self._layers.values():
            made.table.close()

    def __enter__(self) -> EngramRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------- internals --
    def _check_open(self) -> None:
        if self._closed:
            raise PrefetchError("the Engram runtime is closed")

    def _enter(self, *, starts_step: bool, own_step: bool = True) -> None:
        """Take the runtime for one call (released by the caller): refused
        while another call runs, or (``own_step``) while another thread's
        step is pending; ``starts_step`` makes the step this thread's."""
        if not self._busy.acquire(blocking=False):
            raise PrefetchError("EngramRuntime called from two threads at once; one thread "
                                "drives a step (begin_step ... embed): serialise the steps, "
                                "or make a runtime per thread")
        try:
            self._check_open()
            me, owner = threading.get_ident(), self._step_thread
            if own_step and owner is not None and owner != me and self._pending:
                raise PrefetchError(f"a step begun by thread {owner} is not embedded yet; "
                                    "one thread drives a step (begin_step ... embed): "
                                    "serialise the steps, or make a runtime per thread")
            if starts_step:
                self._step_thread = me
        except BaseException:
            self._busy.release()
            raise

    def _index(self, layer_id: int) -> int:
        if layer_id not in self._layers:
            raise SpecError(f"layer {layer_id} has no Engram table; the model's Engram layers "
                            f"are {list(self.layer_ids)}")
        return self.layer_ids.index(layer_id)

    def _new_step(self, tokens: int, counts: Sequence[int] | None) -> None:
        if self._pending:  # the last step ended without embedding these
            self._scheduler.reset()
            self._pending.clear()
        self._counts = None if counts is None else list(counts)
        self._steps += 1
        self._tokens += tokens

    def _submit(self, layer_id: int, ids: Any) -> None:
        if self.device is not None:
            import torch

            ids = torch.from_numpy(np.ascontiguousarray(ids)).to(f"cuda:{self.device}",
                                                                 non_blocking=True)
        self._scheduler.submit(layer_id, ids, self._counts)
        self._pending.add(layer_id)


MAX_STEP_TOKENS = 1 << 20  # staging buffers of this many tokens are GiBs per layer
MAX_REQUESTS = 1 << 20


def _check_count(name: str, value: Any, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            not 1 <= value <= most:
        raise SpecError(f"{name} must be an integer from 1 to {most}, got "
                        f"{type(value).__name__} {value!r}")


def _add_phases(total: dict[str, float], phases: dict[str, float]) -> None:
    for name, seconds in phases.items():
        total[name] = total.get(name, 0.0) + seconds


def _host_ids(hash_ids: Any) -> np.ndarray:
    """Hash ids as a numpy array (a CPU tensor viewed; a CUDA one copied)."""
    if hasattr(hash_ids, "detach"):
        return hash_ids.detach().cpu().numpy()
    return np.asarray(hash_ids)
