"""What the prefetch schedulers count per layer: ``LayerMetrics`` (kept
as lookups are waited for) and ``LayerStats`` (``scheduler.stats()``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..histogram import Histogram

# What handing a lookup to the worker and back may cost: two thread
# wake-ups, each up to ~200 us in a VM guest (a 1,024-token lookup waited
# for at once takes 1.8x a direct one through the worker).  A lead (submit
# -> wait) shorter than this hides less than it costs.
HANDOFF_S = 0.0005


@dataclass(frozen=True)
class LayerStats:
    """Totals of one layer's lookups (``scheduler.stats()``)."""

    lookups: int
    lookup_seconds: float        # the lookups themselves (CUDA: from events, when done)
    lead_seconds: float          # submit -> wait: how far ahead they were issued
    exposed_wait_seconds: float  # wait -> rows ready: what the consumer lost
    errors: int = 0              # lookups that raised (bad ids included)
    timeouts: int = 0            # waits that gave up (wait(timeout_s=))
    latency: tuple = ()          # the lookups' own times: Histogram.snapshot()


# Waited-for lookups a layer's metrics hold before they are counted into
# its totals at the latest (LayerMetrics.unsettled): a scheduler whose
# stats are never read keeps at most this many, and the wait that counts
# them pays for all at once (~0.17 us each: 64 stall that decode step
# ~12 us; 1,024 would stall it 0.17 ms).
SETTLE_AT = 64


@dataclass(slots=True)
class LayerMetrics:
    """A layer's totals.  A wait only appends its lookup's times to
    ``unsettled`` (one deque append; counting them there makes a 1-token
    decode step's submit+wait 3-9% slower, A/B in one process); ``settle()``
    counts them, under the scheduler's lock, when the stats are read or
    ``SETTLE_AT`` are waiting, so the totals have one writer at a time.
    ``errors``, ``timeouts`` and ``last_lead_s`` are kept at once."""

    lookups: int = 0
    lead_s: float = 0.0     # submit -> wait call
    exposed_s: float = 0.0  # wait call -> rows ready (what the consumer lost)
    errors: int = 0
    timeouts: int = 0
    latency: Histogram = field(default_factory=Histogram)
    # the last lookup's free lead (its submit's return -> its wait: a
    # lookup run in its submit is not a lead): whether running the next one
    # ahead can hide anything
    last_lead_s: float = float("inf")
    # waited for, not yet in the totals: (lead_s, exposed_s, ran_s) each
    unsettled: deque = field(default_factory=deque)

    def count(self, lead_s: float, free_lead_s: float, exposed_s: float,
              ran_s: float | None) -> None:
        """One lookup waited for: ``lead_s`` from its submit's call to its
        wait, ``free_lead_s`` from its submit's return (what decides where
        the next one runs), ``exposed_s`` from the wait to its rows, and
        ``ran_s`` the lookup's own time (None: a CUDA one's, read from its
        events later).  Counted in the totals by the next ``settle()``."""
        self.last_lead_s = free_lead_s
        self.unsettled.append((lead_s, exposed_s, ran_s))

    def settle(self) -> LayerMetrics:
        """Count the waited-for lookups into the totals (the caller holds
        the scheduler's lock: waits only append meanwhile); returns self."""
        unsettled = self.unsettled
        while unsettled:
            lead_s, exposed_s, ran_s = unsettled.popleft()
            self.lookups += 1
            self.lead_s += lead_s
            self.exposed_s += exposed_s
            if ran_s is not None:
                self.latency.observe(ran_s)
        return self

    @property
    def lookup_s(self) -> float:
        """Time the lookups themselves ran: their histogram's sum."""
        return self.latency.total

    def ahead_pays(self) -> bool:
        """Whether the layer's next lookup should go to the worker: when the
        last lead was longer than a hand-off costs.  A shorter lead hides
        nothing even if the lookup is shorter still: the worker is still
        waking when the wait comes (1-token lookups with a lead of a few us
        handed to the worker cost ~100 us each)."""
        return self.last_lead_s >= HANDOFF_S

    def as_dict(self) -> dict:
        n = max(1, self.lookups)
        return {"lookups": self.lookups, "mean_lookup_s": self.lookup_s / n,
                "mean_lead_s": self.lead_s / n, "mean_exposed_s": self.exposed_s / n}
