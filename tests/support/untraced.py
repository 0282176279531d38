"""Outside code run without coverage's tracer.

make test measures the package's lines (``--cov=numa_engram``); the tracer
sees every call of every frame, ours or not, so vLLM's reference paths (its
torch code, its Triton kernels under the interpreter) cost the suite's
workers more than half again their own CPU while they measure none of our
lines.  ``untraced()`` stops the coverage run around such a reference and
starts it again after (what pytest-cov's ``no_cover`` does for a whole
test): wrap only code that calls nothing of ``numa_engram``, or its lines
go unmeasured.  Without a coverage run it does nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    try:
        import coverage
    except ImportError:  # (make check's venv has it; a bare one may not)
        yield
        return
    cov = coverage.Coverage.current()
    if cov is None:
        yield
        return
    cov.stop()
    try:
        yield
    finally:
        cov.start()
