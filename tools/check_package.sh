#!/usr/bin/env bash
# The package as a user gets it: build the sdist, build a wheel from it (an
# isolated PEP 517 build), install that wheel in a clean venv (--no-deps,
# plus the light runtime deps: no multi-GB torch) and run the command line
# from it.  uv builds and installs (tools/uv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
source tools/uv.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$UV" build -q --sdist --python "$PY" --out-dir "$work/dist" . >"$work/build.log" 2>&1 ||
  { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/numa_engram-*.tar.gz)
listing=$(tar -tzf "$sdist")  # (not piped to grep -q: pipefail would see tar's SIGPIPE)
grep -q 'cffi_build/native.c' <<<"$listing" ||
  { echo "check_package: the sdist lacks cffi_build/native.c" >&2; exit 1; }
"$UV" build -q --wheel --python "$PY" --out-dir "$work/wheels" "$sdist" >"$work/build.log" 2>&1 ||
  { cat "$work/build.log"; exit 1; }
"$UV" venv -q --python "$PY" "$work/venv"
install=("$UV" pip install -q --python "$work/venv/bin/python")
"${install[@]}" --no-deps "$work"/wheels/numa_engram-*.whl
"${install[@]}" numpy cffi py-libnuma safetensors
cd "$work"  # not the source tree: the installed package must stand alone
"$work/venv/bin/numa-engram" --version
"$work/venv/bin/numa-engram" topo
"$work/venv/bin/python" -m numa_engram --version
echo "check_package: sdist -> wheel -> install -> numa-engram OK ($(basename "$sdist"))"
