"""Lookups: the CPU path over the C kernels (``cpu``), the GPU path
(``gpu``, its Triton kernels in ``triton_kernels``) and the prefetch
scheduler that runs them ahead of the layer.

May import: ``errors``, ``units``, ``bindings``, ``model``, ``host``,
``store``.  torch only inside functions.  The CPU names below are here too,
where README has always documented them (``numa_engram.lookup.aligned_empty``).
"""

from .cpu import gather, lookup_rows, reference_lookup
from .outputs import OutputPool, aligned_empty

__all__ = ["OutputPool", "aligned_empty", "gather", "lookup_rows", "reference_lookup"]
