"""A fixed-bucket latency histogram, cheap enough for every lookup (a
bisect and two adds), read by the Prometheus collector.  No torch here."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

# seconds: a decode step's lookup is microseconds, a big prefill's tens of ms
LOOKUP_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                  2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class Histogram:
    """Counts per upper bound (the last bucket is +Inf), their sum and count.
    Not locked: the owner observes under its own lock."""

    def __init__(self, bounds: Sequence[float] = LOOKUP_BUCKETS) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        # the last observation's bucket: its index and bounds (lo, hi]; a
        # server's lookups of one size mostly fall in the same one, and two
        # compares cost half a bisect
        self.last, self.lo, self.hi = 0, -math.inf, self.bounds[0] if self.bounds else math.inf

    def observe(self, seconds: float) -> None:
        """Count ``seconds`` in the first bucket whose bound it does not
        pass: the last one's, when it is there, else a bisect."""
        if self.lo < seconds <= self.hi:
            self.counts[self.last] += 1
        else:
            self.last = b = bisect_left(self.bounds, seconds)
            self.lo = self.bounds[b - 1] if b else -math.inf
            self.hi = self.bounds[b] if b < len(self.bounds) else math.inf
            self.counts[b] += 1
        self.total += seconds

    @classmethod
    def of(cls, counts: Sequence[int], total: float,
           bounds: Sequence[float] = LOOKUP_BUCKETS) -> Histogram:
        """A histogram with these per-bucket counts and sum (what the lookup
        kernel counted)."""
        histogram = cls(bounds)
        if len(counts) != len(histogram.counts):
            raise ValueError(f"{len(counts)} counts for {len(histogram.counts)} buckets")
        histogram.counts, histogram.total = list(counts), float(total)
        return histogram

    def snapshot(self) -> tuple[tuple[tuple[str, int], ...], float]:
        """(("0.001", cumulative count), ..., ("+Inf", count)), sum: what a
        Prometheus histogram family takes."""
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return tuple(out), self.total
