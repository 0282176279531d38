# Sourced by test.sh and check.sh: commands run beside a test run, their
# output held back until it is done.
#   beside [--idle] NAME CMD...
#                        CMD in the background, in its own process group
#                        (setsid: a failed run ends all it started); with
#                        --idle at the lowest priority, taking only the CPU
#                        the rest leaves
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
  local idle=0
  if [ "$1" = --idle ]; then idle=1; shift; fi
  local name=$1; shift
  # setsid also starts a scheduler autogroup (where the kernel has them),
  # which gets its CPU share as a whole whatever its processes' nice: an
  # idle step lowers its group's weight too
  PYTHON="$PY" setsid bash -c '
    log=$0 idle=$1; shift
    if [ "$idle" = 1 ]; then
      [ ! -w /proc/self/autogroup ] || echo 19 > /proc/self/autogroup
      renice -n 19 $$ > /dev/null
    fi
    "$@" > "$log.log" 2>&1; echo $? > "$log.rc"; date +%s > "$log.end"' "$beside_dir/$name" "$idle" "$@" &
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
