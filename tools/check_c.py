"""The C core's warning check (tools/lint.sh): the translation unit the
build compiles (cffi's module source around native.c, which includes every
part of cffi_build/src/) checked for syntax with the build's own flags and
-Werror, as NUMA_ENGRAM_STRICT=1 builds it.  The flags, include
directories and macros are read from build_native.py, never written twice.
The parts are not translation units of their own: native.c includes them in
order and their headers are plain declarations cffi reads as they are."""

import contextlib
import io
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _builder():  # (cffi ships no types)
    """build_native.py's FFI builder as a strict, unsanitized build sets it up."""
    os.environ["NUMA_ENGRAM_STRICT"] = "1"
    os.environ.pop("NUMA_ENGRAM_SANITIZE", None)
    sys.path.insert(0, str(ROOT / "cffi_build"))
    import build_native

    return build_native.ffibuilder


def main() -> int:
    ffi = _builder()
    _, _, _, kwds = ffi._assigned_source
    flags = ["-fsyntax-only", "-Werror", *kwds["extra_compile_args"],
             f"-I{sysconfig.get_paths()['include']}",
             *(f"-I{d}" for d in kwds["include_dirs"]),
             *(f"-D{name}={value}" for name, value in kwds["define_macros"])]
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory(prefix="numa-engram-check-c-") as tmp:
        source = Path(tmp) / "_native.c"
        with contextlib.redirect_stdout(io.StringIO()):  # cffi's "generating ..." line
            ffi.emit_c_code(str(source))
        done = subprocess.run([*cc, *flags, str(source)])
    if done.returncode:
        print("check_c.py: the C core does not compile without warnings (above)", file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
