# Sourced by test.sh and check.sh: the host suite in parallel workers.
#   suite PYTEST_ARGS...
# Where this user may give each worker a /dev/shm of its own (root:
# tools/own_shm) and the host has more than one CPU, the suite runs in
# NUMA_ENGRAM_TEST_WORKERS workers (default: the CPUs, at most 4), a file
# per worker at a time (a file's module-scoped fixtures, a vLLM release's
# modules, are built once); a test marked `serial` (the host's huge page
# pools, every process's tables) runs while no other worker runs one
# (tests/conftest.py's lock, in NUMA_ENGRAM_TEST_LOCKS).  Elsewhere the
# suite runs in one process.
suite() {
  local workers=${NUMA_ENGRAM_TEST_WORKERS:-$(nproc)}
  [ "$workers" -le 4 ] || workers=4
  if [ "$workers" -lt 2 ] || ! tools/own_shm true 2>/dev/null \
      || ! "$PY" -c 'import xdist' 2>/dev/null; then
    "$PY" -m pytest "$@"
    return
  fi
  # the venv's python by its own path (resolving the link would leave the
  # venv), quoted: execnet splits the worker's command as a shell would
  local python locks status=0
  python=$(printf '%q' "$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")")
  locks=$(mktemp -d)
  # (--tx, not -n: -n would start plain interpreters)
  NUMA_ENGRAM_TEST_LOCKS=$locks "$PY" -m pytest --dist loadfile \
    --tx "$workers*popen//python=tools/own_shm $python" "$@" || status=$?
  rm -rf "$locks"
  return "$status"
}
