"""Bindings: the only code that talks to compiled code.

``native`` wraps the cffi core (``numa_engram._native``): syscalls, the
lookup kernels, the hash kernels.  ``cudart`` binds the CUDA runtime,
loaded at first use.  May import: ``errors``, ``_version``.  Never torch.
"""
