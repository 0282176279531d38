"""The shared tables: the create request, membership and placement
agreement, the create/attach protocol, cooperative loading, the table
classes (Engram, PLE, the mapped tier) and their reports.

May import every folder below it (``lookup``, ``groups``, ``checkpoints``,
``store``, ``host``, ``model``, ``bindings``).  torch only inside functions
(a table's lookups return tensors; importing this folder does not import
torch).
"""
