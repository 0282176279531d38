"""How numbers are shown to (and read from) an operator, in one place: sizes
like '64M', bytes in one unit per table (the unit named in the header), node
sets as numactl writes them (``0-1,3``), and aligned text tables.  No torch
here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'64M', '1.5G', '2MiB', '4096' -> bytes (binary units); ValueError
    naming the text for anything else."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"size {text!r} is not a size: write a number of bytes with an "
                         "optional K, M, G or T (e.g. 64M)")
    return int(float(m[1]) * _SCALE[m[2].lower()])


def unit_for(*sizes: int) -> tuple[str, int]:
    """The unit that shows the largest of ``sizes`` with at least 1.0 in
    front (GiB, MiB or KiB): one unit for a whole table of numbers."""
    largest = max((abs(s) for s in sizes), default=0)
    return next(((name, size) for name, size in _UNITS if largest >= size), _UNITS[-1])


def fmt_bytes(value: int, unit: tuple[str, int] | None = None, digits: int = 2) -> str:
    """'1.50 GiB' (in ``unit`` when given, else the best one for value)."""
    name, size = unit or unit_for(value)
    return f"{value / size:.{digits}f} {name}"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """The kernel's (and numactl's) list form: '0-3,8,10-11' -> (0, 1, 2, 3, 8,
    10, 11); ``node_list`` is its inverse."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def node_list(nodes: Iterable[int]) -> str:
    """numactl's form of a node set: [0, 1, 3] -> '0-1,3' ('-' if empty)."""
    ids = sorted(set(nodes))
    parts: list[str] = []
    runs: list[list[int]] = []  # [first, last] of each run of consecutive ids
    for n in ids:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ",".join(parts) or "-"


def text_table(header: Sequence[str], rows: Iterable[Sequence[object]],
               left: int = 1, text_last: bool = False) -> str:
    """Columns sized to their widest cell; the first ``left`` columns are
    left-aligned (names), the rest right-aligned (numbers); ``text_last``:
    the last column is free text, left-aligned and never padded."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
    lines = []
    last = len(header) - 1
    for row in cells:
        out = [c.ljust(w) if i < left or text_last and i == last else c.rjust(w)
               for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(out).rstrip())
    return "\n".join(lines)
