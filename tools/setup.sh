#!/usr/bin/env bash
# Install what numa_engram needs on a Debian/Ubuntu host into .venv:
# libnuma (for py-libnuma), a C compiler (the cffi core is built at install
# time), clang-format (tools/lint.sh checks the C core's format), torch (the
# CPU build unless TORCH_SPEC says otherwise; a serving host keeps its own
# CUDA build: set TORCH_SPEC=skip), then the package and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
need=()
[ -e /usr/lib/x86_64-linux-gnu/libnuma.so.1 ] || ldconfig -p | grep -q libnuma.so.1 || need+=(libnuma1)
command -v cc >/dev/null || need+=(gcc libc6-dev)
command -v clang-format >/dev/null || need+=(clang-format)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
  else
    echo "setup.sh: please install ${need[*]} (apt-get install ${need[*]})" >&2; exit 1
  fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# --no-compile: no bytecode for the ~10,000 files of torch and triton at
# install (12 s of the setup); an import compiles what it uses, once
pip=("$VENV/bin/python" -m pip install -q --no-compile)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# triton (the test extra's largest wheel, no dependencies) installs beside
# torch: no package is both's, so the two pips never write the same files
triton=$(sed -n 's/.*"\(triton>=[0-9.]*\).*/\1/p' pyproject.toml | head -1)
side=()
if [ "$(uname -m)" = x86_64 ]; then  # (the extra's marker)
  "${pip[@]}" --no-deps "$triton" &
  side=($!)
fi
[ "$TORCH_SPEC" = skip ] || "${pip[@]}" "$TORCH_SPEC"
[ ${#side[@]} = 0 ] || wait "${side[@]}"
# strict: the C core must build without a warning (-Wall -Wextra -Werror)
NUMA_ENGRAM_STRICT=1 "${pip[@]}" -e '.[test]'
