#!/usr/bin/env bash
# The oldest versions pyproject.toml allows: numpy, cffi, safetensors and
# py-libnuma pinned to their `>=` bounds in a fresh venv, the C core built
# with that cffi in a copy of HEAD, and the tests of what those packages
# touch run there (the native core, lookups, hashing, checkpoints, tables).
# A bound set too low fails here.  torch is the main venv's own install,
# reached through a .pth after the pinned packages (the wheel cache holds
# only its CPU build: torch 2.7, the bound, is a CUDA wheel that needs
# NVIDIA's libraries to import; installing the same torch again took 20 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
source tools/uv.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir "$WORK/src"
git archive HEAD | tar -x -C "$WORK/src"
pins=$("$PY" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
out = []
for dep in deps:
    name, low = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)\s*", dep).groups()
    if name != "torch":
        out.append(f"{name}=={low}")
print(" ".join(out))
PY
)
torch=$("$PY" -c 'import torch; print(torch.__version__)')
main_site=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
base=$("$PY" -c 'import sys; print(sys._base_executable)')
"$UV" venv -q --python "$base" "$WORK/venv"
echo "check_min_deps: $pins, torch $torch (the main venv's)"
# shellcheck disable=SC2086  # (the pins are words)
"$UV" pip install -q --python "$WORK/venv/bin/python" $pins pytest pytest-timeout hypothesis \
  "setuptools>=77"
# the main venv's packages after this venv's own: the pins shadow their
# newer copies, torch (and what it needs) is found there
site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$main_site" > "$site/main-venv.pth"
"$WORK/venv/bin/python" - "$pins" <<'PY'
import importlib.metadata as md, sys
def release(v):
    parts = [int(x) for x in v.split(".")]
    return parts + [0] * (4 - len(parts))
for pin in sys.argv[1].split():
    name, want = pin.split("==")
    got = md.version(name)  # the first on the path: this venv's
    assert release(got) == release(want), f"{name} {got} is found, not the pinned {want}"
PY
cd "$WORK/src"
"$WORK/venv/bin/python" setup.py -q build_ext --inplace >/dev/null
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider -m "not multiproc" \
  tests/test_native.py tests/test_lookup.py tests/test_hashing.py tests/test_checkpoint.py \
  tests/test_table.py tests/test_out_guards.py
