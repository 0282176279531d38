#!/usr/bin/env bash
# The C core under AddressSanitizer and UBSan (any finding fatal): build the
# extension with NUMA_ENGRAM_SANITIZE=1 in a copy of the working tree (the
# repository's own build is never replaced, so the host suite may run
# beside this), and run there the tests that drive the native kernels
# (lookups, a step's layers in one call, hashes, PLE rows, out= guards, the
# mapped tier's file mappings, readahead and SIGBUS guard, the memfd
# hand-over) with libasan preloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ "$PY" == */* && "$PY" != /* ]] && PY="$PWD/$PY"  # absolute (the run is elsewhere), links kept
CC_BIN=$("$PY" -c 'import sysconfig; print((sysconfig.get_config_var("CC") or "cc").split()[0])')
ASAN=$("$CC_BIN" -print-file-name=libasan.so)
if [ ! -e "$ASAN" ]; then
  echo "sanitize.sh: $CC_BIN has no libasan.so; the sanitizer run is skipped" >&2
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$WORK"
cd "$WORK"  # (its numa_engram/ comes first on the path, before the editable install)
NUMA_ENGRAM_STRICT=1 NUMA_ENGRAM_SANITIZE=1 "$PY" setup.py -q build_ext --inplace >/dev/null
LD_PRELOAD="$ASAN" ASAN_OPTIONS=detect_leaks=0 "$PY" -c 'import os, numa_engram._native as n; assert n.__file__.startswith(os.getcwd()), n.__file__' \
  || { echo "sanitize.sh: the copy's sanitized build is not the one imported" >&2; exit 1; }
# detect_leaks=0: CPython's own allocations at exit are not ours to judge;
# -m "not multiproc" (none of these files starts a world): no forkserver
# importing torch under ASan beside the tests
LD_PRELOAD="$ASAN" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$PY" -m pytest -q -p no:cacheprovider -m "not multiproc" tests/test_native.py tests/test_lookup.py \
    tests/test_out_guards.py tests/test_ple.py tests/test_hashing.py tests/test_hashstate.py \
    tests/test_fp8.py tests/test_mapped_tier.py tests/test_memfd_sharing.py tests/test_stepgather.py
