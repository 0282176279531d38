# Sourced by test.sh and check.sh: commands run beside a test run, their
# output held back until it is done.
#   beside [--low|--idle] NAME CMD...
#                        CMD in the background, in its own process group
#                        (a failed run ends all it started); with --low at
#                        nice 19, with --idle under SCHED_IDLE (below that:
#                        a third of its weight, and any other task that
#                        wakes takes the CPU from it at once)
#   report NAME...       each one's output and how long it took after the
#                        run began, in order; exits with the status of the
#                        first that failed
beside_dir=$(mktemp -d)
beside_start=$(date +%s)
beside_pids=()
beside_cleanup() {
  for p in "${beside_pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done
  rm -rf "$beside_dir"
}
trap beside_cleanup EXIT
beside() {
  local prio=normal
  case "$1" in --low|--idle) prio=${1#--}; shift;; esac
  local name=$1; shift
  # A step at normal priority starts a session (setsid) and with it a
  # scheduler autogroup, which gets its CPU share as a whole, as the run's
  # own does.  A low or idle one only starts a process group: in an
  # autogroup of its own it would get that share too, whatever its
  # processes' priority; in the run's, its priority counts against each of
  # the suite's processes.
  local start=(setsid)
  [ "$prio" = normal ] ||
    start=("$PY" -c 'import os, sys; os.setpgid(0, 0); os.execvp(sys.argv[1], sys.argv[1:])')
  PYTHON="$PY" "${start[@]}" bash -c '
    log=$0 prio=$1; shift
    case $prio in
      low) renice -n 19 $$ > /dev/null;;
      idle) chrt --idle -p 0 $$;;
    esac
    "$@" > "$log.log" 2>&1; echo $? > "$log.rc"; date +%s > "$log.end"' "$beside_dir/$name" "$prio" "$@" &
  beside_pids+=($!)
}
report() {
  wait "${beside_pids[@]}" || true
  beside_pids=()
  local name rc
  for name in "$@"; do
    echo "== $name (run beside the tests, done $(($(cat "$beside_dir/$name.end") - beside_start)) s after they began) =="
    cat "$beside_dir/$name.log"
    rc=$(cat "$beside_dir/$name.rc")
    [ "$rc" = 0 ] || { echo "$(basename "$0"): $name failed (status $rc)" >&2; exit "$rc"; }
  done
}
