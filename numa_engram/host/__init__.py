"""The host: readers of /proc and /sys, the NUMA topology, huge-page pools
and the memory accounting that decides whether a table fits.

May import: ``errors``, ``units``, ``bindings``, ``model``.  Never torch: the
operator tools import this and must start fast.
"""
