"""The vLLM plugin's Qwen4-Exp part against vLLM 0.31.0's own qwen4_exp code
(tests/support/vllm_harness.py loads it from the wheel under stubs): vLLM's
Qwen4ExpNGramEmbedding, built and loaded by vLLM's code with the plugin's
patch, holds its PLE table in ours, byte for byte what vLLM's own storage
holds after vLLM's loader; a table service's tables are attached and
only checked; what the plugin cannot serve is refused naming what to do."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from numa_engram.integrations.vllm.settings import PluginError  # noqa: E402
from numa_engram.model.ple import PLESpec  # noqa: E402

from .support import ple_scenarios  # noqa: E402
from .support import vllm_harness as harness  # noqa: E402
from .support.service import start_service  # noqa: E402
from .test_deployments import hosts as simulated_hosts  # noqa: E402, F401 (a fixture)

pytest.importorskip("safetensors", reason="safetensors is not installed")

SPEC = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
               ngram_vocab_size_base=3000, split_ngram_parts=7)


@pytest.fixture(scope="module")
def vllm():
    root, why = harness.wheel_sources()
    if root is None:
        pytest.skip(why)
    v = harness.ple_modules(root)
    from numa_engram.integrations.vllm import patch_ple

    patch_ple(v.common, v.ple)
    harness.State.tp = harness.Coordinator([0], None)  # one rank: ETP 1
    return v


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ple_scenarios.write_ple_model(tmp_path_factory.mktemp("qwen4") / "m", SPEC))


def checkpoint(model_dir):
    return os.path.join(model_dir, "model.safetensors")


def vllms_own(v, model_dir, layer):
    """vLLM's module on its own storage (cpu_offload=False), loaded by its loader."""
    harness.State.config = harness.config(model_dir, cpu_offload=False)
    module = harness.ple_layer(v.nv, SPEC.to_dict(), layer)
    assert type(module.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    harness.load_ple_checkpoint(module, checkpoint(model_dir), layer)
    return module


def ours(v, model_dir, layer, **config):
    harness.State.config = harness.config(model_dir, **config)
    module = harness.ple_layer(v.nv, SPEC.to_dict(), layer)
    assert type(module.ngram_embedding).__name__ == "Qwen4ExpPLEPinnedHostEmbedding"
    return module


def vllm_rows(v, emb, ids):
    """vLLM's own row path on ``emb``'s storage: VocabParallelEmbedding's
    forward (its method's F.embedding) then the method's dequantize."""
    looked = v.vocab.VocabParallelEmbedding.forward(emb, ids)
    return emb.dequantize(looked, torch.bfloat16)


def bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("page", ["4K", pytest.param("2M", marks=pytest.mark.serial)])
def test_vllms_pinned_embedding_holds_its_rows_in_our_table(vllm, model_dir, page, request):
    """The weight vLLM's module registers is our table's memory; vLLM's
    loader fills it; its bytes, scale and vLLM's own row path over it equal
    vLLM's own storage's; our lookup gives the same rows."""
    additional = {"page_size": page}
    if page == "2M":
        request.getfixturevalue("huge_pool")
    for layer in SPEC.layer_ids:
        theirs = vllms_own(vllm, model_dir, layer).ngram_embedding
        module = ours(vllm, model_dir, layer, additional=additional)
        emb = module.ngram_embedding
        table = emb._numa_ple.table
        assert emb.weight.data_ptr() == table.weights.ctypes.data and table.mode == "independent"
        assert table.backing.layout.page_size == (2 << 20 if page == "2M" else 4096)
        handed = harness.load_ple_checkpoint(module, checkpoint(model_dir), layer)
        assert handed == SPEC.split_ngram_parts + 1
        assert torch.equal(emb.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
        assert float(emb.weight_scale) == float(theirs.weight_scale) == table.scale
        ids = torch.from_numpy(np.random.default_rng(layer).integers(
            0, SPEC.rows(layer), (48, SPEC.n_heads)))
        got = vllm_rows(vllm, emb, ids)
        assert torch.equal(bits(got), bits(vllm_rows(vllm, theirs, ids)))
        mine = table.lookup(ids.numpy()).view(torch.int16).numpy().view(np.uint16)
        want = bits(got).numpy().view(np.uint16).copy()
        want[torch.isnan(got.float()).numpy()] = 0x7FC0
        assert np.array_equal(mine, want)
        table.close()


@pytest.fixture
def service(model_dir, tmp_path):
    held = start_service(model_dir, tmp_path / "engram.sock")
    yield held.socket_path
    held.stop()


def test_with_a_table_service_vllms_loader_only_checks_and_an_update_is_refused(
        vllm, model_dir, service):
    layer = SPEC.layer_ids[0]
    theirs = vllms_own(vllm, model_dir, layer).ngram_embedding
    for _restart in range(2):  # a restarted engine attaches again
        module = ours(vllm, model_dir, layer, additional={"service": service})
        emb = module.ngram_embedding
        table = emb._numa_ple.table
        assert table.mode == "service" and not table.weights.flags.writeable
        assert torch.equal(emb.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
        harness.load_ple_checkpoint(module, checkpoint(model_dir), layer)  # checked, not copied
        with pytest.raises(PluginError, match="a weight update would write into PLE layer"):
            harness.load_ple_checkpoint(module, checkpoint(model_dir), layer)
        table.close()
    module = ours(vllm, model_dir, layer, additional={"service": service})
    scale = module.ngram_embedding.weight_scale
    with pytest.raises(PluginError, match="weight_scale 2.0 is not the served table's"):
        scale.weight_loader(scale, torch.tensor(2.0))
    module.ngram_embedding._numa_ple.table.close()
    harness.State.config = harness.config(model_dir, additional={"service": service},
                                          load_format="dummy")
    with pytest.raises(PluginError, match="load_format=dummy writes every weight"):
        harness.ple_layer(vllm.nv, SPEC.to_dict(), layer)


def test_a_table_not_loaded_is_refused_at_vllms_end_of_load(vllm, model_dir):
    """vLLM's loader ends each PLE table's load with its quant method's
    process_weights_after_loading (every release's per-layer pass): a
    table of ours that no checkpoint part filled is a PluginError there."""
    layer = SPEC.layer_ids[0]
    module = ours(vllm, model_dir, layer)
    emb = module.ngram_embedding
    storage = emb._numa_ple
    with pytest.raises(PluginError, match=rf"PLE layer {layer} rows .*neither loaded by vLLM's "
                                          rf"loader \(0 of the {storage.parts_expected} "
                                          "checkpoint parts"):
        emb.quant_method.process_weights_after_loading(emb)
    harness.load_ple_checkpoint(module, checkpoint(model_dir), layer)
    emb.quant_method.process_weights_after_loading(emb)  # loaded: nothing to say
    storage.table.close()


def test_an_attached_ple_tables_report_gives_the_services_measured_pages_per_node(
        vllm, model_dir, service):
    layer = SPEC.layer_ids[0]
    module = ours(vllm, model_dir, layer, additional={"service": service})
    storage = module.ngram_embedding._numa_ple
    try:
        doc = storage.report()
        regions = storage.table.backing.layout.regions
        assert doc["source"] == "attached" and doc["pages_per_node"] is not None, doc
        assert sum(doc["pages_per_node"].values()) == sum(-(-r.length // 4096)
                                                          for r in regions), doc
    finally:
        storage.table.close()


@pytest.mark.slow
def test_vllms_loader_writing_into_an_attached_ple_table_is_a_plugin_error_not_a_crash(
        model_dir, service):
    """Another part than the service's, handed by vLLM's loader to a table
    attached read-only, is refused before any write, in a process of its
    own (a SIGSEGV would fail the test, not end the run)."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import write_into_attached_ple

    [r] = run_world(1, write_into_attached_ple, timeout_s=300, model_dir=model_dir,
                    spec=SPEC.to_dict(), service=service)
    assert r["ok"], r.get("traceback", r)
    assert r["mode"] == "service" and r["read_only"] and r["unchanged"], r
    [said] = r["said"]
    assert said is not None and \
        f"would write other rows into PLE layer {SPEC.layer_ids[0]}'s table" in said, r


@pytest.mark.parametrize("change, match", [
    ({"use_thp": True}, "use_thp=True"),
    ({"additional": {"page_size": "3M"}}, "numa_engram.page_size is '3M'"),
])
def test_configurations_the_plugin_cannot_serve_are_refused(vllm, model_dir, change, match):
    harness.State.config = harness.config(model_dir, **change)
    with pytest.raises(PluginError, match=match):
        harness.ple_layer(vllm.nv, SPEC.to_dict(), SPEC.layer_ids[0])


def test_another_model_directory_or_rocm_is_refused_naming_it(vllm, model_dir, tmp_path,
                                                              monkeypatch):
    from numa_engram.integrations.vllm import layers

    other = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                    ngram_vocab_size_base=2000, split_ngram_parts=7)
    other_dir = str(ple_scenarios.write_ple_model(tmp_path / "other", other))
    harness.State.config = harness.config(other_dir)
    with pytest.raises(PluginError, match="disagree with the layout vLLM built"):
        harness.ple_layer(vllm.nv, SPEC.to_dict(), SPEC.layer_ids[0])
    harness.State.config = harness.config(model_dir)
    with pytest.raises(PluginError, match="layer 3 .*ple_layer_ids are \\[2, 5\\]"):
        doc = dict(SPEC.to_dict(), layer_ids=[2, 3, 5])
        harness.ple_layer(vllm.nv, doc, 3)
    monkeypatch.setattr(layers, "_is_rocm", lambda: True)
    with pytest.raises(PluginError, match="on ROCm unset VLLM_PLUGINS=numa_engram"):
        harness.ple_layer(vllm.nv, SPEC.to_dict(), SPEC.layer_ids[0])


def test_another_version_or_source_is_named_with_what_to_install(vllm, monkeypatch):
    import sys
    import types

    from numa_engram.integrations.vllm.manifest import PLE_COMMON, PLE_HELPERS, module_problem

    assert module_problem(vllm.common, PLE_COMMON) is None
    assert module_problem(vllm.ple, PLE_HELPERS) is None
    fake = types.ModuleType("fake")
    assert "qwen4_exp/common/ple.py lacks PLEVocabParallelEmbedding" in \
        module_problem(fake, PLE_HELPERS)
    fake.__dict__.update(vars(vllm.ple))
    fake.__file__ = __file__  # another file under the same name
    assert "qwen4_exp/common/ple.py (" + __file__ + ") is not the file" in \
        module_problem(fake, PLE_HELPERS)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.30.0")
    assert "vLLM 0.30.0 is not a release" in module_problem(vllm.common, PLE_COMMON)


@pytest.mark.multiproc
def test_tp2_dp2_dp_shared_one_copy_per_tp_shard_holds_vllms_bytes(vllm, model_dir):
    """Four real ranks as vLLM's TP 2 x DP 2 with dp_shared: the DP replicas
    of a TP rank share one table per layer (PSS summed over them is one
    copy), vLLM's loader writes it once, its bytes equal vLLM's own storage
    and the TP pair's all-reduced rows equal the whole table's."""
    from .support.dist_harness import run_world

    results = run_world(4, ple_scenarios.vllm_plugin_dp_shared, timeout_s=300,
                        model_dir=model_dir, root=str(harness.cache_dir()),
                        spec=SPEC.to_dict(), additional={})
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [] and set(r["modes"]) == {"dp_shared"}, r
        assert all(r["leaders"]) == (r["rank"] < 2) and any(r["leaders"]) == (r["rank"] < 2)
    for tp_rank in (0, 1):
        members = [results[tp_rank], results[2 + tp_rank]]
        assert members[0]["rows"] == members[1]["rows"] == [
            list(SPEC.shard_rows(layer, tp_rank, 2)) for layer in SPEC.layer_ids]
        pss, one = sum(m["pss"] for m in members), members[0]["table_bytes"]
        assert abs(pss - one) <= 0.05 * one, (tp_rank, pss, one)


REGISTER = r"""
import sys
from pathlib import Path
repo, tree = sys.argv[1], Path(sys.argv[2])
sys.path.insert(0, repo)
from tests.support import vllm_harness as harness
harness.ple_stubs(Path(sys.argv[3]))
sys.modules["vllm"].__path__ = [str(tree / "vllm")]
sys.modules["vllm.models"].__path__ = [str(tree / "vllm" / "models")]
from numa_engram.integrations.vllm import register
register()
register()  # idempotent
import vllm.models.qwen4_exp.common.ngram_embedding as common
from numa_engram.integrations.vllm.patches import FIRED
pinned = common.Qwen4ExpPLEPinnedHostEmbedding
assert common._numa_engram_ple_patched
assert pinned.allocate_embedding_weight.__module__.startswith("numa_engram")
assert FIRED[common.__name__] is None, FIRED
print("patched")
"""


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_register_patches_the_qwen4_exp_module_as_vllm_imports_it(vllm, tmp_path):
    """The entry point's path: register() in a fresh interpreter, then vLLM's
    qwen4_exp package imported from a tree laid out as vLLM's wheel lays it
    out: the module is patched as it is imported, and it is the checked file."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tree = tmp_path / "tree"
    package = tree / "vllm" / "models" / "qwen4_exp"
    (package / "common").mkdir(parents=True)
    for name in ("ple.py", "ngram_embedding.py"):
        shutil.copy(harness.cache_dir() / "vllm/models/qwen4_exp/common" / name,
                    package / "common" / name)
    for init in (package / "__init__.py", package / "common" / "__init__.py"):
        init.write_text("")
    repo = str(Path(__file__).resolve().parent.parent)
    run = subprocess.run([sys.executable, "-c", REGISTER, repo, str(tree),
                          str(harness.cache_dir())], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "patched", run.stderr[-3000:]


def vllms_qwen4_config(root, monkeypatch):
    """vLLM's Qwen4ExpConfig from the wheel's qwen4_exp/config.py, over
    stand-ins for the transformers bases it extends (not installed here):
    a base that keeps every keyword as an attribute, as PreTrainedConfig
    does with the ones it does not know."""
    import importlib.util
    import sys
    import types

    class PreTrainedConfig:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class Qwen3NextConfig(PreTrainedConfig):
        def __init__(self, hidden_size=160, num_hidden_layers=6, layer_types=None, **kwargs):
            super().__init__(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                             layer_types=layer_types, rope_parameters=None, head_dim=16,
                             partial_rotary_factor=1.0, **kwargs)

    stubs = {"transformers": dict(PreTrainedConfig=PreTrainedConfig),
             "transformers.models.qwen3_vl.configuration_qwen3_vl": dict(
                 Qwen3VLVisionConfig=type("Qwen3VLVisionConfig", (PreTrainedConfig,), {})),
             "vllm.transformers_utils.configs.qwen3_next": dict(Qwen3NextConfig=Qwen3NextConfig)}
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location(
        "vllm_qwen4_exp_config", root / "vllm/models/qwen4_exp/config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Qwen4ExpConfig


def test_split_ngram_parts_is_read_where_vllms_config_class_reads_it(vllm, monkeypatch):
    """Qwen4ExpConfig drops a top-level split_ngram_parts beside a
    text_config; vLLM's PLE module reads the text config's (512 when it has
    none): PLESpec.from_config gives vLLM's value in each layout."""
    config_class = vllms_qwen4_config(harness.cache_dir(), monkeypatch)
    text = {"ple_layer_ids": [2, 5], "ple_embed_dim": 160, "vocab_size": 5000,
            "eos_token_id": 7, "ngram_vocab_size_base": 3000, "hidden_size": 160,
            "num_hidden_layers": 6}
    docs = [{"text_config": text, "split_ngram_parts": 7},
            {"text_config": {**text, "split_ngram_parts": 64}, "split_ngram_parts": 7},
            {"text_config": {**text, "split_ngram_parts": 64}},
            {**text, "split_ngram_parts": 9}]
    got = []
    for doc in docs:
        theirs = int(getattr(config_class(**doc).text_config, "split_ngram_parts", 512))
        assert PLESpec.from_config(doc).split_ngram_parts == theirs, doc
        got.append(theirs)
    assert got == [512, 64, 64, 9]


@pytest.mark.multiproc
def test_dp_replicas_on_two_hosts_fall_back_to_private_tables_saying_so(vllm, model_dir,
                                                                       request):
    """Issue 49.9: TP 2 x DP 2 with dp_shared asked, each DP replica on its
    own host (its own /dev/shm): the plugin asks where the peers are, finds
    no peer that can map this rank's copy, and makes a private table with
    the line the Engram part logs (a StorageError "the sharing group has
    one member" before); bytes and rows still vLLM's."""
    from .support.dist_harness import run_world
    from .test_deployments import _on

    simulated = request.getfixturevalue("simulated_hosts")  # (skips where it cannot be had)
    results = run_world(4, ple_scenarios.vllm_plugin_dp_shared, timeout_s=300,
                        hosts=_on(simulated, "AABB"), model_dir=model_dir,
                        root=str(harness.cache_dir()), spec=SPEC.to_dict(), additional={})
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [] and set(r["modes"]) == {"independent"}, r
        assert any("the DP peers cannot share one copy (no DP peer of this rank can map its "
                   "copy" in line and "one table per rank" in line for line in r["logs"]), \
            r["logs"]


@pytest.mark.multiproc
@pytest.mark.parametrize("nodes", [[0, 1], [0, 0]], ids=["one-per-socket", "both-on-node-0"])
def test_copies_socket_with_one_replica_per_socket_makes_private_ple_tables_saying_so(
        vllm, model_dir, nodes):
    """Issue 49.9: DP 2 (TP 1) with dp_shared asked and "copies": "socket",
    rank 0's GPU on node 0 and rank 1's on node 1: each rank makes a
    private PLE table with the plugin's fall back line (a StorageError "the
    sharing group has one member" before), filled by vLLM's loader, its
    bytes vLLM's own storage's and its rows the checkpoint's.  Both GPUs on
    node 0: one shared copy, no such line.  The GPUs' nodes are a fake
    (tests/support/vllm_scenarios.on_gpu_nodes: host.topology.gpu_node as
    sharing_groups looks it up, in the spawned ranks only): this machine
    has no GPU."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import check_copies_socket, on_gpu_nodes

    results = run_world(2, on_gpu_nodes, timeout_s=300, nodes=nodes,
                        then=ple_scenarios.vllm_plugin_dp_shared, tp=1, model_dir=model_dir,
                        root=str(harness.cache_dir()), spec=SPEC.to_dict(),
                        additional={"copies": "socket"})
    for r in results:
        check_copies_socket(r, SPEC, nodes)
        assert r["rows"] == [list(SPEC.shard_rows(layer, 0, 1)) for layer in SPEC.layer_ids]
