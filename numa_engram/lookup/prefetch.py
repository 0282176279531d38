"""PrefetchScheduler: the prefetch scheduler of a backend, ``cpu``
(``cpuprefetch.CPUScheduler``: a worker thread) or ``cuda``
(``cudaprefetch.CUDAScheduler``: a side stream and CUDA events).  What both
do, and their arguments, are ``scheduler.Scheduler``'s.

A function, not a class that picks its subclass when constructed: the
backends import the base, and this module imports the backends, so the
imports run one way only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PrefetchError
from .cpuprefetch import CPUScheduler
from .cudaprefetch import CUDAScheduler
from .scheduler import Scheduler

BACKENDS: dict[str, type[Scheduler]] = {"cpu": CPUScheduler, "cuda": CUDAScheduler}


def PrefetchScheduler(lookups: Mapping[Any, Any], row_shape: Mapping[Any, tuple[int, int]], *,
                      backend: str = "cpu", **options: Any) -> Scheduler:
    """The ``backend``'s scheduler of ``lookups`` (the other arguments:
    ``Scheduler``'s).  Named as a class: callers construct a scheduler."""
    chosen = BACKENDS.get(backend)
    if chosen is None:
        raise PrefetchError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
    return chosen(lookups, row_shape, backend=backend, **options)
