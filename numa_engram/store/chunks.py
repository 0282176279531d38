"""Work over chunks by a few threads, with one progress count: populating a
table, pre-faulting it and copying a checkpoint into it all run this way
(the syscalls and preads release the GIL).  No torch here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def for_each_chunk(chunks: Sequence[T], work: Callable[[T], int], *, threads: int = 1,
                   total: int = 0, progress: Callable[[int, int], None] | None = None,
                   pin_cpus: Sequence[int] = (), name: str = "numa-engram") -> None:
    """``work(chunk)`` for every chunk (it returns the bytes it did), by
    ``threads`` threads pinned to ``pin_cpus`` when given; after each chunk
    ``progress(bytes done so far, total)``.  The first error is raised once
    the chunks already running have finished."""
    done, lock = [0], threading.Lock()

    def one(chunk: T) -> None:
        size = work(chunk)
        with lock:
            done[0] += size
            if progress is not None:
                progress(done[0], total)

    if threads <= 1:
        for chunk in chunks:
            one(chunk)
        return
    allowed = sorted(set(pin_cpus) & os.sched_getaffinity(0))
    # sched_setaffinity(0, ...) pins the calling thread only
    pin = (lambda: os.sched_setaffinity(0, allowed)) if allowed else None
    with ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=pin) as pool:
        for future in [pool.submit(one, chunk) for chunk in chunks]:
            future.result()

