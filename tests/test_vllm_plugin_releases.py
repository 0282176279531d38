"""The vLLM plugin on each release it supports (manifest.py: 0.31.0 to
0.34.0), against that release's own files (tests/support/vllm_harness.py loads any
of them under stubs; its kernels under Triton's interpreter): for V4.1 and
Qwen4-Exp, our tables under vLLM's embeddings hold vLLM's bytes and give
vLLM's rows and our lookup's; a table service's tables are attached with
no loader call for their tensors; the branches the plugin leaves to vLLM
pass through saying so; a patched file that differs from the manifest is
a WARNING at register and a PluginError at construction, both naming it;
the per-layer report reaches vLLM's ``vllm`` logger.

Each release's files are fetched once per cache (``pip download``); a
release that cannot be had is skipped with the reason."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import logging  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from numa_engram.integrations.vllm import manifest, patch, patches  # noqa: E402
from numa_engram.integrations.vllm.settings import PluginError  # noqa: E402

from .support import ple_scenarios, vllm_releases  # noqa: E402
from .support import vllm_harness as harness  # noqa: E402
from .support.service import start_service  # noqa: E402
from .support.vllm_releases import PLE, SPEC  # noqa: E402
from .support.vllm_scenarios import global_ids, load_through_mapper  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'numa_engram[test]')")
pytest.importorskip("safetensors", reason="safetensors is not installed")

# the shared fixtures, found by pytest in this module's globals
release = vllm_releases.release_fixture(patched=True)
model_dir, ple_dir = vllm_releases.model_dir, vllm_releases.ple_dir
one_rank = vllm_releases.one_rank


def _bits(t):
    return t.contiguous().view(torch.int16)


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


def _rows_are_vllms(release, model_dir, layout, embs):
    compared = 0
    for index, (layer, emb) in enumerate(embs.items()):
        ids = global_ids(SPEC, layer, 16, seed=layer)
        got = emb(ids)
        theirs = _vllms_own(release, layout, index, model_dir, layer)(ids)
        assert torch.equal(_bits(got), _bits(theirs)), (release.version, layer)
        ours = emb.numa_table.lookup(ids.numpy(), id_format="global")
        assert torch.equal(_bits(got), _bits(ours)), (release.version, layer)
        compared += got.numel()
    return compared


@pytest.mark.parametrize("page", ["4K", pytest.param("2M", marks=pytest.mark.serial)])
def test_v41_private_tables_give_vllms_rows_and_the_report_reaches_vllms_logger(
        release, model_dir, page, request, caplog):
    if page == "2M":
        request.getfixturevalue("huge_pool")
    with caplog.at_level(logging.INFO, logger="vllm"):
        layout, embs = _engine(release, model_dir, additional={"page_size": page})
        calls = load_through_mapper(release.vl, embs, model_dir)
    try:
        assert calls == 2 * len(embs)
        assert {type(e).__name__ for e in embs.values()} == {"NumaEngramEmbedding"}
        for name in manifest.RELEASES[release.version].storage_reads:  # 0.34: huge_pages
            assert getattr(embs[layout.layer_ids[0]]._shared_memory, name) == (page != "4K")
        compared = _rows_are_vllms(release, model_dir, layout, embs)
        lines = [r.getMessage() for r in caplog.records
                 if r.name.startswith("vllm.numa_engram") and "Engram layer" in r.getMessage()]
        print(f"vLLM {release.version} {page}: {compared} values bit-exact with vLLM's own "
              f"storage and lookup(id_format='global'); {lines[0]}")
        assert len(lines) == len(embs), lines
        table = embs[layout.layer_ids[0]].numa_table
        assert f"Engram layer {layout.layer_ids[0]} heads [0, {SPEC.n_hash_cols}): " \
               f"independent, source built, {page} pages, {table.backing_bytes} bytes, " \
               "pages per node" in lines[0], lines[0]
    finally:
        for emb in embs.values():
            emb.numa_table.close()


@pytest.fixture
def service(model_dir, tmp_path):
    held = start_service(model_dir, tmp_path / "engram.sock")
    yield held.socket_path
    held.stop()


def test_v41_service_tables_are_attached_with_no_loader_call(release, model_dir, service,
                                                             caplog):
    for restart in range(2):
        with caplog.at_level(logging.INFO, logger="vllm"):
            layout, embs = _engine(release, model_dir, additional={"service": service})
        calls = load_through_mapper(release.vl, embs, model_dir)
        assert {e.numa_table.mode for e in embs.values()} == {"service"}
        assert calls == 0, calls
        compared = _rows_are_vllms(release, model_dir, layout, embs)
        print(f"vLLM {release.version} engine {restart}: attached, {calls} Engram loader "
              f"calls, {compared} values bit-exact")
        assert "source attached" in caplog.text
        for emb in embs.values():
            emb.numa_table.close()


def test_v41_gpu_tables_pass_through_saying_why(release, model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        _, embs = _engine(release, model_dir, cpu_offload=False)
    assert {type(e) for e in embs.values()} == {release.nv.ParallelEngramEmbedding}
    assert caplog.text.count("cpu_offload=False keeps the Engram tables in GPU memory") == 1


def _ple_module(release, ple_dir, layer, **config):
    harness.State.config = harness.config(ple_dir, **config)
    return harness.ple_layer(release.ple.nv, PLE.to_dict(), layer)


def test_ple_tables_hold_vllms_bytes_and_a_service_is_attached(release, ple_dir, tmp_path,
                                                               caplog):
    checkpoint = os.path.join(ple_dir, "model.safetensors")
    harness.State.tp = harness.Coordinator([0], None)
    held = start_service(ple_dir, tmp_path / "ple.sock")
    try:
        for layer in PLE.layer_ids:
            own = _ple_module(release, ple_dir, layer, cpu_offload=False)  # vLLM's storage
            harness.load_ple_checkpoint(own, checkpoint, layer)
            theirs = own.ngram_embedding
            for additional in ({}, {"service": held.socket_path}):
                with caplog.at_level(logging.INFO, logger="vllm"):
                    module = _ple_module(release, ple_dir, layer, additional=additional)
                    harness.load_ple_checkpoint(module, checkpoint, layer)
                emb = module.ngram_embedding
                table = emb._numa_ple.table
                assert table.mode == ("service" if additional else "independent")
                assert emb.weight.data_ptr() == table.weights.ctypes.data
                assert torch.equal(emb.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
                assert float(emb.weight_scale) == float(theirs.weight_scale) == table.scale
                source = "attached" if additional else "built"
                assert f"PLE layer {layer} rows [0, {PLE.rows(layer)}) of ETP rank 0/1: " \
                       f"{table.mode}, source {source}" in caplog.text, caplog.text
                print(f"vLLM {release.version} PLE layer {layer} {table.mode}: "
                      f"{emb.weight.numel()} bytes equal vLLM's own storage")
                table.close()
    finally:
        held.stop()


def test_ple_disk_offload_passes_through_saying_why(release, ple_dir, caplog):
    rel = manifest.RELEASES[release.version]
    if not rel.ple_disk_offload:
        pytest.skip(f"vLLM {release.version} has no PLE disk_offload (0.34+)")
    harness.State.tp = harness.Coordinator([0], None)
    with caplog.at_level(logging.INFO, logger="vllm"):
        module = _ple_module(release, ple_dir, PLE.layer_ids[0], disk_offload=True)
    assert type(module.ngram_embedding).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
    assert caplog.text.count("disk_offload keeps the Qwen4-Exp PLE tables") == 1


def test_a_patched_file_that_differs_warns_at_register_and_fails_at_construction(
        release, model_dir, tmp_path, caplog, monkeypatch):
    """The release's Engram module file changed by one line: register()
    logs one WARNING naming the file and what to install; the model's
    construction with the plugin's settings raises a PluginError naming
    it; without settings vLLM's own storage runs."""
    from numa_engram.integrations.vllm import hook

    rel = manifest.RELEASES[release.version]
    relative = rel.file_of(rel.engram_module)
    tree = tmp_path / "vllm"
    for name in rel.files:
        (tree / rel.file_of(name)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(release.root / "vllm" / rel.file_of(name), tree / rel.file_of(name))
    changed = tree / relative
    changed.write_text(changed.read_text() + "\n# a local edit\n")
    vllm = sys.modules["vllm"]
    monkeypatch.setattr(vllm, "__path__", [str(tree)], raising=False)
    monkeypatch.setattr(vllm, hook.WARNED, False, raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        hook.warn_unlisted()
        hook.warn_unlisted()  # once per process
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{relative} ({changed})" in warnings[0], warnings
    assert f"reinstall vllm=={release.version} unpatched" in warnings[0]
    # the tree's files as vLLM's modules (the changed one among them),
    # patched as the hook patches them
    with harness.isolated():
        nv, common = harness.vllm_modules(tmp_path, release.version)
        assert nv.__file__ == str(changed)
        patches.FIRED.clear()
        patch(nv, common)
        harness.State.config = harness.config(model_dir)
        layout = harness.layout_of(common, model_dir)
        with pytest.raises(PluginError, match=f"{relative} .* is not the file the numa_engram "
                                              f"plugin was checked against"):
            nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
        harness.State.config = harness.config(model_dir, cpu_offload=False)
        harness.State.config.additional_config = {}  # no settings: vLLM's own storage
        emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
        assert type(emb) is nv.ParallelEngramEmbedding


# ------------------------------------------------- worlds, per release --

def _root(version):
    root, why = harness.wheel_sources(version)
    if root is None:
        pytest.skip(why)
    return str(root)


@pytest.mark.multiproc
@pytest.mark.parametrize("version", sorted(manifest.RELEASES))
def test_tp2_dp2_dp_shared_one_copy_with_vllms_rows(version, model_dir):
    """Each release's DP-shared branch through the plugin: four real ranks
    as vLLM's TP 2 x DP 2, one copy per TP shard by PSS, vLLM's forward
    giving the whole table's rows and vLLM's own storage's."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import serve

    results = run_world(4, serve, timeout_s=300, model_dir=model_dir, mode="dp_shared",
                        root=_root(version), spec=SPEC.to_dict(), version=version)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["shareable"] is True and r["mismatches"] == [], r
        assert set(r["modes"]) == {"dp_shared"}
    one_copy = sum(r["table_bytes"] for r in results if r["rank"] < 2)
    copies = sum(r["pss"] for r in results) / one_copy
    print(f"vLLM {version} TP 2 x DP 2 dp_shared: {one_copy} bytes, {copies:.3f} copies by PSS")
    assert abs(copies - 1.0) < 0.02, copies


@pytest.mark.multiproc
@pytest.mark.parametrize("version", sorted(manifest.RELEASES))
def test_tp2_dp2_warm_restart_attaches_with_no_engram_loader_call(version, model_dir,
                                                                   tmp_path):
    """Each release: a table service of serve --tp 2 and vLLM's TP 2 x DP 2
    on one host, two engines in a row: every rank attaches its TP slice,
    rows bit-exact, 0 loader calls for Engram tensors."""
    from .support.dist_harness import run_world
    from .support.vllm_scenarios import warm_restart

    held = start_service(model_dir, tmp_path / "engram.sock", tp=2)
    try:
        results = run_world(4, warm_restart, timeout_s=300, model_dir=model_dir,
                            root=_root(version), spec=SPEC.to_dict(),
                            service=held.socket_path, version=version)
    finally:
        held.stop()
    for r in results:
        assert r["ok"], r.get("traceback", r)
        for engine in r["engines"]:
            assert set(engine["modes"]) == {"service"} and engine["loader_calls"] == 0, engine
            assert engine["mismatches"] == [], engine
    print(f"vLLM {version} warm restart TP 2 x DP 2: Engram loader calls "
          f"{[e['loader_calls'] for r in results for e in r['engines']]}, ready s "
          f"{[e['ready_s'] for r in results for e in r['engines']]}")


REGISTER = r"""
import logging, shutil, sys
from pathlib import Path
repo, tree, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
sys.path.insert(0, repo)
from tests.support import vllm_harness as harness
harness.install_stubs(version)
for name in ("vllm.models", "vllm.models.deepseek_v41", "vllm.models.deepseek_v41.common",
             "vllm.models.deepseek_v41.nvidia"):
    del sys.modules[name]  # real packages from here on, laid out as vLLM's wheel lays them
sys.modules["vllm"].__path__ = [str(tree / "vllm")]
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from numa_engram.integrations.vllm import register
from numa_engram.integrations.vllm.manifest import RELEASES
register()
register()  # idempotent
import vllm.models.deepseek_v41  # its __init__ imports nvidia/model.py, which binds by name
engram = sys.modules[RELEASES[version].engram_module]
model = sys.modules["vllm.models.deepseek_v41.nvidia.model"]
assert engram._numa_engram_patched
assert engram.Engram._create_embedding.__module__.startswith("numa_engram")
assert model.can_share_engram_tables is engram.can_share_engram_tables
assert model.can_share_engram_tables.__module__.startswith("numa_engram"), model.__dict__
print("patched", engram.__name__)
"""


@pytest.mark.slow  # starts an interpreter (~1 s)
@pytest.mark.parametrize("version", sorted(manifest.RELEASES))
def test_register_patches_each_releases_engram_module_as_vllm_imports_it(version, tmp_path):
    """register() in a fresh interpreter, then vLLM's V4.1 package imported
    as the release lays it out (its nvidia/model.py binding
    can_share_engram_tables by name: from .engram on 0.31, from
    ..common.engram on 0.32+, where nvidia/engram.py is gone): the
    release's Engram module is patched before model.py binds it, and the
    log says so under vLLM's logger (0.32+ were patched nowhere before)."""
    import subprocess

    root = Path(_root(version))
    rel = manifest.RELEASES[version]
    tree = tmp_path / "tree"
    package = tree / "vllm" / "models" / "deepseek_v41"
    for sub in ("common", "nvidia"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    for name in (rel.engram_module, manifest.ENGRAM_COMMON):
        shutil.copy(root / "vllm" / rel.file_of(name), tree / "vllm" / rel.file_of(name))
    (tree / "vllm" / "models" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .nvidia import model  # as vLLM's does\n")
    source = ".engram" if rel.engram_module == manifest.ENGRAM_NV else "..common.engram"
    (package / "nvidia" / "model.py").write_text(
        f"from {source} import Engram, can_share_engram_tables  # noqa: F401\n")
    repo = str(Path(__file__).resolve().parent.parent)
    run = subprocess.run([sys.executable, "-c", REGISTER, repo, str(tree), version],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == f"patched {rel.engram_module}", run.stdout
    assert f"vLLM {version}'s Engram storage patched ({rel.engram_module})" in run.stderr
    assert "WARNING" not in run.stderr, run.stderr[-2000:]


def test_an_engram_hook_that_never_fired_is_an_error_at_construction(release, model_dir,
                                                                     monkeypatch):
    """The plugin's settings given, the model constructed, but the hook
    for the release's Engram module never ran (a module moved, as 0.32
    moved nvidia/engram.py): the VL model's construction raises naming the
    module and what to install; without settings it is vLLM's own."""
    rel = manifest.RELEASES[release.version]
    monkeypatch.delitem(patches.FIRED, rel.engram_module)
    harness.State.config = harness.config(model_dir)
    with pytest.raises(PluginError, match=f"hook for vLLM {release.version}'s "
                                          f"{rel.engram_module} never fired.*install one of "
                                          "vllm==0.31.0"):
        release.vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale")
    harness.State.config.additional_config = {}
    release.vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale")


def test_under_the_meta_device_vllms_meta_tensors_and_no_table(release, model_dir):
    """0.33+ builds under torch's meta device first in its own
    _allocate_weights (a shape-only model): the plugin's embedding does the
    same and places no table there."""
    if not manifest.RELEASES[release.version].meta_branch:
        pytest.skip(f"vLLM {release.version}'s _allocate_weights has no meta branch (0.33+)")
    harness.State.config = harness.config(model_dir)
    layout = harness.layout_of(release.common, model_dir)
    with torch.device("meta"):
        emb = release.nv.Engram._create_embedding(harness.thin_engram(release.nv), layout, 0)
    assert type(emb).__name__ == "NumaEngramEmbedding"
    assert emb.weight.is_meta and emb.numa_table is None and emb._shared_memory is None


@pytest.mark.multiproc
@pytest.mark.parametrize("version", sorted(manifest.RELEASES))
def test_ple_tp2_dp2_dp_shared_one_copy_per_tp_shard_holds_vllms_bytes(version, ple_dir):
    """Each release's Qwen4-Exp PLE tables through the plugin with dp_shared:
    four real ranks as vLLM's TP 2 x DP 2, the DP replicas of a TP rank
    share one table per layer (PSS summed is one copy), its bytes equal
    vLLM's own storage and the TP pair's rows the whole table's."""
    from .support.dist_harness import run_world

    results = run_world(4, ple_scenarios.vllm_plugin_dp_shared, timeout_s=300,
                        model_dir=ple_dir, root=_root(version), spec=PLE.to_dict(),
                        additional={}, version=version)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [] and set(r["modes"]) == {"dp_shared"}, r
    for tp_rank in (0, 1):
        members = [results[tp_rank], results[2 + tp_rank]]
        pss, one = sum(m["pss"] for m in members), members[0]["table_bytes"]
        print(f"vLLM {version} PLE TP rank {tp_rank}: {pss / one:.3f} copies by PSS")
        assert abs(pss - one) <= 0.05 * one, (tp_rank, pss, one)


def test_a_patch_release_with_the_same_files_is_served_as_its_release(release, tmp_path,
                                                                      monkeypatch):
    """X.Y.1 whose patched files hash as X.Y.0's is X.Y.0 to the plugin;
    with one of them changed it is a release the manifest lacks."""
    rel = manifest.RELEASES[release.version]
    tree = tmp_path / "vllm"
    for name in rel.files:
        (tree / rel.file_of(name)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(release.root / "vllm" / rel.file_of(name), tree / rel.file_of(name))
    patched = release.version[:-1] + "1"
    vllm = sys.modules["vllm"]
    monkeypatch.setattr(vllm, "__version__", patched)
    monkeypatch.setattr(vllm, "__path__", [str(tree)], raising=False)
    assert manifest.release() is rel
    changed = tree / rel.file_of(rel.engram_module)
    changed.write_text(changed.read_text() + "\n# a local edit\n")
    manifest._same_files.cache_clear()
    assert manifest.release() is None
    assert f"vLLM {patched} is not a release" in manifest.installed_problems(tree)[0]
    manifest._same_files.cache_clear()
