"""The package version: one place, read by pyproject.toml, the cffi builder
(compiled into the C core, checked at import) and ``numa_engram.__version__``."""

__version__ = "0.5.0"
