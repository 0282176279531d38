"""The groups a table's members agree through: the ``Group`` protocol, its
torch (gloo) and socket implementations, the host identity members compare,
and the collective steps (every member runs a step; failures are agreed).

May import ``store``, ``host``, ``model`` and ``bindings``; never torch at
module level (a torch group imports it when made).
"""
