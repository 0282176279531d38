# Sourced after PY is set: UV is the uv beside $PY (the test extra installs
# it) or else the one on PATH.  uv installs in a tenth of pip's CPU time
# here, and these installs run beside the suite, taking from its CPUs.
UV=$(dirname "$PY")/uv
[ -x "$UV" ] || UV=$(command -v uv) || {
  echo "$(basename "$0"): uv not found (pip install uv; the test extra has it)" >&2; exit 1; }
