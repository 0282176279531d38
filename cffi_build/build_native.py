"""cffi builder (API mode, out-of-line) for numa_engram._native.

Run by setuptools at install time (``cffi_modules`` in setup.py); nothing
prebuilt is committed.  The C source is native.c beside this file, which
includes the parts in src/; the declarations are read from their headers.
"""

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# the package version, compiled in: native.py refuses a core built for another
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (HERE.parent / "numa_engram" / "_version.py").read_text()).group(1)

# The declarations are the parts' headers (src/*.h), read as written: the
# prototypes as they are, the constants from each header's
# "cffi-constants" comment block (their values come from the system
# headers at build time, not from numbers typed here).  Preprocessor lines
# (include guards, includes) are not cffi syntax and are dropped.
HEADERS = ("memory.h", "pool.h", "lookup.h", "hashing.h")
CONSTANTS = re.compile(r"cffi-constants[^\n]*\n(.*?)\*/", re.S)


def declarations(header: Path) -> str:
    text = header.read_text()
    block = CONSTANTS.search(text)
    constants = "" if block is None else "\n".join(
        line.strip().lstrip("*").strip() for line in block.group(1).splitlines())
    code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    return constants + "\n" + code


CDEF = "\n".join(declarations(HERE / "src" / name) for name in HEADERS)

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
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
