"""The flat module paths of releases before 0.3 (``numa_engram.table``,
``numa_engram.group``, ...), kept working as deprecated aliases.

``import numa_engram.group`` finds ``numa_engram.sharing.group`` and binds
the same module object under the old name (so state set through either name
is the same state), with a DeprecationWarning naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "native": "bindings.native",
    "cuda": "bindings.cudart",  # its DeviceShard is numa_engram.lookup.gpu now
    "spec": "model.spec", "sharding": "model.sharding", "hashing": "model.hashing",
    "hashstate": "model.hashstate", "tokenmap": "model.tokenmap", "fp8": "model.fp8",
    "procfs": "host.procfs", "topology": "host.topology", "hugepages": "host.hugepages",
    "accounting": "host.accounting",
    "fileformat": "store.fileformat", "storage": "store.storage",
    "placement": "store.placement", "gc": "store.gc", "chunks": "store.chunks",
    "gpu_kernels": "lookup.triton_kernels", "prefetch": "lookup.prefetch",
    "group": "sharing.group", "checkpoint": "sharing.checkpoint",
    "loading": "sharing.loading", "table": "sharing.table", "exchange": "sharing.exchange",
    "demo": "cli.demo",
}  # "lookup" and "cli" are folders now; their old names still import (the folder)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:  # noqa: ARG002
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old name's spec on the module: give
        # it back its own (its __name__ was never touched)
        module.__spec__ = self.own_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ARG002 (the finder protocol)
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != self.package or leaf not in MOVED:
            return None
        new = f"{self.package}.{MOVED[leaf]}"
        warnings.warn(f"{fullname} moved to {new}; import it from there", DeprecationWarning,
                      stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install(package: str) -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder(package))
