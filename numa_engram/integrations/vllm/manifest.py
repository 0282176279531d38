"""The vLLM releases the plugin supports, and everything of vLLM's it reads
or replaces: the one table a maintainer edits to add a release.

Each ``Release`` names the module that holds V4.1's NVIDIA Engram code
(0.31: ``nvidia/engram.py``; 0.32 merged it into ``common/engram.py``),
the sha256 of every file the patches were checked against, and the few
behaviours that differ between releases.  ``SYMBOLS`` lists, per patched
module, each vLLM name the plugin reads or replaces; ``missing_symbols``
checks them.  A patch release of a supported version whose patched files
hash the same is served as that version.

To add a release: ``tools/vllm_release.py X.Y.Z`` downloads its wheel
(``pip download --no-deps vllm==X.Y.Z``), prints its files' sha256 and the
symbols of ``SYMBOLS`` it lacks; add its row below, then run
``tests/test_vllm_plugin_releases.py`` (the harness loads any release in
``tests/support/vllm_harness.py``'s RELEASES).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("vllm." + __name__)

# module names (the files are vllm/ + the dotted path, ".py")
ENGRAM_NV = "vllm.models.deepseek_v41.nvidia.engram"
ENGRAM_COMMON = "vllm.models.deepseek_v41.common.engram"
VL = "vllm.models.deepseek_v41.nvidia.vl_model"
MODEL = "vllm.models.deepseek_v41.nvidia.model"
PLE_COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
PLE_HELPERS = "vllm.models.qwen4_exp.common.ple"
PLE_MODEL = "vllm.models.qwen4_exp.nvidia.ngram_embedding"


@dataclass(frozen=True)
class Release:
    """One supported vLLM release."""

    version: str
    engram_module: str             # the module of Engram and ParallelEngramEmbedding
    files: Mapping[str, str]       # sha256 of each patched module's file, by module name
    # vLLM's _allocate_weights returns meta tensors first under torch's meta
    # device (0.33+): the plugin's override does the same, allocating nothing
    meta_branch: bool = False
    # what vLLM reads of an embedding's _shared_memory besides get_views and
    # load_weight (0.34: huge_pages, in its constructor's log and every lookup)
    storage_reads: tuple[str, ...] = ()
    # Qwen4-Exp's PLE tables may stay in the checkpoint files (0.34:
    # engram_config.disk_offload): passed through untouched
    ple_disk_offload: bool = False
    # tier "mapped", by family: (where vLLM computes the hash ids, inside the
    # model's forward; where it reads the rows), files under vllm/models/:
    # the plugin gathers the rows there, not before the forward (logged)
    ids_in_forward: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def file_of(self, module: str) -> str:
        """vLLM's file of ``module``, relative to the vllm package."""
        return module.removeprefix("vllm.").replace(".", "/") + ".py"


RELEASES: dict[str, Release] = {r.version: r for r in (
    Release("0.31.0", ENGRAM_NV, {
        ENGRAM_NV: "d7765d509bcfc014efdbcc502b55a95aeec22e3eacd9f3677fab49ae90a9787a",
        ENGRAM_COMMON: "0bdd36b2ab4d28a8c30e9e77f1d8e25dffd05e4aff382cb21ba39aca3e84ab91",
        VL: "627a321c526295547c065778b610b62b16d4cacc9f73572e987b5cfc8949ea80",
        PLE_COMMON: "1392f51ccf0b610542bf05c3021271bf6754221d9616ff92831b94f79fc3a892",
        PLE_HELPERS: "585fabb01a14f8071251e52891843cdc1340f75b4d7173abf4748e2ba8746b76",
        PLE_MODEL: "7c3f00b5b77b364062dd28b49f3fc43c52fd74b7b0d63a32870937eb10ff16e4"},
        ids_in_forward={
            "Engram": ("deepseek_v41/nvidia/model.py:870",
                       "deepseek_v41/common/engram.py:706, from nvidia/engram.py:473"),
            "PLE": ("qwen4_exp/nvidia/model.py:483 -> nvidia/ngram_embedding.py:377",
                    "qwen4_exp/common/ngram_embedding.py:443")}),
    Release("0.32.0", ENGRAM_COMMON, {
        ENGRAM_COMMON: "80d6f14973c99be431029e0fba4a6a784a428501bd6ba1726cff0879e0e1627f",
        VL: "ff2c16614dc694f0c07a45929def3c76f30cb547f897b57c18c70bb99587171c",
        PLE_COMMON: "ad4de618a5810aec3b02f6152b4f5c422a648ca930aa3c3e747524498489f53d",
        PLE_HELPERS: "585fabb01a14f8071251e52891843cdc1340f75b4d7173abf4748e2ba8746b76",
        PLE_MODEL: "54e264b837b017bf727c20742202ff0402aac1b30329c558b1271f3479fd5d44"},
        ids_in_forward={
            "Engram": ("deepseek_v41/nvidia/model.py:966",
                       "deepseek_v41/common/engram.py:1110, from :1617"),
            "PLE": ("qwen4_exp/nvidia/model.py:513 -> nvidia/ngram_embedding.py:405",
                    "qwen4_exp/common/ngram_embedding.py:469")}),
    Release("0.33.0", ENGRAM_COMMON, {
        ENGRAM_COMMON: "720923ccd796dfdeab4b396eeeea79cd4c11a9dcd2e6ef8d57c0390fa4cf7ab2",
        VL: "517f135eb8fb75b112d335c60f94175e1622c254f339d7ef854f6051b29d78f9",
        PLE_COMMON: "ef0319508554d26da0870c5b8894d4a96b6d82ad069695558d2497c6814102f8",
        PLE_HELPERS: "80bdf7ddc951f35b5daca478dbe4024c193942459040254ca7e93b4a4ffced9a",
        PLE_MODEL: "8442e161d90d09ccc0aab06aea809e8f1fc387c8af348a32a9424bfa1f755533"},
        meta_branch=True,
        ids_in_forward={
            "Engram": ("deepseek_v41/nvidia/model.py:1029",
                       "deepseek_v41/common/engram.py:1180, from :1691"),
            "PLE": ("qwen4_exp/nvidia/model.py:506 -> nvidia/ngram_embedding.py:410",
                    "qwen4_exp/common/ngram_embedding.py:682")}),
    Release("0.34.0", ENGRAM_COMMON, {
        ENGRAM_COMMON: "9a35baf05fd869e9f757ff88a541101d42612ed90f01cf08cb3d0a6b09c6a270",
        VL: "cc514a12874e7d04fcea9451cae16c92e479bd829de8bf871e5de46320d57211",
        PLE_COMMON: "0b06fffed140b15c60ee7faf3078dc839270e807942e753a14af917978f017b8",
        PLE_HELPERS: "7d6a26c25aced1ad5f12d85f3ab9605956bb7f1a1d46351b43ccfbf009c3f3a1",
        PLE_MODEL: "ff487547c74bef0cc2d0e69a4bdaad41fc4ed14e49b585aac6473a3165c2c833"},
        meta_branch=True, storage_reads=("huge_pages",), ple_disk_offload=True,
        ids_in_forward={
            "Engram": ("deepseek_v41/nvidia/model.py:1054",
                       "deepseek_v41/common/engram.py:1129, from :1646"),
            "PLE": ("qwen4_exp/nvidia/model.py:532 -> nvidia/ngram_embedding.py:633",
                    "qwen4_exp/common/ngram_embedding.py:712")}),
)}

# every vLLM name the plugin reads or replaces, by the module it is read from
# ("engram": the release's engram_module); dotted: an attribute of a class
SYMBOLS: dict[str, tuple[str, ...]] = {
    "engram": ("Engram", "Engram._create_embedding", "ParallelEngramEmbedding",
               "ParallelEngramEmbedding._allocate_weights",
               "ParallelEngramEmbedding._get_shard_info", "ParallelEngramEmbedding.lookup",
               "can_share_engram_tables",
               "get_current_vllm_config", "get_engram_dp_group", "get_engram_dp_size",
               "get_tensor_model_parallel_rank", "get_accelerator_view_from_cpu_tensor"),
    ENGRAM_COMMON: ("_engram_head_shard_weight_loader", "EngramLayout"),
    VL: ("_make_deepseek_v4_vl_weights_mapper",),
    MODEL: ("can_share_engram_tables",),
    # (the pinned embedding's weight_loader is PLEVocabParallelEmbedding's, inherited)
    PLE_COMMON: ("Qwen4ExpPLEPinnedHostEmbedding",
                 "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight",
                 "Qwen4ExpPLEPinnedHostEmbedding._lookup", "get_dp_group", "get_tp_group"),
    PLE_HELPERS: ("PLEVocabParallelEmbedding", "PLEVocabParallelEmbedding.weight_loader"),
    PLE_MODEL: ("Qwen4ExpNGramEmbedding", "Qwen4ExpNGramEmbedding.__init__"),
}
# what the plugin reads of vLLM's objects (not module names; listed for a
# maintainer's check of a new release): the config's engram_config
# (cpu_offload, use_thp, dp_shared_memory, disk_offload), additional_config,
# model_config.hf_config (the tables' layout), load_config.load_format; an Engram embedding's
# num_embeddings, dim, block_size, n_hash_cols, head_start,
# part_n_hash_cols, vocab_start_idx, vocab_end_idx, dp_shared_memory and
# its params' engram_vocab_start (0.33+ set from row_start, equal to
# vocab_start_idx on every host branch); a PLE embedding's prefix, tp_rank,
# tp_size, num_embeddings_padded, shard_indices, weight, weight_scale; with
# tier mapped on 0.34, Qwen4ExpPLEDiskOffloadEmbedding's stage_rows (wrapped),
# _host_ids and _planes (its fixed buffers, written by the plugin's gather);
# vllm.config.get_current_vllm_config, vllm.platforms.current_platform.
OBJECT_READS = ("engram_config", "additional_config", "model_config.hf_config",
                "load_config.load_format", "vocab_start_idx", "engram_vocab_start")

INSTALL = "install one of vllm==" + ", ".join(RELEASES) + " or unset VLLM_PLUGINS=numa_engram"


def vllm_version() -> str | None:
    return getattr(sys.modules.get("vllm"), "__version__", None)


def release() -> Release | None:
    """The running vLLM's release, None when the manifest lacks it: a
    listed version, or a patch release of one (same major and minor) whose
    installed patched files all hash as the listed one's."""
    version = vllm_version()
    if not version or version in RELEASES:
        return RELEASES.get(version or "")
    roots = list(getattr(sys.modules.get("vllm"), "__path__", []) or [])
    return _same_files(version, roots[0]) if roots else None


@functools.lru_cache(maxsize=8)
def _same_files(version: str, root: str) -> Release | None:
    minor = ".".join(version.split(".")[:2]) + "."
    for rel in RELEASES.values():
        if rel.version.startswith(minor) and all(
                sha256_of(Path(root) / rel.file_of(name)) == want
                for name, want in rel.files.items()):
            log.info("numa_engram: vLLM %s's patched files are %s's: served as %s", version,
                     rel.version, rel.version)
            return rel
    return None


def module_name(role: str, rel: Release | None) -> str:
    """The module name of a SYMBOLS role ("engram": the release's)."""
    if role == "engram":
        return rel.engram_module if rel else ENGRAM_COMMON
    return role


def missing_symbols(module: ModuleType, role: str) -> list[str]:
    """The names of ``SYMBOLS[role]`` that ``module`` lacks."""
    missing = []
    for name in SYMBOLS.get(role, ()):
        value: Any = module
        for part in name.split("."):
            value = getattr(value, part, None)
            if value is None:
                missing.append(name)
                break
    return missing


def sha256_of(path: str | Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def module_problem(module: ModuleType, role: str) -> str | None:
    """Why ``module`` (vLLM's, loaded) is not what the plugin was checked
    against: an unknown release, a file of another sha256, a missing
    symbol; or None."""
    rel = release()
    name = module_name(role, rel)
    file = name.removeprefix("vllm.").replace(".", "/") + ".py"
    if rel is None:
        return (f"vLLM {vllm_version()} is not a release the numa_engram plugin supports "
                f"(its {file} unchecked): {INSTALL}")
    missing = missing_symbols(module, role)
    if missing:
        return (f"vLLM {rel.version}'s {file} lacks {', '.join(missing)}, which the "
                f"numa_engram plugin reads or replaces: reinstall vllm=={rel.version} "
                "unpatched, or unset VLLM_PLUGINS=numa_engram")
    want = rel.files.get(name)
    got = sha256_of(getattr(module, "__file__", None) or "")
    if want is not None and got != want:
        return (f"vLLM {rel.version}'s {file} ({module.__file__}) is not the file the "
                f"numa_engram plugin was checked against (sha256 {str(got)[:16]}..., "
                f"expected {want[:16]}...): reinstall vllm=={rel.version} unpatched, or "
                "unset VLLM_PLUGINS=numa_engram")
    return None


def installed_problems(root: str | Path) -> list[str]:
    """At register: why the vLLM installed at ``root`` (its package
    directory) is not one the manifest lists, each naming what to install:
    an unknown release, or each patched file of another sha256 (files that
    are not there are not checked: their import fails on its own)."""
    rel = release()
    if rel is None:
        return [f"vLLM {vllm_version()} is not a release the numa_engram plugin supports; the "
                f"plugin patches nothing it has not checked: {INSTALL}"]
    problems = []
    for name, want in rel.files.items():
        path = Path(root) / rel.file_of(name)
        got = sha256_of(path)
        if got is not None and got != want:
            problems.append(f"vLLM {rel.version}'s {rel.file_of(name)} ({path}) is not the "
                            f"file the numa_engram plugin was checked against (sha256 "
                            f"{got[:16]}..., expected {want[:16]}...): reinstall "
                            f"vllm=={rel.version} unpatched")
    return problems
