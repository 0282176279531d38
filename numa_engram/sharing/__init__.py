"""The shared table and its protocol: ``SharedEngramTable``, the groups its
members agree through, checkpoint resolution and cooperative loading, and
the DP-sharded exchange.

May import every folder below it (``model``, ``host``, ``store``, ``lookup``,
``bindings``).  torch only inside functions (a table's lookups return
tensors; importing this folder does not import torch).
"""
