"""cffi builder (API mode, out-of-line) for numa_engram._native.

Run by setuptools at install time (``cffi_modules`` in setup.py); nothing
prebuilt is committed.  The C source is native.c beside this file, which
includes the parts in src/; the declarations are their headers, as they are.
"""

import os
import platform
import re
import shlex
import subprocess
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# the package version, compiled in: native.py refuses a core built for another
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (HERE.parent / "numa_engram" / "_version.py").read_text()).group(1)

# The declarations are the parts' headers (src/*.h, plain declarations
# cffi reads as they are) after the constants Python reads (constants.cdef,
# their values taken from the compiled core).
HEADERS = ("memory.h", "pool.h", "filemap.h", "lookup.h", "hashing.h", "ple.h", "step.h")
CDEF = "\n".join([(HERE / "constants.cdef").read_text(),
                  *((HERE / "src" / name).read_text() for name in HEADERS)])


def _accepted(flags: list[str]) -> list[str]:
    """``flags`` if the C compiler Python builds with takes them (GCC 12 and
    later; an older or other compiler keeps its own tuning), else none."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    try:
        probe = subprocess.run([*cc, *flags, "-Werror", "-x", "c", "-c", "-o", os.devnull, "-"],
                               input="int probe;\n", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return flags if probe.returncode == 0 else []


# GCC's generic tuning copies with 16-byte moves and splits unaligned
# 32-byte loads and stores, even in the AVX2 clones (a row's copy into the
# stage takes sixteen 16-byte moves under it); CPUs with AVX2 do them whole.
X86_TUNING = _accepted(["-mmove-max=256", "-mstore-max=256", "-mno-avx256-split-unaligned-load",
                        "-mno-avx256-split-unaligned-store"]) \
    if platform.machine() in ("x86_64", "AMD64") else []

# NUMA_ENGRAM_SANITIZE=1: the sanitizer build tools/sanitize.sh tests
# (AddressSanitizer and UBSan, any finding fatal); never a release build.
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"] \
    if os.environ.get("NUMA_ENGRAM_SANITIZE") == "1" else []

# NUMA_ENGRAM_STRICT=1 (tools/setup.sh, so every test run): any warning is
# an error.  A user's build keeps going on a compiler that warns of more.
STRICT = ["-Werror"] if os.environ.get("NUMA_ENGRAM_STRICT") == "1" else []

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "numa_engram._native",
    '#include <sys/mman.h>\n#include <linux/magic.h>\n#include <linux/memfd.h>\n'
    '#include <linux/mempolicy.h>\n'
    '#include "native.c"',
    include_dirs=[str(HERE)],
    define_macros=[("NE_CORE_VERSION", f'"{VERSION}"')],
    # -O3 lets GCC vectorise the branch-free dequant loop for the baseline
    # ISA; nothing here assumes the build host's CPU (no -march=native).
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-function",
                        *STRICT, *X86_TUNING, *SANITIZE],
    extra_link_args=SANITIZE,
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
