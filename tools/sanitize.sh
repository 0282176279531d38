#!/usr/bin/env bash
# The C core under AddressSanitizer and UBSan (any finding fatal): build the
# extension with NUMA_ENGRAM_SANITIZE=1 in place, run the tests that drive
# the native kernels (lookups, hashes, PLE rows, out= guards) with libasan
# preloaded, then build the normal extension again whatever happened.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CC_BIN=$("$PY" -c 'import sysconfig; print((sysconfig.get_config_var("CC") or "cc").split()[0])')
ASAN=$("$CC_BIN" -print-file-name=libasan.so)
if [ ! -e "$ASAN" ]; then
  echo "sanitize.sh: $CC_BIN has no libasan.so; the sanitizer run is skipped" >&2
  exit 0
fi
rebuild() { "$PY" setup.py -q build_ext --inplace --force >/dev/null; }
trap rebuild EXIT
NUMA_ENGRAM_STRICT=1 NUMA_ENGRAM_SANITIZE=1 "$PY" setup.py -q build_ext --inplace --force >/dev/null
# detect_leaks=0: CPython's own allocations at exit are not ours to judge;
# -m "not multiproc" (none of these files starts a world): no forkserver
# importing torch under ASan beside the tests
LD_PRELOAD="$ASAN" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$PY" -m pytest -q -p no:cacheprovider -m "not multiproc" tests/test_native.py tests/test_lookup.py \
    tests/test_out_guards.py tests/test_ple.py tests/test_hashing.py tests/test_hashstate.py \
    tests/test_fp8.py
