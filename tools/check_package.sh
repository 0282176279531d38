#!/usr/bin/env bash
# The package as a user gets it: build the sdist, build a wheel from it in a
# clean venv, install that wheel (--no-deps, plus the light runtime deps: no
# multi-GB torch) and run the command line from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m build --sdist --outdir "$work/dist" . >"$work/build.log" 2>&1 ||
  { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/numa_engram-*.tar.gz)
listing=$(tar -tzf "$sdist")  # (not piped to grep -q: pipefail would see tar's SIGPIPE)
grep -q 'cffi_build/native.c' <<<"$listing" ||
  { echo "check_package: the sdist lacks cffi_build/native.c" >&2; exit 1; }
"$PY" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" wheel -q --no-deps -w "$work/wheels" "$sdist"
"$work/venv/bin/pip" install -q --no-deps "$work"/wheels/numa_engram-*.whl
"$work/venv/bin/pip" install -q numpy cffi py-libnuma safetensors
cd "$work"  # not the source tree: the installed package must stand alone
"$work/venv/bin/numa-engram" --version
"$work/venv/bin/numa-engram" topo
"$work/venv/bin/python" -m numa_engram --version
echo "check_package: sdist -> wheel -> install -> numa-engram OK ($(basename "$sdist"))"
