#!/usr/bin/env bash
# The NUMA placement tests in QEMU guests (tools/numa-vm), both at once: a
# 2-node guest runs every one; a 4-node guest those that need no torch (its
# import alone is ~50 s under emulation), NUMA_ENGRAM_TEST_NO_TORCH=1
# failing the run if one imports it.  The process worlds of both meet
# through SocketGroup: no torch, no forkserver.  Only the NUMA test files
# are collected (collecting the others under emulation costs minutes).
# Each guest's output is printed after both ended, the first failure's
# status is the script's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
numa_tests=(tests/test_numa_*.py)
# The bytecode of what the guests import, compiled here first: a guest's
# writes are thrown away, so each guest compiled it again under emulation
# (~25 s of a 4-node guest's ~150 s); here it takes ~7 s of CPU.  torch
# is left out: compiling all of it here costs more than its import there
# gains (~4 s of ~50 s: most of that import is loading its libraries).
"$PY" - <<'PY' | xargs -d '\n' "$PY" -m compileall -q -j0 numa_engram tests >/dev/null
import importlib.util
for name in ("numpy", "_pytest", "pytest", "pluggy", "iniconfig", "packaging", "pytest_timeout",
             "cffi", "safetensors", "tokenizers", "triton"):
    spec = importlib.util.find_spec(name)
    if spec and spec.origin:
        print(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin)
PY
tools/numa-vm --setup  # the kernel and initramfs, once, before both guests want them
# Only the plugin the NUMA tests use (the timeout): loading every installed
# one (hypothesis, anyio, xdist, coverage) took ~8 s of each guest's start.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
plugins=(-p pytest_timeout)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tools/numa-vm -n 2 -m 2048 -t 1500 -- "$PY" -m pytest -q -rs -m numa -p no:cacheprovider \
  "${plugins[@]}" -o timeout=1200 "${numa_tests[@]}" > "$out/2" 2>&1 &
two=$!
NUMA_ENGRAM_TEST_NO_TORCH=1 tools/numa-vm -n 4 -m 768 -t 1500 -- "$PY" -m pytest -q -rs \
  -m "numa and not torch" -p no:cacheprovider "${plugins[@]}" -o timeout=600 "${numa_tests[@]}" \
  > "$out/4" 2>&1 &
four=$!
status=0
wait "$two" || status=$?
rc=0; wait "$four" || rc=$?
[ "$status" != 0 ] || status=$rc
echo "== NUMA tests in a 2-node guest =="
cat "$out/2"
echo "== NUMA tests in a 4-node guest =="
cat "$out/4"
exit "$status"
