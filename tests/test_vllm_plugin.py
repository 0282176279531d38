"""The vLLM plugin against vLLM 0.31.0's own Engram code (tests/support/vllm_harness.py
loads it from the wheel under stubs; its lookup kernel runs under Triton's
interpreter): vLLM's embedding over our tables returns the rows vLLM's own
storage returns, loaded by vLLM's own weight loader from the same synthetic
V4.1 checkpoint, and the rows of our lookup(id_format="global").

Run alone: ``.venv/bin/python -m pytest tests/test_vllm_plugin.py``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402

from numa_engram import EngramSpec, write_synthetic_model  # noqa: E402
from numa_engram.integrations.vllm.patch_vl_model import patch as patch_vl  # noqa: E402
from numa_engram.integrations.vllm.settings import PluginError, PluginSettings  # noqa: E402

from .support import vllm_harness as harness  # noqa: E402
from .support.service import start_service  # noqa: E402
from .support.vllm_scenarios import global_ids, load_through_mapper, vl_module  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'numa_engram[test]')")
pytest.importorskip("safetensors", reason="safetensors is not installed")

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)


@pytest.fixture(scope="module")
def vllm():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 in this process: vLLM's kernel needs the "
                    "interpreter on CPU tensors")
    root, why = harness.wheel_sources()
    if root is None:
        pytest.skip(why)
    nv, common = harness.vllm_modules(root)
    from numa_engram.integrations.vllm import patch

    patch(nv, common)
    return nv, common


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("v41"), SPEC))


def _vllms_own(nv, common, layout, index, model_dir, layer):
    """vLLM's embedding on its own storage (torch tensors), loaded by its loader."""
    emb = nv.ParallelEngramEmbedding(layout.num_embeddings[index], layout.head_dim, tuple(
        s for order in layout.primes[index] for s in order), cpu_offload=False)
    harness.load_checkpoint(emb, model_dir, layer)
    return emb


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("page", ["4K", pytest.param("2M", marks=pytest.mark.serial)])
def test_vllms_kernel_over_a_private_table_gives_vllms_own_rows(vllm, model_dir, page,
                                                                request):
    nv, common = vllm
    if page == "2M":
        request.getfixturevalue("huge_pool")  # reserved here, or a skip saying why not
    harness.State.config = harness.config(model_dir, additional={"page_size": page})
    layout = harness.layout_of(common, model_dir)
    for index, layer in enumerate(layout.layer_ids):
        ours = nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
        assert type(ours).__name__ == "NumaEngramEmbedding"
        table = ours.numa_table
        assert ours.weight.dtype == torch.float8_e4m3fn and ours.weight.is_contiguous()
        assert ours.weight.data_ptr() == table.weights.ctypes.data
        assert ours.weight_scale_inv.dtype == torch.uint8
        assert table._backing.layout.page_size == (2 << 20 if page == "2M" else 4096)
        assert harness.load_checkpoint(ours, model_dir, layer) == 2
        theirs = _vllms_own(nv, common, layout, index, model_dir, layer)
        ids = global_ids(SPEC, layer, 96, seed=layer)
        got, want = ours(ids), theirs(ids)
        assert got.shape == (96, SPEC.n_hash_cols, SPEC.head_dim)
        assert torch.equal(_bits(got), _bits(want))
        assert torch.equal(_bits(got), _bits(table.lookup(ids.numpy(), id_format="global")))
        table.close()


def test_settings_are_checked_naming_the_key_and_what_it_accepts():
    cases = [({"page_size": "3M"}, "page_size is '3M'; accepted: 4K, 2M, 1G"),
             ({"placement": "sideways"}, "placement is 'sideways'; accepted: gpu-local"),
             ({"load_threads": 0}, "load_threads is 0; accepted: an integer"),
             ({"metrics_port": "x"}, "metrics_port is 'x'"),
             ({"pages": "2M"}, r"unknown key\(s\) \['pages'\]"),
             ({"service": ""}, "service is ''; accepted: a table service's socket path"),
             ({"service_uids": [-1]}, "service_uids must be a list of uids"),
             ({"copies": "rack"}, "copies is 'rack'; accepted: node, socket"),
             ({"directory": ["/dev/shm"]}, r"directory is \['/dev/shm'\]; accepted: one "),
             ({"directory": {"a": 1}}, r"directory is \{'a': 1\}; accepted: one ")]
    for doc, text in cases:
        with pytest.raises(PluginError, match=text):
            PluginSettings.of({"numa_engram": doc})
    # each worker serves metrics_port + its rank: all of them must be ports
    top = PluginSettings.of({"numa_engram": {"metrics_port": 65535}})
    top.check_metrics_port(1)
    with pytest.raises(PluginError, match="metrics_port is 65535; the 2 workers serve "
                                          r"metrics_port \+ their rank, up to 65536"):
        top.check_metrics_port(2)
    assert PluginSettings.of({"numa_engram": {"page_size": "2M", "placement": "node:1"}}) \
        .page_size == "2M"
    assert PluginSettings.of(None) == PluginSettings()


@pytest.mark.parametrize("change, text", [
    (dict(use_thp=True), "use_thp=True"),
    (dict(additional={"page_size": "9K"}), "page_size is '9K'"),
])
def test_configurations_the_plugin_cannot_serve_are_refused_at_construction(
        vllm, model_dir, change, text):
    nv, common = vllm
    harness.State.config = harness.config(model_dir, **change)
    layout = harness.layout_of(common, model_dir)
    with pytest.raises(PluginError, match=text):
        nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)


def test_rocm_is_refused_and_replaced_storage_is_an_error(vllm, model_dir, monkeypatch):
    import sys

    nv, common = vllm
    layout = harness.layout_of(common, model_dir)
    harness.State.config = harness.config(model_dir)
    monkeypatch.setattr(sys.modules["vllm.platforms"].current_platform, "is_rocm", lambda: True)
    with pytest.raises(PluginError, match="on ROCm unset VLLM_PLUGINS=numa_engram"):
        nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
    monkeypatch.undo()
    ours = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
    try:
        harness.load_checkpoint(ours, model_dir, layout.layer_ids[0])
        other = torch.empty_like(ours.weight)
        with pytest.raises(RuntimeError, match="storage was replaced"):
            ours._shared_memory.get_views(other, ours.weight_scale_inv)
        views = ours._storage()
        assert views is ours._storage()  # cached
    finally:
        ours.numa_table.close()


def test_another_version_or_source_is_named_with_what_to_install(vllm, monkeypatch):
    import sys

    from numa_engram.integrations.vllm.manifest import ENGRAM_COMMON, module_problem

    nv, common = vllm
    assert module_problem(nv, "engram") is None
    assert module_problem(common, ENGRAM_COMMON) is None
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.30.9")
    assert "vLLM 0.30.9 is not a release the numa_engram plugin supports" in \
        module_problem(nv, "engram")
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.31.0")
    fake = type(nv)("fake")
    fake.__file__ = __file__  # another file under the same name
    fake.__dict__.update(vars(nv))
    fake.__file__ = __file__
    assert "models/deepseek_v41/nvidia/engram.py (" + __file__ + ") is not the file" in \
        module_problem(fake, "engram")


@pytest.mark.multiproc
@pytest.mark.parametrize("page", ["4K", pytest.param("2M", marks=pytest.mark.serial)])
def test_tp2_dp2_dp_shared_tables_give_vllms_rows_with_one_copy(vllm, model_dir, page,
                                                                request):
    """Four real ranks (gloo, 127.0.0.1) as vLLM's TP 2 x DP 2: the EDP
    peers of a TP rank share one table (PSS summed over the replicas is
    1.00 copies), vLLM's loader writes it once, and vLLM's forward with its
    TP all-gather returns the whole table's rows for each replica's ids."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import serve

    additional = {}
    if page == "2M":  # a hugetlbfs mount every replica maps the copy from
        additional = {"page_size": "2M", "directory": request.getfixturevalue("huge_pool").mount}
    results = run_world(4, serve, timeout_s=300, model_dir=model_dir, mode="dp_shared",
                        root=str(harness.cache_dir()), spec=SPEC.to_dict(),
                        additional=additional)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["shareable"] is True and r["mismatches"] == [], r
        assert set(r["modes"]) == {"dp_shared"}
        # the deployment log's figure: the group's PSS summed, as copies
        assert all(c is None if page == "2M" else abs(c - 1.0) < 0.02
                   for c in r["reported_copies"]), r["reported_copies"]
        assert all(r["leaders"]) == (r["rank"] < 2) and any(r["leaders"]) == (r["rank"] < 2)
    one_copy = sum(r["table_bytes"] for r in results if r["rank"] < 2)  # each TP shard once
    if page == "2M":  # hugetlb pages are in no PSS: the pool gave exactly one copy
        assert {r["huge_pages_taken"] for r in results} == {one_copy // (2 << 20)}, results
    else:
        copies = sum(r["pss"] for r in results) / one_copy
        assert abs(copies - 1.0) < 0.02, copies


# ------------------------------------------------- the table service --

@pytest.fixture
def service(model_dir, tmp_path):
    held = start_service(model_dir, tmp_path / "engram.sock")
    yield held.socket_path
    held.stop()


def test_with_a_table_service_each_layer_attaches_and_vllms_loader_copies_nothing(
        vllm, model_dir, service):
    from numa_engram.integrations.vllm import placement

    nv, common = vllm
    layout = harness.layout_of(common, model_dir)
    for restart in range(2):  # a restarted engine attaches again
        harness.State.config = harness.config(model_dir, additional={"service": service})
        for index, layer in enumerate(layout.layer_ids):
            ours = nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
            table = ours.numa_table
            assert table.mode == "service"
            assert layer in placement.engine(harness.State.config).attached
            before = bytes(table.weights[:4].tobytes())
            harness.load_checkpoint(ours, model_dir, layer)  # (the mapper drops these)
            assert table.weights[:4].tobytes() == before  # checked, not copied
            with pytest.raises(PluginError, match="a weight update would write"):
                harness.load_checkpoint(ours, model_dir, layer)  # e.g. an RL weight sync
            theirs = _vllms_own(nv, common, layout, index, model_dir, layer)
            ids = global_ids(SPEC, layer, 16, seed=restart * 10 + layer)
            assert torch.equal(_bits(ours(ids)), _bits(theirs(ids)))
            table.close()
    harness.State.config = harness.config(model_dir, additional={"service": service},
                                          load_format="dummy")
    with pytest.raises(PluginError, match="load_format=dummy writes every weight"):
        nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)


def test_a_hub_id_without_tokenizer_builds_and_attaches_from_vllms_config(
        vllm, model_dir, service, tmp_path):
    """vLLM was given a hub id (no local directory) and ``--tokenizer``
    elsewhere: the plugin takes the layout from vLLM's hf_config alone,
    builds tables vLLM's loader fills, and attaches the table service's
    (started on the full directory, with its tokenizer): one fingerprint."""
    import shutil

    from numa_engram.runtime.modeldir import ModelDirectory

    nv, common = vllm
    bare = tmp_path / "bare"  # config.json and checkpoint, no tokenizer.json
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert not list(bare.glob("tokenizer*"))
    layout = harness.layout_of(common, model_dir)
    served = ModelDirectory.open(model_dir).spec
    for additional, mode in (({}, "independent"), ({"service": service}, "service")):
        harness.State.config = harness.config(str(bare), model="deepseek-ai/not-downloaded",
                                              additional=additional)
        for index, layer in enumerate(layout.layer_ids):
            ours = nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
            table = ours.numa_table
            assert table.mode == mode and table.spec.fingerprint == served.fingerprint
            harness.load_checkpoint(ours, str(bare), layer)
            theirs = _vllms_own(nv, common, layout, index, model_dir, layer)
            ids = global_ids(SPEC, layer, 16, seed=layer)
            assert torch.equal(_bits(ours(ids)), _bits(theirs(ids)))
            table.close()


@pytest.mark.slow
def test_vllms_loader_writing_into_an_attached_table_is_a_plugin_error_not_a_crash(
        vllm, model_dir, service):
    """An attached table is the service's read-only mapping: a tensor vLLM's
    loader hands that is not the service's rows (a weight update, another
    checkpoint) is refused before any write, in a process of its own (a
    SIGSEGV would fail the test, not end the run)."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import write_into_attached

    [r] = run_world(1, write_into_attached, timeout_s=300, model_dir=model_dir,
                    root=str(harness.cache_dir()), service=service)
    assert r["ok"], r.get("traceback", r)
    assert r["mode"] == "service" and r["read_only"] and r["unchanged"], r
    for said in r["said"]:
        assert said is not None and "would write other rows into Engram layer 1's table, " \
            "attached read-only from the table service" in said, r


def test_an_attached_tables_report_line_gives_its_measured_pages_per_node(
        vllm, model_dir, service, caplog):
    """A table from the service has no placement plan here: its line in
    vLLM's log measures where its pages are (move_pages over the mapping),
    every page of the file on some node, not "pages per node None"."""
    import ast
    import logging
    import re

    nv, common = vllm
    layout = harness.layout_of(common, model_dir)
    harness.State.config = harness.config(model_dir, additional={"service": service})
    with caplog.at_level(logging.INFO, logger="vllm"):
        ours = nv.Engram._create_embedding(harness.thin_engram(nv, 0), layout, 0)
    table = ours.numa_table
    try:
        [line] = [r.getMessage() for r in caplog.records
                  if r.name.startswith("vllm.numa_engram") and "Engram layer" in r.getMessage()]
        found = re.search(r"source attached, 4K pages, \d+ bytes, pages per node (\{[^}]*\})",
                          line)
        assert found, line
        assert "copies by PSS not measured (attached" in line, line  # not "0.0 copies"
        per_node = ast.literal_eval(found.group(1))
        regions = table._backing.layout.regions
        assert sum(per_node.values()) == sum(-(-r.length // 4096) for r in regions), line
    finally:
        table.close()


class StandInVLModel(torch.nn.Module):
    """Stands in for vLLM's ``DeepseekV41ForCausalLM`` (vl_model.py; not
    buildable without a GPU): its ``load_weights`` hands every Engram tensor
    through the VL weights mapper to its parameter's weight_loader, as
    vLLM's does (load_through_mapper), for the layers in ``weights``."""

    def __init__(self, vl, embs, model_dir):
        super().__init__()
        self.vl, self.model_dir = vl, model_dir
        self.embs = torch.nn.ModuleDict({str(layer): emb for layer, emb in embs.items()})

    def load_weights(self, weights):
        return load_through_mapper(self.vl, weights, self.model_dir)


def test_a_table_neither_loaded_nor_attached_is_refused_at_the_end_of_vllms_load(
        vllm, model_dir):
    """The VL model's load_weights is vLLM's end of the load in every
    release (0.31-0.34: every checkpoint tensor goes through it): a table
    the loader never filled is a PluginError there, naming the layer, not
    zeros at the first forward."""
    import ast

    from numa_engram.integrations.vllm import patch_vl_model

    source = (harness.cache_dir() / "vllm/models/deepseek_v41/nvidia/vl_model.py").read_text()
    classes = {node.name: {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
               for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    assert "load_weights" in classes["DeepseekV41ForCausalLM"]
    nv, common = vllm
    layout = harness.layout_of(common, model_dir)
    harness.State.config = harness.config(model_dir)
    embs = {layer: nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
            for index, layer in enumerate(layout.layer_ids)}
    vl = vl_module(harness.cache_dir())
    vl.DeepseekV41ForCausalLM = StandInVLModel
    patch_vl_model.patch(vl)
    first, last = layout.layer_ids[0], layout.layer_ids[-1]
    model = StandInVLModel(vl, embs, model_dir)
    with pytest.raises(PluginError, match=rf"Engram layer {last}: its table was neither loaded "
                                          r"by vLLM's loader \(0 of its 2 tensors\)"):
        model.load_weights({first: embs[first]})
    assert model.load_weights({last: embs[last]}) == 2  # every table loaded: no error
    for emb in embs.values():
        emb.numa_table.close()


V41_NAMES = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn",
             "layers.0.attn.wq_a.weight", "layers.1.engram.embed.weight",
             "layers.1.engram.embed.scale", "layers.1.engram.wkv.weight",
             "layers.1.engram.q_weight", "layers.1.engram.k_weight",
             "layers.14.engram.embed.weight", "layers.14.engram.embed.scale",
             "layers.14.ffn.experts.3.w1.weight", "mtp.0.embed.weight"]


def test_the_weights_mapper_drops_exactly_the_tables_its_engine_attached(vllm):
    """Per engine and per layer: the mapper made while an engine is
    constructed drops the Engram tensors of the layers that engine
    attached, and of no other layer or engine."""
    from numa_engram.integrations.vllm import placement

    vl = vl_module(harness.cache_dir())
    original = vl._make_deepseek_v4_vl_weights_mapper
    patch_vl(vl)
    weights = [(name, None) for name in V41_NAMES]
    unpatched = dict(original("fp4", "scale").apply(weights))
    attached_engine, other_engine = harness.config("m"), harness.config("m")
    placement.engine(attached_engine).attached.add(14)
    harness.State.config = other_engine
    assert dict(vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale").apply(weights)) == \
        unpatched
    harness.State.config = attached_engine
    mapped = dict(vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale").apply(weights))
    dropped = {n for n in V41_NAMES if n.startswith("layers.14.engram.embed.")}
    assert len(dropped) == 2
    assert mapped == {k: v for k, v in unpatched.items()
                      if k not in {original("fp4", "scale").map_name(n) for n in dropped}}
    assert any("layers.1.engram.embed" in k for k in mapped)  # layer 1 was not attached
    assert any("engram.wkv" in k for k in mapped)  # the layer's other weights stay


def test_metrics_port_serves_this_workers_tables(vllm, model_dir):
    import socket
    import urllib.request

    from numa_engram.integrations.vllm import layers

    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nv, common = vllm
    harness.State.config = harness.config(model_dir, additional={"metrics_port": port})
    layout = harness.layout_of(common, model_dir)
    ours = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) \
            .read().decode()
        assert "numa_engram_table_bytes" in text and 'rank="0"' in text
    finally:
        ours.numa_table.close()
        for server in layers._METRICS:
            server.shutdown()
        layers._METRICS.clear()
        layers.TABLES.clear()


@pytest.mark.multiproc
def test_tp2_dp2_dp_sharded_slices_are_numbered_tp_major_as_vllm_numbers_them(
        vllm, model_dir):
    """vLLM's embedding_across_dp branch: each rank holds its TP-major head
    slice (TP rank x EDP size + EDP rank of 4) in a private table; vLLM's
    hash gather, row exchange and TP all-gather complete every head."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import serve

    results = run_world(4, serve, timeout_s=300, model_dir=model_dir, mode="dp_sharded",
                        root=str(harness.cache_dir()), spec=SPEC.to_dict())
    part = -(-SPEC.n_hash_cols // 4)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [] and set(r["modes"]) == {"independent"}, r
        slot = r["tp_rank"] * 2 + r["rank"] // 2  # vLLM's engram_head_shard_rank
        assert all(h == [slot * part, min((slot + 1) * part, SPEC.n_hash_cols)]
                   for h in r["heads"]), r["heads"]


def test_sharing_groups_take_a_coordinators_cpu_group_and_never_an_nccl_default(
        monkeypatch):
    """vLLM's world group is NCCL: sharing_groups never falls back to the
    default group there (it says what to pass), and runs a GroupCoordinator
    over its cpu_group (the TP 2 x DP 2 test forms groups through one)."""
    import torch.distributed as dist

    from numa_engram.errors import TopologyError
    from numa_engram.groups.group import _cpu_group_of

    coordinator = harness.SimpleNamespace(rank_in_group=0, world_size=1, cpu_group="gloo-pg")
    assert _cpu_group_of(coordinator) == "gloo-pg"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(TopologyError, match="default process group is NCCL.*world_group="):
        _cpu_group_of(None)


def test_the_package_declares_the_vllm_entry_point():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    doc = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert doc["project"]["entry-points"]["vllm.general_plugins"] == {
        "numa_engram": "numa_engram.integrations.vllm:register"}


@pytest.mark.multiproc
def test_one_member_failing_fails_every_member_of_its_group_naming_it(vllm, model_dir):
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import one_member_fails

    results = run_world(4, one_member_fails, timeout_s=300, model_dir=model_dir,
                        root=str(harness.cache_dir()))
    by_rank = {r["rank"]: r for r in results}
    assert all(r["ok"] for r in results), results
    assert by_rank[0]["raised"] is None and by_rank[2]["raised"] is None  # the other group
    # TP rank 1's group: both members fail alike, naming rank 3 and what it asked
    assert by_rank[1]["raised"] == by_rank[3]["raised"]
    assert "page_size: rank 1 '4K', rank 3 '2M'" in by_rank[3]["raised"]


# ------------------------------------- per engine, per layer, never zeros --

def _engine(nv, common, model_dir, **config):
    """One engine's Engram layers built through the plugin (a fresh config:
    a new engine, as a restart or an RL loop builds one)."""
    harness.State.config = harness.config(model_dir, **config)
    layout = harness.layout_of(common, model_dir)
    return {layer: nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
            for index, layer in enumerate(layout.layer_ids)}


def _rows_are_vllms(nv, common, model_dir, embs):
    layout = harness.layout_of(common, model_dir)
    for index, (layer, emb) in enumerate(embs.items()):
        theirs = _vllms_own(nv, common, layout, index, model_dir, layer)
        ids = global_ids(SPEC, layer, 48, seed=layer)
        assert torch.equal(_bits(emb(ids)), _bits(theirs(ids))), layer


def test_an_engine_built_after_an_attached_one_loads_its_own_tables(vllm, model_dir, service):
    """Issue 49.1: an engine whose tables came from the service, then a
    second engine in the same process building its own: the second's
    mapper drops nothing, its loader fills every table, its rows are
    vLLM's (a process-wide "attached" flag dropped them: zero rows)."""
    nv, common = vllm
    vl = vl_module(harness.cache_dir())
    patch_vl(vl)
    attached = _engine(nv, common, model_dir, additional={"service": service})
    assert {e.numa_table.mode for e in attached.values()} == {"service"}
    assert load_through_mapper(vl, attached, model_dir) == 0
    built = _engine(nv, common, model_dir)
    assert {e.numa_table.mode for e in built.values()} == {"independent"}
    assert load_through_mapper(vl, built, model_dir) == 2 * len(built)
    _rows_are_vllms(nv, common, model_dir, built)
    _rows_are_vllms(nv, common, model_dir, attached)
    for emb in [*attached.values(), *built.values()]:
        emb.numa_table.close()


def test_a_service_appearing_between_two_layers_changes_nothing_in_that_engine(
        vllm, model_dir, tmp_path, monkeypatch):
    """Issue 49.1: "service": "auto", the service starts after the first
    layer is built: the engine's decision holds for all its layers (built
    here), the mapper drops nothing and every row is vLLM's; the next
    engine attaches."""
    nv, common = vllm
    vl = vl_module(harness.cache_dir())
    patch_vl(vl)
    sock = tmp_path / "auto.sock"
    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", str(sock))
    harness.State.config = harness.config(model_dir, additional={"service": "auto"})
    layout = harness.layout_of(common, model_dir)
    embs = {layout.layer_ids[0]: nv.Engram._create_embedding(harness.thin_engram(nv, 0),
                                                             layout, 0)}
    held = start_service(model_dir, sock)
    try:
        embs[layout.layer_ids[1]] = nv.Engram._create_embedding(harness.thin_engram(nv, 1),
                                                                layout, 1)
        assert {e.numa_table.mode for e in embs.values()} == {"independent"}
        assert load_through_mapper(vl, embs, model_dir) == 2 * len(embs)
        _rows_are_vllms(nv, common, model_dir, embs)
        later = _engine(nv, common, model_dir, additional={"service": "auto"})
        assert {e.numa_table.mode for e in later.values()} == {"service"}
        for emb in [*embs.values(), *later.values()]:
            emb.numa_table.close()
    finally:
        held.stop()


def test_a_table_neither_loaded_nor_attached_is_an_error_naming_its_layer(vllm, model_dir):
    """Issue 49.1: a table vLLM's loader never filled (its tensors skipped
    or absent) is a PluginError naming the layer at the first forward,
    before any row is read, never zero rows."""
    nv, common = vllm
    embs = _engine(nv, common, model_dir)
    layer = next(iter(embs))
    try:
        with pytest.raises(PluginError, match=f"Engram layer {layer}: its table was neither "
                                              "loaded"):
            embs[layer](global_ids(SPEC, layer, 8, seed=1))
        harness.load_checkpoint(embs[layer], model_dir, layer)
        _rows_are_vllms(nv, common, model_dir, {layer: embs[layer]})
    finally:
        for emb in embs.values():
            emb.numa_table.close()


def test_auto_with_a_dead_service_builds_the_tables_and_says_so(vllm, model_dir, tmp_path,
                                                              monkeypatch, caplog):
    """Issue 49.7: "auto" where the socket file is there but nobody listens
    (a stopped service's): the tables are built, with a log line, not a
    StorageError."""
    import logging
    import socket

    nv, common = vllm
    sock = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(sock))  # bound, never listening, then closed: the file stays
    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", str(sock))
    with caplog.at_level(logging.WARNING, logger="vllm.numa_engram"):
        embs = _engine(nv, common, model_dir, additional={"service": "auto"})
    try:
        assert {e.numa_table.mode for e in embs.values()} == {"independent"}
        assert f"nobody listens at {sock}" in caplog.text
    finally:
        for emb in embs.values():
            emb.numa_table.close()


def test_a_patched_file_lacking_a_symbol_is_a_plugin_error_naming_it(vllm, model_dir,
                                                                     monkeypatch, caplog):
    """Issue 49.11: the import hook on a vLLM whose Engram module lacks
    what the patch replaces: no AttributeError inside vLLM's import, a
    WARNING naming the file and the symbols, and at the model's
    construction (the VL model's weights mapper) a PluginError saying so
    and what to install."""
    import logging
    import sys
    import types

    from numa_engram.integrations.vllm import hook, patches

    nv, _ = vllm
    other = types.ModuleType(hook.manifest.ENGRAM_NV)
    other.__file__ = nv.__file__
    other.Engram = type("Engram", (), {})  # no ParallelEngramEmbedding, no _create_embedding
    monkeypatch.setitem(sys.modules, hook.manifest.ENGRAM_NV, other)
    monkeypatch.setitem(patches.FIRED, hook.manifest.ENGRAM_NV, None)
    del patches.FIRED[hook.manifest.ENGRAM_NV]
    with caplog.at_level(logging.WARNING, logger="vllm.numa_engram"):
        hook.patch_loaded()
    text = "nvidia/engram.py lacks Engram._create_embedding, ParallelEngramEmbedding"
    assert text in caplog.text
    vl = vl_module(harness.cache_dir())
    patch_vl(vl)
    harness.State.config = harness.config(model_dir)
    with pytest.raises(PluginError, match=text + ".*reinstall vllm==0.31.0"):
        vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale")


def test_cpu_offload_off_passes_through_to_vllms_own_storage_saying_why(vllm, model_dir,
                                                                       caplog):
    """Tables kept in GPU memory (cpu_offload=False; 0.33's peer rows are
    one of its branches) are vLLM's own, with one INFO line per engine."""
    import logging

    nv, common = vllm
    with caplog.at_level(logging.INFO, logger="vllm.numa_engram"):
        embs = _engine(nv, common, model_dir, cpu_offload=False)
    assert {type(e).__name__ for e in embs.values()} == {"ParallelEngramEmbedding"}
    assert caplog.text.count("cpu_offload=False keeps the Engram tables in GPU memory") == 1


# ------------------------------------------ worlds: restarts, settings --

@pytest.mark.multiproc
def test_warm_restart_tp2_dp2_service_attaches_bit_exact_with_no_engram_loader_call(
        vllm, model_dir, tmp_path):
    """Issue 49.6, the README's warm-restart setup: ``numa-engram serve --tp
    2`` and four ranks as vLLM's TP 2 x DP 2 on one host, dp_shared asked
    (vLLM's default), "service" given: every rank attaches its TP slice
    (the service's), two engines in a row, rows bit-exact with the whole
    table and vLLM's own storage, and vLLM's loader makes zero calls for
    Engram tensors (the EDP group shrank each rank's slice below the
    service's before: every attach refused)."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import warm_restart

    held = start_service(model_dir, tmp_path / "engram.sock", tp=2)
    try:
        results = run_world(4, warm_restart, timeout_s=300, model_dir=model_dir,
                            root=str(harness.cache_dir()), spec=SPEC.to_dict(),
                            service=held.socket_path)
    finally:
        held.stop()
    part = -(-SPEC.n_hash_cols // 2)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        for restart, engine in enumerate(r["engines"]):
            print(f"rank {r['rank']} engine {restart}: modes {engine['modes']}, heads "
                  f"{engine['heads']}, Engram loader calls {engine['loader_calls']}, "
                  f"{engine['compared']} bytes of rows compared, mismatches "
                  f"{engine['mismatches']}, ready in {engine['ready_s']} s")
            assert engine["shareable"] is True and set(engine["modes"]) == {"service"}
            assert engine["loader_calls"] == 0 and engine["mismatches"] == [], engine
            tp_rank = r["rank"] % 2
            assert all(h == [tp_rank * part, min((tp_rank + 1) * part, SPEC.n_hash_cols)]
                       for h in engine["heads"]), engine["heads"]


@pytest.mark.multiproc
def test_dp_replicas_given_different_settings_all_fail_naming_them(vllm, model_dir, tmp_path):
    """Issue 49.8: the first DP replica given a table service, the second
    none: every rank raises the same PluginError naming the setting and
    each rank's value, within the bound (one returned early and the other
    hung in all_gather before)."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import differing_settings

    sock = str(tmp_path / "engram.sock")
    results = run_world(4, differing_settings, timeout_s=120, model_dir=model_dir,
                        root=str(harness.cache_dir()), service=sock)
    by_rank = {r["rank"]: r for r in results}
    assert all(r["ok"] for r in results), results
    for tp_rank in (0, 1):
        raised = by_rank[tp_rank]["raised"]
        assert raised == by_rank[tp_rank + 2]["raised"], results
        assert raised.startswith("PluginError: the DP replicas were given different "
                                 "numa_engram settings (service: "), raised
        assert f"rank {tp_rank} '{sock}', rank {tp_rank + 2} None" in raised, raised


@pytest.mark.multiproc
def test_auto_without_a_service_shares_one_copy(vllm, model_dir, tmp_path, monkeypatch):
    """Issue 49.7: "service": "auto" where no service runs gives what no
    service gives: one DP-shared copy (a private copy per replica before)."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import serve

    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", str(tmp_path / "none.sock"))
    results = run_world(4, serve, timeout_s=300, model_dir=model_dir, mode="dp_shared",
                        root=str(harness.cache_dir()), spec=SPEC.to_dict(),
                        additional={"service": "auto"})
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["shareable"] is True and r["mismatches"] == [], r
        assert set(r["modes"]) == {"dp_shared"}


@pytest.mark.multiproc
@pytest.mark.parametrize("nodes", [[0, 1], [0, 0]], ids=["one-per-socket", "both-on-node-0"])
def test_copies_socket_with_one_replica_per_socket_makes_private_tables_saying_so(
        vllm, model_dir, nodes):
    """Issue 49.9: DP 2 (TP 1) with dp_shared asked and "copies": "socket",
    rank 0's GPU on node 0 and rank 1's on node 1: no DP peer of a rank can
    map its copy, so each rank makes a private table with the plugin's fall
    back line (a StorageError "the sharing group has one member" before),
    filled by vLLM's loader, rows bit-exact with the checkpoint's and with
    vLLM's own storage.  Both GPUs on node 0: one shared copy, no such
    line.  The GPUs' nodes are a fake (tests/support/vllm_scenarios.on_gpu_nodes:
    host.topology.gpu_node as sharing_groups looks it up, in the spawned
    ranks only): this machine has no GPU."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import check_copies_socket, on_gpu_nodes, serve

    results = run_world(2, on_gpu_nodes, timeout_s=300, nodes=nodes, then=serve, tp=1,
                        model_dir=model_dir, mode="dp_shared", root=str(harness.cache_dir()),
                        spec=SPEC.to_dict(), additional={"copies": "socket"})
    for r in results:
        check_copies_socket(r, SPEC, nodes)
