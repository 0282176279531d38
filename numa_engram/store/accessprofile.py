"""A row-access profile (``numa-engram profile``, read by ``plan --profile``):
how often each row of each layer was read, and the fraction of reads a
memory budget serves when the hottest 4 KiB pages are the ones kept.

Rows share pages (V4.1: 16 FP8 rows of 256 bytes per page, 512 rows'
scales per page), and the page cache keeps or evicts whole pages, so the
unit counted is the page: a row's read is a read of every page its bytes
span in each of its family's row regions (weights, scales), each region
laid out from a page boundary as a checkpoint tensor is mapped.  The best
a budget of B bytes can do is keep the B / 4 KiB most-read pages; the
fraction of page reads those serve is the expected hit rate.  Arithmetic
only: no torch, no allocation beyond the counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SpecError

PAGE = 4096
FORMAT = "numa-engram-profile/1"
CURVE_POINTS = 256  # budgets stored in a profile for plan (log-spaced, plus every page)


@dataclass(frozen=True)
class LayerCounts:
    """One layer's rows (sorted, distinct) and how often each was read."""

    layer: int
    rows: np.ndarray    # int64, sorted, distinct
    counts: np.ndarray  # int64, > 0

    @classmethod
    def of(cls, layer: int, row_ids: np.ndarray) -> LayerCounts:
        rows, counts = np.unique(np.asarray(row_ids, dtype=np.int64).reshape(-1),
                                 return_counts=True)
        return cls(layer, rows, counts.astype(np.int64))


def page_reads(layer: LayerCounts, row_regions: Sequence[tuple[str, int]]) -> np.ndarray:
    """Reads of each page the layer's rows touch (every region's pages, in
    no particular order): a row of ``w`` bytes in a region starts at byte
    ``row * w`` and counts once on each page it spans."""
    out = []
    for _, width in row_regions:
        first = layer.rows * width // PAGE
        last = ((layer.rows + 1) * width - 1) // PAGE
        spans = last - first + 1
        pages = np.repeat(first, spans) + _ranks_within(spans)
        reads = np.repeat(layer.counts, spans)
        unique, inverse = np.unique(pages, return_inverse=True)
        out.append(np.bincount(inverse, weights=reads, minlength=len(unique)).astype(np.int64))
    return np.concatenate(out) if out else np.empty(0, np.int64)


def _ranks_within(spans: np.ndarray) -> np.ndarray:
    """0, 1, ..., s-1 for each span s, concatenated."""
    total = int(spans.sum())
    starts = np.repeat(np.cumsum(spans) - spans, spans)
    return np.arange(total, dtype=np.int64) - starts


def hottest_first(reads: np.ndarray) -> np.ndarray:
    """Cumulative page reads with the most-read pages first: entry k-1 is
    what a budget of k pages serves."""
    return np.cumsum(np.sort(reads)[::-1])


def served_fraction(cumulative: np.ndarray, budget_bytes: int) -> float:
    """The fraction of all page reads the ``budget_bytes // 4 KiB`` hottest
    pages serve (exact)."""
    if not len(cumulative) or cumulative[-1] == 0:
        return 1.0
    pages = min(max(budget_bytes, 0) // PAGE, len(cumulative))
    return float(cumulative[pages - 1] / cumulative[-1]) if pages else 0.0


def curve(cumulative: np.ndarray, points: int = CURVE_POINTS) -> list[list[float]]:
    """[budget bytes, fraction served] at log-spaced page counts up to the
    whole working set (its last point serves 1.0)."""
    n = len(cumulative)
    if not n:
        return [[0, 1.0]]
    counts = np.unique(np.geomspace(1, n, num=min(points, n)).round().astype(np.int64))
    return [[int(k) * PAGE, served_fraction(cumulative, int(k) * PAGE)] for k in counts]


def curve_fraction(points: Sequence[Sequence[float]], budget_bytes: int) -> float:
    """The fraction a budget serves by a stored curve: linear between its
    points, which for a curve of hottest-first pages (concave) is a lower
    bound; 1.0 from the working set's size on."""
    xs = np.asarray([p[0] for p in points], dtype=np.float64)
    ys = np.asarray([p[1] for p in points], dtype=np.float64)
    if budget_bytes >= xs[-1]:
        return 1.0
    return float(np.interp(budget_bytes, np.concatenate([[0.0], xs]),
                           np.concatenate([[0.0], ys])))


def load(data: bytes, name: str) -> dict:
    """A profile document, checked: its format, table bytes and a curve of
    increasing budgets with fractions in [0, 1] (a SpecError naming
    ``name`` otherwise)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpecError(f"{name} is not a row-access profile ({FORMAT}); make one with "
                        "numa-engram profile MODEL_DIR CORPUS... --out FILE")
    points, table = doc.get("curve"), doc.get("table_bytes")
    ok = (isinstance(table, int) and table > 0 and isinstance(points, list) and points and
          all(isinstance(p, list) and len(p) == 2 and
              all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p) and
              0 <= p[1] <= 1 for p in points) and
          all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(points, points[1:])))
    if not ok:
        raise SpecError(f"{name}: its table_bytes or curve is malformed (a positive table size "
                        "and [bytes, fraction] pairs of increasing budgets, fractions in "
                        "[0, 1]); make it again with numa-engram profile")
    return doc
