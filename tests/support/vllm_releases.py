"""What the per-release vLLM test modules share (test_vllm_releases,
test_vllm_plugin_releases, test_vllm_mapped_tier): the small V4.1 and
Qwen4-Exp specs, each release's modules as a module-scoped fixture
(``release_fixture``: with or without the plugin's patches), the synthetic
model directories, and one rank's harness state per test.  A test module
takes the fixtures by importing them (pytest finds them in its globals)."""

import os
from types import SimpleNamespace

import pytest

from numa_engram import EngramSpec, write_synthetic_model
from numa_engram.model.ple import PLESpec

from . import ple_scenarios
from . import vllm_harness as harness

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)
PLE = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
              ngram_vocab_size_base=3000, split_ngram_parts=7)


def release_fixture(patched: bool):
    """A module-scoped ``release`` fixture over every release the harness
    loads: its V4.1 and Qwen4-Exp modules (``patched``: the plugin's
    patches applied, and the VL model module loaded and patched), loaded
    apart from any other release's and restored after; a release whose
    files cannot be had is skipped with the reason."""

    @pytest.fixture(scope="module", params=sorted(harness.RELEASES))
    def release(request):
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_INTERPRET is not 1 in this process: vLLM's kernels need the "
                        "interpreter on CPU tensors")
        version = request.param
        root, why = harness.wheel_sources(version)
        if root is None:
            pytest.skip(why)
        if not patched:
            with harness.isolated():
                nv, common = harness.vllm_modules(root, version)
                ple = harness.ple_modules(root, version)
                yield SimpleNamespace(version=version, root=root, nv=nv, common=common, ple=ple)
            return
        yield from _patched(root, version)

    return release


def _patched(root, version):
    from numa_engram.integrations.vllm import patch, patch_ple, patches
    from numa_engram.integrations.vllm.patch_vl_model import patch as patch_vl

    from .vllm_scenarios import vl_module

    saved = dict(patches.FIRED)
    patches.FIRED.clear()
    try:
        with harness.isolated():
            nv, common = harness.vllm_modules(root, version)
            ple = harness.ple_modules(root, version)
            patch(nv, common)
            patch_ple(ple.common, ple.ple, ple.nv)
            vl = vl_module(root)
            patch_vl(vl)
            yield SimpleNamespace(version=version, root=root, nv=nv, common=common, ple=ple,
                                  vl=vl)
    finally:
        patches.FIRED.clear()
        patches.FIRED.update(saved)


@pytest.fixture(autouse=True)
def one_rank():
    """Every test starts and ends as one rank (no TP, EDP or DP group)."""
    harness.State.tp = harness.State.edp = harness.State.dp = None
    yield
    harness.State.tp = harness.State.edp = harness.State.dp = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("v41"), SPEC))


@pytest.fixture(scope="module")
def ple_dir(tmp_path_factory):
    return str(ple_scenarios.write_ple_model(tmp_path_factory.mktemp("qwen4") / "m", PLE))
