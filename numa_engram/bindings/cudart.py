"""The CUDA runtime binding: cudaHostRegister / Unregister /
GetDevicePointer / GetLastError / DeviceGetPCIBusId through cffi (ABI mode,
dlopen of the CUDA runtime torch ships), registering in chunks of at most
64 GiB.  Only ffi here, like ``native``: the GPU lookup on registered memory
is ``numa_engram.lookup.gpu``.

No torch import: the runtime library is located on disk (next to torch's
package, found without importing it).  On a host without the runtime or a
GPU every entry point raises CudaUnavailable with the reason, and the tests
that need it skip printing that reason.
"""

from __future__ import annotations

import ctypes.util
import glob
import importlib.util
import logging
import os
import weakref
from dataclasses import dataclass

from cffi import FFI

from ..errors import CudaError, CudaUnavailable, NumaEngramError

CHUNK_BYTES = 64 << 30  # one call of >= 512 GiB fails on recent drivers
HOST_REGISTER_DEFAULT, HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 0, 1, 2
HOST_REGISTER_READ_ONLY = 8

_ffi = FFI()
_ffi.cdef("""
    int cudaHostRegister(void *ptr, size_t size, unsigned int flags);
    int cudaHostUnregister(void *ptr);
    int cudaHostGetDevicePointer(void **pdev, void *host, unsigned int flags);
    int cudaGetLastError(void);
    const char *cudaGetErrorString(int error);
    int cudaSetDevice(int device);
    int cudaGetDevice(int *device);
    int cudaGetDeviceCount(int *count);
    int cudaDeviceGetPCIBusId(char *pciBusId, int len, int device);
""")
_lib = None
_why_not = ""


def _candidates() -> list[str]:
    out = []
    spec = importlib.util.find_spec("torch")
    if spec and spec.submodule_search_locations:
        root = os.path.dirname(next(iter(spec.submodule_search_locations)))
        out += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib",
                                             "libcudart.so*")))
        out += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcudart.so*")))
        out += sorted(glob.glob(os.path.join(root, "torch", "lib", "libcudart*.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    return out


def runtime():
    """The dlopened CUDA runtime, or CudaUnavailable saying why not."""
    global _lib, _why_not
    if _lib is not None:
        return _lib
    if _why_not:
        raise CudaUnavailable(_why_not)
    errors = []
    for path in _candidates():
        try:
            lib = _ffi.dlopen(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        count = _ffi.new("int *")
        rc = lib.cudaGetDeviceCount(count)
        if rc != 0 or count[0] == 0:
            _why_not = f"CUDA runtime {path} found but no GPU is usable (error {rc})"
            lib.cudaGetLastError()
            raise CudaUnavailable(_why_not)
        _lib = lib
        return lib
    _why_not = ("no CUDA runtime library (libcudart) found next to torch or on the loader path"
                + (f": {'; '.join(errors)}" if errors else ""))
    raise CudaUnavailable(_why_not)


def available() -> tuple[bool, str]:
    try:
        runtime()
        return True, ""
    except CudaUnavailable as exc:
        return False, str(exc)


def _check(rc: int, call: str, detail: str) -> None:
    if rc != 0:
        lib = runtime()
        msg = _ffi.string(lib.cudaGetErrorString(rc)).decode()
        lib.cudaGetLastError()  # clear the sticky error so later calls are not blamed
        raise CudaError(f"{call} failed: {msg} (error {rc}) [{detail}]")


def _with_device(device: int):
    lib = runtime()
    cur = _ffi.new("int *")
    _check(lib.cudaGetDevice(cur), "cudaGetDevice", "")
    _check(lib.cudaSetDevice(device), "cudaSetDevice", f"device={device}")
    return lib, cur[0]


@dataclass
class Registration:
    address: int
    length: int
    device: int
    chunks: tuple[tuple[int, int], ...]
    seconds: float = 0.0


def register(address: int, length: int, device: int, read_only: bool = False,
             chunk_bytes: int = CHUNK_BYTES) -> Registration:
    """Pin [address, address+length) for zero-copy reads by ``device``, in
    chunks; a failure unregisters what was registered and raises."""
    import time

    lib, previous = _with_device(device)
    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | (
        HOST_REGISTER_READ_ONLY if read_only else 0)
    done: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    try:
        for start in range(0, length, chunk_bytes):
            size = min(chunk_bytes, length - start)
            ptr = _ffi.cast("void *", address + start)
            _check(lib.cudaHostRegister(ptr, size, flags), "cudaHostRegister",
                   f"offset={start} size={size} flags={flags} device={device}")
            done.append((address + start, size))
    except BaseException:
        for a, _ in done:
            lib.cudaHostUnregister(_ffi.cast("void *", a))
        lib.cudaGetLastError()
        raise
    finally:
        lib.cudaSetDevice(previous)
    return Registration(address, length, device, tuple(done), time.perf_counter() - t0)


class RegistrationLease:
    """Keeps a registration, and the host memory under it, alive: the table
    holds one reference and every device view another; when the last one is
    gone the memory is unregistered (then unmapped), so ``close()`` with live
    views defers the unregister and a table dropped without ``close()``
    unregisters when its views die.  A captured CUDA graph holds raw
    pointers into the table and no reference: it must not outlive the
    table's views."""

    def __init__(self, registration: Registration, keepalive: object = None) -> None:
        self.registration = registration
        self._finalizer = weakref.finalize(self, _unregister_quietly, registration, keepalive)

    @property
    def device(self) -> int:
        return self.registration.device

    @property
    def seconds(self) -> float:
        return self.registration.seconds

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Unregister now (only when no device view can exist yet)."""
        self._finalizer()


def _unregister_quietly(reg: Registration, _keepalive: object) -> None:
    # (_keepalive: held by the finalizer so the mapping outlives the registration)
    try:
        unregister(reg)
    except NumaEngramError as exc:  # at interpreter exit or from a finalizer: log, go on
        logging.getLogger(__name__).warning("unregistering the table failed: %s", exc)


def unregister(reg: Registration) -> None:
    lib = runtime()
    for a, size in reg.chunks:
        _check(lib.cudaHostUnregister(_ffi.cast("void *", a)), "cudaHostUnregister",
               f"address={a:#x} size={size}")


def device_pointer(address: int) -> int:
    lib = runtime()
    out = _ffi.new("void **")
    _check(lib.cudaHostGetDevicePointer(out, _ffi.cast("void *", address), 0),
           "cudaHostGetDevicePointer", f"address={address:#x}")
    return int(_ffi.cast("uintptr_t", out[0]))


def pci_bus_id(device: int) -> str:
    """The PCI address (``dddd:bb:dd.f``, lower case as sysfs spells it) of
    a CUDA device, in CUDA's numbering (CUDA_VISIBLE_DEVICES applied)."""
    lib = runtime()
    buf = _ffi.new("char[]", 32)
    _check(lib.cudaDeviceGetPCIBusId(buf, 32, device), "cudaDeviceGetPCIBusId",
           f"device={device}")
    domain, bus, rest = _ffi.string(buf).decode().split(":")
    dev, function = rest.split(".")
    # CUDA may print an 8-digit domain and upper case; sysfs has 4 and lower
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(function, 16)}"
