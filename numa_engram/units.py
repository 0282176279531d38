"""How numbers are shown to an operator, in one place: bytes in one unit per
table (the unit named in the header), node sets as numactl writes them
(``0-1,3``), and aligned text tables.  No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def unit_for(*sizes: int) -> tuple[str, int]:
    """The unit that shows the largest of ``sizes`` with at least 1.0 in
    front (GiB, MiB or KiB): one unit for a whole table of numbers."""
    largest = max((abs(s) for s in sizes), default=0)
    return next(((name, size) for name, size in _UNITS if largest >= size), _UNITS[-1])


def fmt_bytes(value: int, unit: tuple[str, int] | None = None, digits: int = 2) -> str:
    """'1.50 GiB' (in ``unit`` when given, else the best one for value)."""
    name, size = unit or unit_for(value)
    return f"{value / size:.{digits}f} {name}"


def node_list(nodes: Iterable[int]) -> str:
    """numactl's form of a node set: [0, 1, 3] -> '0-1,3' ('-' if empty)."""
    ids = sorted(set(nodes))
    parts: list[str] = []
    start = prev = None
    for n in ids + [None]:
        if start is not None and (n is None or n != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if n is not None and start is None:
            start = n
        prev = n
    return ",".join(parts) or "-"


def text_table(header: Sequence[str], rows: Iterable[Sequence[object]],
               left: int = 1) -> str:
    """Columns sized to their widest cell; the first ``left`` columns are
    left-aligned (names), the rest right-aligned (numbers)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
    lines = []
    for row in cells:
        out = [c.ljust(w) if i < left else c.rjust(w)
               for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(out).rstrip())
    return "\n".join(lines)
