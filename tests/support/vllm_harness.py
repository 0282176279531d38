"""vLLM's DeepSeek V4.1 Engram and Qwen4-Exp PLE modules, loaded from vLLM's
own wheel (0.31.0 by default, or any release in ``RELEASES``) under stub
modules for the ``vllm.*`` names they import, so that every line of vLLM's
that runs is vLLM's (its lookup kernel under Triton's interpreter on CPU
tensors).

A release's wheel is fetched once (``pip download --no-deps vllm==X``) and
the few files used are kept in ``$NUMA_ENGRAM_VLLM_CACHE`` (the default
release's directory, default ``~/.cache/numa_engram/vllm-0.31.0``; other
releases beside it as ``vllm-X``); a test that cannot have it is skipped
with the reason.  The stubs stand in for what this machine lacks (a GPU: a
device's SM count, UVA views as the CPU tensors themselves, no NVLink
peers) and for vLLM's process-group plumbing, which they back with real
torch.distributed gloo groups; the config is a plain namespace with the
fields the modules read.  ``release(version)`` loads one release's modules
in a process that may have loaded another (``sys.modules`` restored after).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from .untraced import untraced

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

VERSION = "0.31.0"  # the default release (the plugin's tests)
_V41 = "vllm/models/deepseek_v41/"
_QWEN = "vllm/models/qwen4_exp/"
_SHARED = (_V41 + "nvidia/vl_model.py",
           "vllm/transformers_utils/configs/deepseek_v41.py", "vllm/config/engram.py",
           "vllm/model_executor/models/utils.py",
           _QWEN + "common/ple.py",
           _QWEN + "common/ngram_embedding.py",
           _QWEN + "nvidia/ngram_embedding.py",
           "vllm/model_executor/layers/vocab_parallel_embedding.py")
# each release's files the harness loads (0.32 merged nvidia/engram.py into
# common/engram.py and moved the PLE kernels to common/ops/; 0.34 added the
# host-NUMA table module, imported on CUDA only: kept for reading)
RELEASES = {
    "0.31.0": (_V41 + "common/engram.py", _V41 + "nvidia/engram.py",
               _QWEN + "nvidia/ops/ple.py", _QWEN + "config.py", *_SHARED),
    "0.32.0": (_V41 + "common/engram.py", _QWEN + "common/ops/ple.py", *_SHARED),
    "0.33.0": (_V41 + "common/engram.py", _QWEN + "common/ops/ple.py", *_SHARED),
    "0.34.0": (_V41 + "common/engram.py", _QWEN + "common/ops/ple.py",
               _V41 + "nvidia/ops/engram_host_table.py", *_SHARED),
}
FILES = RELEASES[VERSION]
NV = "vllm.models.deepseek_v41.nvidia.engram"
COMMON = "vllm.models.deepseek_v41.common.engram"


def merged(version: str) -> bool:
    """Whether the release keeps V4.1's NVIDIA Engram code in common/engram.py."""
    return _V41 + "nvidia/engram.py" not in RELEASES[version]


def cache_dir(version: str = VERSION) -> Path:
    default = Path.home() / ".cache" / "numa_engram" / f"vllm-{VERSION}"
    base = Path(os.environ.get("NUMA_ENGRAM_VLLM_CACHE", default))
    return base if version == VERSION else base.parent / f"vllm-{version}"


def wheel_sources(version: str = VERSION) -> tuple[Path | None, str]:
    """(the directory holding the release's files, "") or (None, why not)."""
    if version not in RELEASES:
        return None, f"vLLM {version} is not a release the harness knows ({', '.join(RELEASES)})"
    root = cache_dir(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    # one filler at a time: the suite's parallel workers may each want it first
    with open(root.parent / f".vllm-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((root / f).is_file() for f in RELEASES[version]):
            return root, ""
        return _fill(root, version)


def _fill(root: Path, version: str) -> tuple[Path | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                  f"vllm=={version}", "-d", tmp], capture_output=True,
                                 text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"vLLM {version}'s wheel cannot be had here ({exc})"
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if got.returncode or not wheels:
            return None, (f"vLLM {version}'s wheel cannot be had here (pip download: "
                          f"{(got.stderr or got.stdout).strip()[-300:]})")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in RELEASES[version]:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(wheel.read(name))
    return root, ""


class _Logger(logging.Logger):
    def warning_once(self, msg: str, *args: object) -> None:
        self.warning(msg, *args)

    def info_once(self, msg: str, *args: object) -> None:
        self.info(msg, *args)


def _init_logger(name: str) -> logging.Logger:
    logger = _Logger(name)
    logger.parent = logging.getLogger()
    return logger


def set_weight_attrs(weight: object, attrs: dict | None) -> None:
    """vLLM's rule: an attribute is set once, never overwritten."""
    for key, value in (attrs or {}).items():
        assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
        setattr(weight, key, value)


class Coordinator:
    """What vLLM's GroupCoordinator shows of one real gloo group."""

    def __init__(self, ranks: list[int], pg: object) -> None:
        import torch.distributed as dist

        self.ranks, self.cpu_group, self.device_group = ranks, pg, pg
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if dist.is_initialized() else 0

    def all_gather(self, tensor, dim: int = 0):
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.cpu_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]


class State:
    """The stubs' world: this rank's TP and Engram-DP groups and the config."""

    tp: Coordinator | None = None
    edp: Coordinator | None = None
    dp: Coordinator | None = None
    config: SimpleNamespace | None = None
    forward: SimpleNamespace = SimpleNamespace(dp_metadata=None)


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attrs)
    if "." in name:
        parent, _, leaf = name.rpartition(".")
        setattr(_module(parent), leaf, module)
    if not hasattr(module, "__path__"):
        module.__path__ = []  # a package: its children are stubs or loaded by path
    sys.modules[name] = module
    return module


def install_stubs(version: str = VERSION) -> None:
    with untraced():  # (outside packages' imports, as vLLM's module bodies in load)
        import torch
        import triton
        import triton.language as tl

    def tp_all_gather(tensor, dim=-1):
        return State.tp.all_gather(tensor, dim=dim) if State.tp else tensor

    _module("vllm", __version__=version)
    _module("vllm.config", get_current_vllm_config=lambda: State.config, VllmConfig=object)
    _module("vllm.distributed",
            get_tensor_model_parallel_rank=lambda: State.tp.rank_in_group if State.tp else 0,
            get_tensor_model_parallel_world_size=lambda: State.tp.world_size if State.tp
            else 1,
            tensor_model_parallel_all_gather=tp_all_gather,
            get_dp_group=lambda: State.dp, get_engram_dp_group=lambda: State.edp,
            get_engram_dp_size=lambda: State.edp.world_size if State.edp else 1)
    _module("vllm.distributed.device_communicators.shm_broadcast", SHM_PATH="/dev/shm",
            check_shm_free_space=check_shm_free_space)
    _module("vllm.distributed.parallel_state", GroupCoordinator=Coordinator,
            in_the_same_node_as=in_the_same_node_as)
    _module("vllm.forward_context", get_forward_context=lambda: State.forward,
            is_forward_context_available=lambda: False)
    _module("vllm.logger", init_logger=_init_logger)
    _module("vllm.model_executor.utils", set_weight_attrs=set_weight_attrs,
            copy_weight_=copy_weight_)
    _module("vllm.model_executor.layers.linear", ColumnParallelLinear=object)
    _module("vllm.model_executor.layers.quantization", QuantizationConfig=object)
    _module("vllm.triton_utils", tl=tl, triton=triton)
    _module("vllm.compilation.breakable_cudagraph", eager_break_during_capture=lambda f: f)
    _module("vllm.utils.platform_utils", is_uva_available=lambda: True)
    _module("vllm.utils.torch_utils", get_accelerator_view_from_cpu_tensor=lambda t: t)
    _module("vllm.utils.cpu_resource_utils", get_available_memory=available_memory)
    _module("vllm.platforms", current_platform=SimpleNamespace(
        is_rocm=lambda: False, is_cuda_alike=lambda: True, is_arch_support_pdl=lambda: False,
        simple_compile_backend="eager",
        # the CUDA-only steps of 0.32+ (GB200 lookup thresholds, cuMem host
        # tables, NVLink peer rows, integrated-GPU copies) are not this machine
        is_cuda=lambda: False, is_device_capability_family=lambda *a, **k: False,
        is_integrated_gpu=lambda *a, **k: False, is_fully_connected=lambda ids: False,
        visible_device_id_to_physical_device_id=lambda index: index))
    # names 0.32+'s common/engram.py imports for code the harness never runs
    # (the packed-FP8 staging's quantised activations)
    for name in ("vllm.model_executor.layers.fusion.quant_activation",
                 "vllm.model_executor.layers.quantization.utils.quant_utils",
                 "vllm.models.deepseek_v41.common.ops.query_quant"):
        _open(name)
    for package in ("vllm.models", "vllm.models.deepseek_v41",
                    "vllm.models.deepseek_v41.common", "vllm.models.deepseek_v41.nvidia"):
        _module(package)
    if not torch.cuda.is_available():  # the SM count vLLM's constructor reads (grid size)
        torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(
            multi_processor_count=4)
        torch.accelerator.current_device_index = lambda: 0


def check_shm_free_space(num_bytes: int, allocation_name: str = "shared memory") -> None:
    """vLLM's check that /dev/shm has room for an allocation."""
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if free < num_bytes:
        raise ValueError(f"{allocation_name} need {num_bytes} bytes of /dev/shm, "
                         f"{free} are free")


def in_the_same_node_as(pg: object, source_rank: int = 0) -> list[bool]:
    """vLLM's per-rank "same node as source_rank": every rank of the harness
    is a process of this machine."""
    import torch.distributed as dist

    del source_rank
    return [True] * dist.get_world_size(pg)


def available_memory() -> int:
    """Host memory available (MemAvailable), as vLLM 0.34's check reads it."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def copy_weight_(dst, src):
    """vLLM 0.34's copy for weight loaders: off integrated GPUs, ``copy_``."""
    return dst.copy_(src)


def is_fp8(x) -> bool:
    """vLLM's fp8_utils.is_fp8."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.dtype
    return x in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def load(root: Path, name: str, relative: str) -> types.ModuleType:
    """Run one of vLLM's files as module ``name`` (once per process)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, root / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with untraced():  # vLLM's own module body
        spec.loader.exec_module(module)
    return module


def vllm_modules(root: Path, version: str = VERSION) -> tuple[types.ModuleType,
                                                                 types.ModuleType]:
    """(nvidia/engram.py, common/engram.py) of the release, under the stubs;
    from 0.32 on, one module (common/engram.py) twice."""
    install_stubs(version)
    common = load(root, COMMON, _V41 + "common/engram.py")
    if merged(version):
        return common, common
    return load(root, NV, _V41 + "nvidia/engram.py"), common


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Load a release in a process that may hold another's modules: the
    ``vllm`` (and stand-in ``transformers``) modules and the stubs' State as
    they were before, once the block ends."""
    def ours(name: str) -> bool:
        return name.split(".")[0] in ("vllm", "transformers")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    state = dict(vars(State))
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        for key, value in state.items():
            if not key.startswith("__"):
                setattr(State, key, value)


def config(model_dir: str, *, dp_shared: bool = False, additional: dict | None = None,
           load_format: str = "auto", use_thp: bool = False, cpu_offload: bool = True,
           max_tokens: int = 64, disk_offload: bool = False,
           model: str | None = None) -> SimpleNamespace:
    """The fields of vLLM's config the Engram modules and the plugin read
    (``disk_offload``: 0.34's, read by its Qwen4-Exp PLE code only):
    ``model_config.hf_config`` parsed from ``model_dir``'s config.json as
    vLLM parses it (``hf_config``); ``model``: what vLLM was given (a hub
    id, say), ``model_dir`` by default."""
    return SimpleNamespace(
        engram_config=SimpleNamespace(cpu_offload=cpu_offload, dp_shared_memory=dp_shared,
                                      use_thp=use_thp, embedding_across_dp=False,
                                      disk_offload=disk_offload),
        additional_config={"numa_engram": additional or {}},
        model_config=SimpleNamespace(model=model_dir if model is None else model,
                                     hf_config=hf_config(model_dir)),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens))


def hf_config(model_dir: str) -> SimpleNamespace | None:
    """vLLM's ``hf_config`` of a model directory's config.json (None
    without one): V4.1's ``DeepseekV41Config`` flattens its text_config's
    fields onto the top level; Qwen4-Exp's keeps a ``text_config`` object."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    text = doc.pop("text_config", None)
    if doc.get("model_type") == "deepseek_v41":
        return SimpleNamespace(**{**doc, **{k: v for k, v in (text or {}).items()
                                            if k != "model_type"}})
    if isinstance(text, dict):
        doc["text_config"] = SimpleNamespace(**text)
    return SimpleNamespace(**doc)


def layout_of(common: types.ModuleType, model_dir: str):
    """vLLM's EngramLayout of the model directory's config.json."""
    import json

    doc = json.loads((Path(model_dir) / "config.json").read_text())
    text = doc.get("text_config", doc)
    return common.EngramLayout(SimpleNamespace(**text))


def thin_engram(nv: types.ModuleType, layer_hash_index: int = 0) -> object:
    """The thin ``self`` ``_create_embedding`` gets (its module not set up):
    the fields vLLM's Engram has set by then."""
    engram = nv.Engram.__new__(nv.Engram)
    engram.__dict__.update(layer_hash_index=layer_hash_index, dim=64, hc_mult=1, eps=1e-6,
                           clamp_value=1e-6, use_sequence_parallel=False,
                           _prefetch_stream=None)
    return engram


def load_checkpoint(emb: object, model_dir: str, layer_id: int) -> int:
    """vLLM's loader for one layer: each Engram tensor through the param's
    own weight_loader (the scale as float8_e8m0fnu, as V4.1 ships it); how
    many calls it made."""
    import torch
    from safetensors import safe_open

    from numa_engram.checkpoints.checkpoint import checkpoint_files, find_names

    files = checkpoint_files(model_dir)
    w_name, s_name = find_names(files, layer_id).of(layer_id)
    for name, param in ((w_name, emb.weight), (s_name, emb.weight_scale_inv)):
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        if param is emb.weight_scale_inv and tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.float8_e8m0fnu)
        param.weight_loader(param, tensor)
    return 2


def _open(name: str) -> types.ModuleType:
    """A stub module whose every missing name is a fresh empty class (names
    vLLM's files import but the code run here never calls)."""
    module = _module(name)

    def missing(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (), {})
        setattr(module, attr, value)
        return value

    module.__getattr__ = missing  # type: ignore[method-assign]
    return module


def _pluggable_layer() -> type:
    """vLLM's PluggableLayer as the PLE code uses it: an nn.Module whose
    ``register`` leaves a class as it is."""
    import torch

    class PluggableLayer(torch.nn.Module):
        @classmethod
        def register(cls, _name: str):
            return lambda klass: klass

    return PluggableLayer


def _parameters() -> dict[str, type]:
    """vLLM's parameter classes as the PLE code uses them (vllm/model_executor/
    parameter.py): a Parameter that keeps its loader and dims."""
    import torch

    class BasevLLMParameter(torch.nn.Parameter):
        def __new__(cls, data, **kwargs):
            return super().__new__(cls, data=data, requires_grad=False)

        def __init__(self, data, weight_loader=None, input_dim=None, output_dim=None):
            self._weight_loader = weight_loader
            if input_dim is not None:
                self.input_dim = input_dim
            if output_dim is not None:
                self.output_dim = output_dim

        @property
        def weight_loader(self):
            return self._weight_loader

    class ModelWeightParameter(BasevLLMParameter):
        pass

    class PerTensorScaleParameter(BasevLLMParameter):
        pass

    return {"BasevLLMParameter": BasevLLMParameter, "ModelWeightParameter": ModelWeightParameter,
            "PerTensorScaleParameter": PerTensorScaleParameter}


def _create_fp8_scale_parameter(parameter_type, output_partition_sizes, input_size_per_partition,
                                block_size, weight_loader, scale_dtype=None):
    """vLLM's per-tensor branch: one scale per partition, the sentinel
    (float32's min) until the checkpoint's is loaded."""
    import torch

    del input_size_per_partition, block_size
    scale = parameter_type(data=torch.empty(len(output_partition_sizes), dtype=scale_dtype),
                           weight_loader=weight_loader)
    scale[:] = torch.finfo(torch.float32).min
    return scale


class _CPUStream:
    """What the pinned PLE table's constructor makes for its prefetch when
    there is no GPU (its lookup is not run here)."""

    def __init__(self, *args: object, device: object = None, **kwargs: object) -> None:
        self.device = device


def qwen4_config(spec_doc: dict) -> SimpleNamespace:
    """The Qwen4ExpTextConfig fields vLLM's PLE module reads."""
    return SimpleNamespace(
        ngram_size=spec_doc["ngram_size"], heads_per_ngram=spec_doc["heads_per_ngram"],
        eos_token_id=spec_doc["eos_token_id"], vocab_size=spec_doc["vocab_size"],
        split_ngram_parts=spec_doc["split_ngram_parts"], seed=spec_doc["seed"],
        ngram_vocab_size_base=spec_doc["ngram_vocab_size_base"],
        make_ngram_vocab_size_divisible_by=spec_doc["make_ngram_vocab_size_divisible_by"],
        ple_embedding_dtype=spec_doc["dtype"])


def ple_layer(nv: types.ModuleType, spec_doc: dict, layer_id: int, *, max_tokens: int = 64,
              dp_rank: int = 0) -> object:
    """vLLM's Qwen4ExpNGramEmbedding of a PLE layer (1-based id), as the
    model builds it (prefix ``model.layers.{id - 1}.ple.ple_embedding``)."""
    import torch

    dense = sorted(spec_doc["layer_ids"]).index(layer_id)
    stream = torch.cuda.Stream
    if not torch.cuda.is_available():  # only while vLLM's constructor runs
        torch.cuda.Stream = _CPUStream
    try:
        return nv.Qwen4ExpNGramEmbedding(
            qwen4_config(spec_doc), spec_doc["ple_embed_dim"], dense, max_tokens,
            data_parallel_rank=dp_rank, prefix=f"model.layers.{layer_id - 1}.ple.ple_embedding")
    finally:
        torch.cuda.Stream = stream


def load_ple_checkpoint(module: object, checkpoint: str, layer_id: int) -> int:
    """vLLM's loading of one PLE layer: its split parts through the module's
    load_weights, its scale through the parameter's weight_loader (as
    AutoWeightsLoader calls it); how many tensors it handed."""
    from safetensors import safe_open

    prefix = f"model.layers.{layer_id - 1}.ple.ple_embedding."
    handed = 0
    with safe_open(checkpoint, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if not name.startswith(prefix):
                continue
            local, tensor = name[len(prefix):], f.get_tensor(name)
            if local == "ngram_embedding.weight_scale":
                param = module.ngram_embedding.weight_scale
                param.weight_loader(param, tensor)
            else:
                module.load_weights([(local, tensor)])
            handed += 1
    return handed


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def _round_up(x: int, y: int) -> int:
    """vllm.utils.math_utils.round_up."""
    return ((x + y - 1) // y) * y


def _transformers(*names: str) -> None:
    """Classes vLLM 0.32+ imports from ``transformers`` (Qwen4-Exp's config,
    used as an annotation): transformers' own where it has them, else
    stand-ins (a ``transformers`` stub where it is not installed)."""
    try:
        with untraced():
            import transformers
    except ImportError:
        transformers = _module("transformers")
    for name in names:
        if not hasattr(transformers, name):
            setattr(transformers, name, type(name, (), {}))


def ple_stubs(root: Path, version: str = VERSION) -> types.ModuleType:
    """The stubs vLLM's qwen4_exp files import, and vLLM's own
    vocab_parallel_embedding.py (returned) that they build on."""
    install_stubs(version)
    distributed = sys.modules["vllm.distributed"]
    distributed.__dict__.update(
        divide=_divide, GroupCoordinator=Coordinator, get_etp_group=lambda: State.tp,
        get_tp_group=lambda: State.tp, tensor_model_parallel_all_reduce=lambda t: t)
    for name in ("vllm.envs", "vllm._custom_ops", "vllm.model_executor.determinism.batch_invariant",
                 "vllm.model_executor.layers.quantization.base_config",
                 "vllm.model_executor.layers.quantization.fp8",
                 "vllm.model_executor.layers.quantization.modelopt",
                 "vllm.model_executor.layers.quantization.utils.fp8_utils",
                 "vllm.model_executor.layers.quantization.utils.quant_utils",
                 "vllm.model_executor.layers.utils", "vllm.model_executor.parameter",
                 "vllm.model_executor.models.utils", "vllm.transformers_utils.configs.qwen4_exp",
                 "vllm.v1.attention.backends.utils",
                 # 0.32+: other quantisation configs (never this checkpoint's),
                 # sequence parallelism, NVFP4 rows, GPU sync checks
                 "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                 "vllm.model_executor.layers.quantization.inc",
                 "vllm.model_executor.layers.quantization.quark.quark",
                 "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils",
                 "vllm.models.common.ops.sequence_parallel", "vllm.utils.gpu_sync_debug"):
        _open(name)
    _transformers("Qwen4ExpTextConfig")
    _module("vllm.utils.math_utils", round_up=_round_up)
    _module("vllm.model_executor.custom_op", PluggableLayer=_pluggable_layer())
    _module("vllm.model_executor.layers.quantization.base_config",
            method_has_implemented_embedding=lambda cls: hasattr(cls, "embedding"))
    _module("vllm.model_executor.parameter", **_parameters())
    _module("vllm.model_executor.layers.quantization.utils.fp8_utils",
            create_fp8_scale_parameter=_create_fp8_scale_parameter, is_fp8=is_fp8)
    platform = sys.modules["vllm.platforms"].current_platform
    platform.is_cuda = lambda: False
    _module("vllm.forward_context", DPMetadata=object)
    _module("vllm.utils.torch_utils", direct_register_custom_op=lambda *a, **k: None)
    _module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0)
    vocab = load(root, "vllm.model_executor.layers.vocab_parallel_embedding",
                 "vllm/model_executor/layers/vocab_parallel_embedding.py")
    return vocab


def ple_modules(root: Path, version: str = VERSION) -> SimpleNamespace:
    """A release's Qwen4-Exp PLE code under the stubs: ``nv``
    (nvidia/ngram_embedding.py), ``common`` (common/ngram_embedding.py),
    ``ple`` (common/ple.py), ``ops`` (the n-gram id kernels, under the
    interpreter: nvidia/ops/ple.py in 0.31, common/ops/ple.py from 0.32),
    ``vocab`` (vocab_parallel_embedding.py)."""
    vocab = ple_stubs(root, version)
    ops_package = "common" if merged(version) else "nvidia"
    for package in ("vllm.models.qwen4_exp", "vllm.models.qwen4_exp.common",
                    "vllm.models.qwen4_exp.nvidia", f"vllm.models.qwen4_exp.{ops_package}.ops"):
        _module(package)
    ple = load(root, "vllm.models.qwen4_exp.common.ple", _QWEN + "common/ple.py")
    common = load(root, "vllm.models.qwen4_exp.common.ngram_embedding",
                  _QWEN + "common/ngram_embedding.py")
    ops = load(root, f"vllm.models.qwen4_exp.{ops_package}.ops.ple",
               f"{_QWEN}{ops_package}/ops/ple.py")
    nv = load(root, "vllm.models.qwen4_exp.nvidia.ngram_embedding",
              _QWEN + "nvidia/ngram_embedding.py")
    return SimpleNamespace(nv=nv, common=common, ops=ops, vocab=vocab, ple=ple)
