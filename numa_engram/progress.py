"""A progress bar for long work (populating, loading a table): one line on
a terminal, redrawn in place, with the rate and the time left.  It is a
``progress(done, total)`` callback like any other the library takes; the
command-line tools use it only when stderr is a terminal and never with
--json.  No torch here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from .units import fmt_bytes

WIDTH = 30
LOG_STEP = 0.25  # off a terminal: a line per quarter of the work


def terminal_bar(label: str, stream: TextIO | None = None) -> Callable[[int, int], None]:
    """progress(done, total) drawing '<label> [####....] 1.2 GiB of 4.0 GiB,
    2.1 GiB/s, ETA 1 s' on ``stream`` (stderr), ending the line when done.
    On a stream that is no terminal (a log, a pipe) it writes a plain line
    every ``LOG_STEP`` of the total and at the end, never a carriage return."""
    out = stream or sys.stderr
    start = time.monotonic()
    on_terminal = out.isatty()
    logged = [-1.0]

    def draw(done: int, total: int) -> None:
        elapsed = max(time.monotonic() - start, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate else 0.0
        filled = WIDTH * done // total if total else WIDTH
        text = (f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fmt_bytes(done)} of "
                f"{fmt_bytes(total)}, {fmt_bytes(int(rate))}/s, ETA {eta:.0f} s")
        if on_terminal:
            out.write("\r" + text + ("\n" if done >= total else ""))
        else:
            fraction = done / total if total else 1.0
            if fraction < 1.0 and fraction - logged[0] < LOG_STEP:
                return
            logged[0] = fraction
            out.write(text + "\n")
        out.flush()
    return draw


def wanted(json_output: bool, stream: TextIO | None = None) -> bool:
    """Draw bars only for a person: stderr is a terminal and no --json."""
    out = stream or sys.stderr
    return not json_output and out.isatty()
