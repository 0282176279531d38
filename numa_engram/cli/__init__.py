"""The ``numa-engram`` command line and its demo job.

May import everything.  torch only inside the commands that need it, so
``plan``, ``topo``, ``verify`` and ``mem`` start fast.
"""

from .app import main

__all__ = ["main"]
