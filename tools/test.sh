#!/usr/bin/env bash
# Run every test: the host suite, then the NUMA placement tests in a
# 2-node and a 4-node guest (tools/numa-vm) unless this host already has
# >= 2 NUMA nodes, in which case they ran directly in the host suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYTHON="$PY" tools/lint.sh
numa_tests=(tests/test_numa_*.py)
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
guests=0
if [ "${NUMA_ENGRAM_SKIP_VM:-0}" = 1 ]; then
  echo "test.sh: NUMA_ENGRAM_SKIP_VM=1: placement tests in the VM skipped" >&2
elif [ "$nodes" -lt 2 ]; then
  guests=1
fi
# The 4-node guest (placement, no process worlds) runs beside the host
# suite, which leaves about a CPU idle (its tests wait on processes and
# timeouts); its output is printed, and its status checked, at the end.
vm4_pid=
if [ $guests = 1 ]; then
  vm4_out=$(mktemp)
  trap '[ -n "$vm4_pid" ] && kill "$vm4_pid" 2>/dev/null; rm -f "$vm4_out"' EXIT
  tools/numa-vm -n 4 -m 768 -t 900 -- "$PY" -m pytest -q -rs -m "numa and not multiproc" \
    -p no:cacheprovider -o timeout=600 "${numa_tests[@]}" > "$vm4_out" 2>&1 &
  vm4_pid=$!
fi
# coverage of the test process (spawned ranks and CLI subprocesses are not
# measured), printed per module that has lines no test ran
"$PY" -m pytest -q -rs --durations=15 --cov=numa_engram --cov-report=term:skip-covered "$@"
PYTHON="$PY" tools/check_package.sh
PYTHON="$PY" tools/check_min_deps.sh  # the dependencies' lower bounds, in a fresh venv
if [ -n "$vm4_pid" ]; then  # (done long since: before the sanitizer rebuilds the core in place)
  set +e; wait "$vm4_pid"; vm4_rc=$?; set -e; vm4_pid=
fi
PYTHON="$PY" tools/sanitize.sh  # the C core's tests under ASan + UBSan
if [ $guests = 1 ]; then
  # 2 nodes: every placement test, plus the DP-shared table across 4
  # processes (torch under emulation is slow: ~2 minutes); 4 nodes: placement.
  echo "== NUMA tests in a 2-node guest =="
  # (only the NUMA test files: collecting the others under emulation costs minutes)
  tools/numa-vm -n 2 -m 2048 -t 1500 -- "$PY" -m pytest -q -rs -m numa -p no:cacheprovider \
    -o timeout=1200 "${numa_tests[@]}"
  echo "== NUMA tests in a 4-node guest (run beside the host suite) =="
  cat "$vm4_out"
  [ "$vm4_rc" = 0 ] || { echo "test.sh: the 4-node guest failed (status $vm4_rc)" >&2; exit "$vm4_rc"; }
fi
