"""The harness (tests/support/vllm_harness.py) against each vLLM release the plugin
serves, 0.31.0 to 0.34.0, with no plugin: vLLM's own DeepSeek V4.1
``ParallelEngramEmbedding`` and Qwen4-Exp ``Qwen4ExpNGramEmbedding``, built
by vLLM's own code in each storage branch this machine can run (HBM as
torch tensors, TP and DP-sharded slices, 0.33+'s meta device, 0.34's PLE
rows read from the checkpoint files (disk_offload); the pinned
and THP branches need CUDA and run where it is; vLLM's own DP-shared storage
needs CUDA registration on every rank: not here), filled by vLLM's
own weight loaders from a synthetic checkpoint, hold its rows byte for byte
and vLLM's kernels return its rows (a reference dequantisation written from
the format, not from vLLM's code).

Each release's files are fetched once per cache (``pip download``); a
release that cannot be had is skipped with the reason."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from .support import ple_scenarios, vllm_releases  # noqa: E402
from .support import vllm_harness as harness  # noqa: E402
from .support.vllm_releases import PLE, SPEC  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'numa_engram[test]')")
pytest.importorskip("safetensors", reason="safetensors is not installed")

# the shared fixtures, found by pytest in this module's globals
release = vllm_releases.release_fixture(patched=False)
model_dir, ple_dir = vllm_releases.model_dir, vllm_releases.ple_dir
one_rank = vllm_releases.one_rank
NO_CUDA = "vLLM's pinned and THP host tables need CUDA (pin_memory, cudaHostRegister)"


def _coordinator(rank: int, size: int) -> SimpleNamespace:
    """What vLLM's construction reads of a group (no collective is called)."""
    return SimpleNamespace(rank_in_group=rank, world_size=size, ranks=list(range(size)),
                           cpu_group=None, device_group=None)


def checkpoint_layer(model_dir: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weights (fp8) and scale bytes, read by safetensors."""
    from safetensors import safe_open

    from numa_engram.checkpoints.checkpoint import checkpoint_files, find_names

    files = checkpoint_files(model_dir)
    out = []
    for name in find_names(files, layer).of(layer):
        with safe_open(files[name], framework="pt") as f:
            out.append(f.get_tensor(name))
    weight, scales = out
    return weight, scales.view(torch.uint8)


def reference_rows(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                   block: int) -> torch.Tensor:
    """BF16 rows of global ids (-1: a zero row): the e4m3 value times
    2^(scale byte - 127) as an fp32 of exponent bits ``byte << 23``,
    rounded to BF16 (REFERENCE §2)."""
    valid = ids >= 0
    rows = weight[ids.clamp(min=0)].to(torch.float32)
    exps = (scales[ids.clamp(min=0)].to(torch.int32) << 23).view(torch.float32)
    out = (rows * exps.repeat_interleave(block, dim=-1)).to(torch.bfloat16)
    return torch.where(valid[..., None], out, torch.zeros((), dtype=torch.bfloat16))


def global_ids(layer: int, tokens: int, seed: int) -> torch.Tensor:
    """Rows of the layer's whole table per head (V4.1's id format), some -1."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(SPEC.bucket_sizes(layer))
    base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    ids = base + (rng.integers(0, 1 << 40, (tokens, len(sizes))) % sizes)
    ids[rng.random(ids.shape) < 0.1] = -1
    return torch.from_numpy(ids.astype(np.int64))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _embedding(release, layout, index):
    """vLLM's own ``Engram._create_embedding`` of the layer (the config's
    storage flags, vLLM's ``ParallelEngramEmbedding``)."""
    emb = release.nv.Engram._create_embedding(harness.thin_engram(release.nv, index),
                                              layout, index)
    assert type(emb) is release.nv.ParallelEngramEmbedding
    return emb


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> int:
    """Bit-for-bit; the count of values compared (printed with the label)."""
    mismatches = int((got.contiguous().view(torch.uint8) != want.contiguous().view(
        torch.uint8)).sum()) if got.shape == want.shape else -1
    print(f"{label}: {want.numel()} values compared, {mismatches} mismatches")
    assert got.shape == want.shape and mismatches == 0, label
    return want.numel()


def _assigned(path, scope: str, name: str):
    """The literal a release's file assigns to ``name`` (in class ``scope``,
    or at module level for ""), read without importing the file."""
    import ast

    tree = ast.parse(path.read_text())
    body = tree.body if not scope else next(
        node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and
        node.name == scope)
    for node in body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {scope}.{name}")


def test_the_synthetic_model_is_v41_to_each_release(release, model_dir):
    """config.json names the model type of the release's V4.1 config class
    and an architecture its EngramConfig serves (by its Engram field), and
    carries the text model's fields in the ranges V4.1's attention accepts:
    compress ratios 0, 1 or 2, one per layer; a KV and an index source at or
    before each compressed layer (0.32+ reads max(kv_source_layer_ids))."""
    import json

    root = harness.cache_dir(release.version)
    doc = json.loads(Path(model_dir, "config.json").read_text())
    text = doc["text_config"]
    assert doc["model_type"] == _assigned(
        root / "vllm/transformers_utils/configs/deepseek_v41.py", "DeepseekV41Config",
        "model_type")
    fields = _assigned(root / "vllm/config/engram.py", "", "_NGRAM_LAYER_FIELDS")
    assert doc["architectures"] == ["DeepseekV41ForCausalLM"]
    assert text[fields[doc["architectures"][0]]] == list(SPEC.layer_ids)
    ratios = text["compress_ratios"]
    assert len(ratios) == text["num_hidden_layers"] > max(SPEC.layer_ids)
    assert set(ratios) <= {0, 1, 2} and any(ratios)
    for layer, ratio in enumerate(ratios):
        if ratio:
            assert min(text["kv_source_layer_ids"]) <= layer
            assert min(text["index_source_layer_ids"]) <= layer
    assert ratios[max(text["kv_source_layer_ids"])] > 0
    assert text["head_dim"] == 512 and text["qk_rope_head_dim"] == 64  # a compressed layer's
    assert text["num_attention_heads"] % text["o_groups"] == 0


def test_hbm_tables_hold_the_checkpoint_and_vllms_kernel_returns_its_rows(release, model_dir):
    """cpu_offload=False, TP 1: vLLM's tables (torch tensors) filled by its
    head-shard loader equal the checkpoint; its forward (lookup kernel)
    equals the reference rows for every head, -1 ids zero."""
    harness.State.config = harness.config(model_dir, cpu_offload=False)
    layout = harness.layout_of(release.common, model_dir)
    for index, layer in enumerate(layout.layer_ids):
        emb = _embedding(release, layout, index)
        assert (emb.head_start, emb.vocab_start_idx, emb.vocab_end_idx) == \
            (0, 0, SPEC.rows(layer))
        assert emb.weight.dtype == torch.float8_e4m3fn
        assert harness.load_checkpoint(emb, model_dir, layer) == 2
        weight, scales = checkpoint_layer(model_dir, layer)
        _compare(f"{release.version} layer {layer} weights", emb.weight.data, weight)
        _compare(f"{release.version} layer {layer} scales", emb.weight_scale_inv.data, scales)
        ids = global_ids(layer, 48, seed=layer)
        _compare(f"{release.version} layer {layer} rows", emb(ids),
                 reference_rows(weight, scales, ids, SPEC.block))


@pytest.mark.parametrize("tp,edp,rank", [(2, 1, 1), (2, 2, 3)])
def test_tp_and_dp_sharded_slices_hold_their_heads_rows(release, model_dir, tp, edp, rank):
    """A TP slice (TP rank 1 of 2) and a DP-sharded slice (shard 3 of TP 2
    x EDP 2, numbered TP-major): the whole heads vLLM assigns, their rows
    from the checkpoint, and its kernel's rows for those heads (other heads'
    ids write zeros)."""
    harness.State.tp = _coordinator(rank // edp, tp)
    if edp > 1:
        harness.State.edp = _coordinator(rank % edp, edp)
    harness.State.config = harness.config(model_dir, cpu_offload=False)
    layout = harness.layout_of(release.common, model_dir)
    layer = layout.layer_ids[0]
    emb = _embedding(release, layout, 0)
    part = -(-SPEC.n_hash_cols // (tp * edp))
    sizes = SPEC.bucket_sizes(layer)
    assert (emb.head_start, emb.part_n_hash_cols) == (rank * part, part)
    assert (emb.vocab_start_idx, emb.vocab_end_idx) == (sum(sizes[:rank * part]),
                                                        sum(sizes[:(rank + 1) * part]))
    assert emb.weight.shape[0] == emb.vocab_end_idx - emb.vocab_start_idx
    harness.load_checkpoint(emb, model_dir, layer)
    weight, scales = checkpoint_layer(model_dir, layer)
    rows = slice(emb.vocab_start_idx, emb.vocab_end_idx)
    _compare(f"{release.version} shard {rank}/{tp * edp} weights", emb.weight.data,
             weight[rows])
    _compare(f"{release.version} shard {rank}/{tp * edp} scales", emb.weight_scale_inv.data,
             scales[rows])
    ids = global_ids(layer, 32, seed=rank)
    out = torch.empty(ids.shape[0], emb.part_n_hash_cols, SPEC.head_dim, dtype=torch.bfloat16)
    emb.lookup(ids, out)
    heads = slice(emb.head_start, emb.head_start + emb.part_n_hash_cols)
    _compare(f"{release.version} shard {rank}/{tp * edp} rows", out,
             reference_rows(weight, scales, ids, SPEC.block)[:, heads])


def test_meta_device_construction_allocates_no_table(release, model_dir):
    """0.33+: under the meta device vLLM's host branches allocate nothing
    (meta tensors, no dummy values, no log of a host table)."""
    if release.version < "0.33.0":
        pytest.skip(f"vLLM {release.version} has no meta-device branch (new in 0.33.0)")
    harness.State.config = harness.config(model_dir, cpu_offload=True)
    layout = harness.layout_of(release.common, model_dir)
    with torch.device("meta"):
        emb = _embedding(release, layout, 0)
    assert emb.weight.is_meta and emb.weight_scale_inv.is_meta
    assert emb.weight.shape == (SPEC.rows(layout.layer_ids[0]), SPEC.head_dim)
    assert not hasattr(emb.weight, "dummy_weight_value")
    assert emb._shared_memory is None and emb.peer_rows == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("thp", [False, True])
def test_pinned_and_thp_host_tables_hold_the_checkpoint(release, model_dir, thp):
    """cpu_offload=True, private: pinned (or THP, registered) host tables
    filled by vLLM's loader equal the checkpoint."""
    harness.State.config = harness.config(model_dir, cpu_offload=True, use_thp=thp)
    layout = harness.layout_of(release.common, model_dir)
    layer = layout.layer_ids[0]
    emb = _embedding(release, layout, 0)
    assert emb.weight.is_pinned() and emb.weight.device.type == "cpu"
    harness.load_checkpoint(emb, model_dir, layer)
    weight, scales = checkpoint_layer(model_dir, layer)
    _compare(f"{release.version} pinned thp={thp} weights", emb.weight.data, weight)
    _compare(f"{release.version} pinned thp={thp} scales", emb.weight_scale_inv.data, scales)


# ----------------------------------------------------------- Qwen4-Exp PLE --

def ple_layer(release, ple_dir, layer, **config):
    harness.State.tp = harness.State.tp or _coordinator(0, 1)
    harness.State.config = harness.config(ple_dir, **config)
    return harness.ple_layer(release.ple.nv, PLE.to_dict(), layer)


@pytest.mark.parametrize("etp,rank", [(1, 0), (2, 1)])
def test_ple_device_tables_hold_the_checkpoint_and_vllms_rows(release, ple_dir, etp, rank):
    """cpu_offload=False: vLLM's Qwen4ExpPLEDeviceEmbedding of each PLE layer
    (ETP 1, and ETP rank 1 of 2), filled by vLLM's load_weights from the
    split parts, holds the checkpoint's rows of its range and its scale;
    vLLM's row path (F.embedding, dequantize) gives the reference rows."""
    harness.State.tp = _coordinator(rank, etp)
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    for layer in PLE.layer_ids:
        module = ple_layer(release, ple_dir, layer, cpu_offload=False)
        emb = module.ngram_embedding
        assert type(emb).__name__ == "Qwen4ExpPLEDeviceEmbedding"
        start, end = PLE.shard_rows(layer, rank, etp)
        assert (emb.shard_indices.org_vocab_start_index,
                emb.shard_indices.org_vocab_end_index) == (start, end)
        assert harness.load_ple_checkpoint(module, checkpoint, layer) == \
            PLE.split_ngram_parts + 1
        whole, scale = ple_scenarios.whole_table(checkpoint, PLE, layer)
        label = f"{release.version} PLE layer {layer} ETP {rank}/{etp}"
        _compare(f"{label} weights", emb.weight.data[:end - start], whole[start:end])
        assert float(emb.weight_scale.reshape(-1)[0]) == scale
        if etp == 1:
            ids = np.random.default_rng(layer).integers(0, PLE.rows(layer), (64, PLE.n_heads))
            looked = release.ple.vocab.VocabParallelEmbedding.forward(emb, torch.from_numpy(ids))
            rows = emb.dequantize(looked, torch.bfloat16)
            got = rows.view(torch.int16).numpy().view(np.uint16).copy()
            got[torch.isnan(rows.float()).numpy()] = 0x7FC0  # a NaN's payload is not data
            want = ple_scenarios.vllm_rows(whole, scale, ids)
            _compare(f"{label} rows", torch.from_numpy(got), torch.from_numpy(want))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM's pinned PLE tables need CUDA (pin_memory)")
def test_ple_pinned_tables_hold_the_checkpoint(release, ple_dir):
    layer = PLE.layer_ids[0]
    module = ple_layer(release, ple_dir, layer, cpu_offload=True)
    emb = module.ngram_embedding
    assert type(emb).__name__ == "Qwen4ExpPLEPinnedHostEmbedding" and emb.weight.is_pinned()
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    harness.load_ple_checkpoint(module, checkpoint, layer)
    whole, _ = ple_scenarios.whole_table(checkpoint, PLE, layer)
    _compare(f"{release.version} PLE pinned weights", emb.weight.data[:whole.shape[0]], whole)


def test_ple_disk_offload_reads_the_checkpoints_rows_from_its_files(release, ple_dir):
    """0.34+: disk_offload allocates no table; vLLM's load keeps the split
    parts as views of the checkpoint file, binds them to it, and each
    step's rows are read from the file: the checkpoint's, byte for byte."""
    if release.version < "0.34.0":
        pytest.skip(f"vLLM {release.version} has no PLE disk_offload (new in 0.34.0)")
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    layer = PLE.layer_ids[0]
    module = ple_layer(release, ple_dir, layer, disk_offload=True)
    emb = module.ngram_embedding
    assert type(emb).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
    assert emb.weight.shape[0] == 0  # no rows held
    harness.load_ple_checkpoint(module, checkpoint, layer)
    emb.bind_file_shards()
    assert list(emb._fds) == [checkpoint]
    ids = torch.from_numpy(np.random.default_rng(layer).integers(0, PLE.rows(layer),
                                                                 (64, PLE.n_heads)))
    emb.copy_ids_to_host(ids)
    emb.stage_rows(ids.shape[0])
    whole, _ = ple_scenarios.whole_table(checkpoint, PLE, layer)
    _compare(f"{release.version} PLE disk_offload rows", emb.staged_rows(ids.shape[0]),
             whole[ids].flatten(-2))
