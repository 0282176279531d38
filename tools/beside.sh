# Sourced by test.sh and check.sh: commands run beside a test run, their
# output held back until it is done.
#   beside NAME CMD...   CMD in the background, in its own process group
#                        (setsid: a failed run ends all it started)
#   report NAME...       each one's output, in order; exits with the status
#                        of the first that failed
beside_dir=$(mktemp -d)
beside_pids=()
beside_cleanup() {
  for p in "${beside_pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done
  rm -rf "$beside_dir"
}
trap beside_cleanup EXIT
beside() {
  local name=$1; shift
  PYTHON="$PY" setsid bash -c '"$@" > "$0.log" 2>&1; echo $? > "$0.rc"' "$beside_dir/$name" \
    "$@" &
  beside_pids+=($!)
}
report() {
  wait "${beside_pids[@]}" || true
  beside_pids=()
  local name rc
  for name in "$@"; do
    echo "== $name (run beside the tests) =="
    cat "$beside_dir/$name.log"
    rc=$(cat "$beside_dir/$name.rc")
    [ "$rc" = 0 ] || { echo "$(basename "$0"): $name failed (status $rc)" >&2; exit "$rc"; }
  done
}
