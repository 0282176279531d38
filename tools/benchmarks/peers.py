"""Against peers on the same rows: engramdb-python's ``Store.fetch`` (its
Rust core's reads of fixed-width row files) and vLLM 0.34's PLE
``Qwen4ExpPLEDiskOffloadEmbedding`` read path (the step's ids to the host,
``stage_rows``, ``staged_rows``: rows read from the checkpoint file),
under the test harness on CPU, beside our mapped and resident PLE tables
of the same checkpoint and numpy take, same ids, interleaved; warm page
cache (every row file read through once first)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .harness import best_interleaved, close_table, rotating_id_sets, turns

PEER_TOKENS = (1, 8, 64, 256)


def _spec(table_gib: float):
    """A Qwen4-Exp-shaped PLE layer (16 heads of 160 FP8 bytes) of about
    ``table_gib``."""
    from numa_engram.model.ple import PLESpec

    base = max(1000, int(table_gib * 2**30) // 160 // 16)
    return PLESpec(layer_ids=[2], ple_embed_dim=2560, vocab_size=151_936, eos_token_id=2,
                   ngram_vocab_size_base=base)


def _engramdb_store(rows: np.ndarray, directory: Path):
    """engramdb's Store of ``rows`` (one shard file of fixed-width rows, its
    format), or the reason it cannot be had."""
    try:
        import engramdb
    except ImportError as exc:
        return None, f"engramdb-python is not installed ({exc}): pip install engramdb-python"
    directory.mkdir()
    rows.tofile(directory / "shard_000.bin")
    return engramdb.Store(str(directory), 1, rows.shape[0], rows.shape[1]), ""


def _vllm_disk_offload(model: Path, spec, max_tokens: int):
    """vLLM 0.34's disk-offload PLE embedding of the layer, loaded and bound
    to the checkpoint by vLLM's own code under the test harness, or the
    reason it cannot be had.  The caller leaves ``harness.isolated()``."""
    try:
        from tests.support import vllm_harness as harness
    except ImportError as exc:  # (run from the repository root: tools/bench.py is)
        return None, f"the vLLM test harness is not importable ({exc})", None
    version = "0.34.0"
    root, why = harness.wheel_sources(version)
    if root is None:
        return None, why, None
    isolated = harness.isolated()
    isolated.__enter__()
    try:
        ple = harness.ple_modules(root, version)
        from types import SimpleNamespace

        harness.State.tp = SimpleNamespace(rank_in_group=0, world_size=1, ranks=[0],
                                           cpu_group=None, device_group=None)
        harness.State.config = harness.config(str(model), disk_offload=True,
                                              max_tokens=max_tokens)
        layer = spec.layer_ids[0]
        module = harness.ple_layer(ple.nv, spec.to_dict(), layer, max_tokens=max_tokens)
        emb = module.ngram_embedding
        if type(emb).__name__ != "Qwen4ExpPLEDiskOffloadEmbedding":
            raise RuntimeError(f"vLLM {version} built {type(emb).__name__}, not its disk "
                               "offload embedding")
        harness.load_ple_checkpoint(module, str(model / "model.safetensors"), layer)
        emb.bind_file_shards()
        return emb, "", isolated
    except BaseException:
        isolated.__exit__(None, None, None)
        raise


def _vllm_read(emb, ids):
    """vLLM's step: ids to the host, the rows read, the staged rows."""
    emb.copy_ids_to_host(ids)
    emb.stage_rows(ids.shape[0])
    return emb.staged_rows(ids.shape[0])


def _variants(spec, mapped, resident, store, emb, tokens: int, rng) -> dict:
    import torch

    sets = [rng.integers(0, spec.rows(2), (tokens, spec.n_heads))
            for _ in range(rotating_id_sets(tokens, spec.n_heads, spec.row_bytes))]
    flats = [ids.reshape(-1) for ids in sets]
    tensors = [torch.from_numpy(ids) for ids in sets]
    gathered = np.empty((tokens * spec.n_heads, spec.row_bytes), np.uint8)
    turn = [0]

    def nxt() -> int:
        turn[0] += 1
        return turn[0] % len(sets)
    fns = {
        "numpy take": lambda: resident.weights.take(flats[nxt()], axis=0, out=gathered,
                                                    mode="clip"),
        "mapped packed": lambda: mapped.lookup_packed(sets[nxt()]),
        "resident packed": lambda: resident.lookup_packed(sets[nxt()]),
        "mapped bf16": lambda: mapped.lookup(sets[nxt()]),
    }
    if store is not None:
        fns["engramdb fetch"] = lambda: store.fetch(flats[nxt()])
    if emb is not None:
        fns["vllm 0.34 disk"] = lambda: _vllm_read(emb, tensors[nxt()])
    return fns


def _same_rows(mapped, resident, store, emb, ids: np.ndarray) -> bool:
    """Every reader's bytes of ``ids`` equal the mapped table's."""
    import torch

    want = mapped.lookup_packed(ids)
    ok = np.array_equal(want, resident.lookup_packed(ids))
    if store is not None:
        got = np.frombuffer(store.fetch(ids.reshape(-1)), np.uint8).reshape(want.shape)
        ok = ok and np.array_equal(got, want)
    if emb is not None:
        got = _vllm_read(emb, torch.from_numpy(ids)).view(torch.uint8).numpy()
        ok = ok and np.array_equal(got.reshape(want.shape), want)
    return ok


def bench_peers(table_gib: float = 1.0, tokens_list: tuple[int, ...] = PEER_TOKENS,
                repeat: int = 15) -> None:
    """Each reader's best of ``repeat`` interleaved turns (more for fast
    calls) at ``tokens_list`` tokens x 16 heads, as time and as a ratio to
    our mapped table's packed rows (the same bytes every peer returns;
    ``mapped bf16``: ours turned into BF16 too), rows checked equal first."""
    from numa_engram.tables.pletable import SharedPLETable
    from tests.support import ple_scenarios  # (tools/bench.py puts the repository root on the path)

    spec = _spec(table_gib)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        model = ple_scenarios.write_ple_model(Path(tmp) / "model", spec)
        ckpt = str(model / "model.safetensors")
        mapped = SharedPLETable.create(spec, 2, checkpoint=ckpt, tier="mapped",
                                       mode="independent")
        resident = SharedPLETable.create(spec, 2, checkpoint=ckpt, mode="independent")
        store, store_why = _engramdb_store(np.asarray(mapped.weights), Path(tmp) / "engramdb")
        emb, vllm_why, isolated = _vllm_disk_offload(model, spec, max(tokens_list))
        try:
            _warm(ckpt, Path(tmp) / "engramdb")
            print(f"== peers: a {mapped.backing_bytes / 2**30:.2f} GiB PLE layer "
                  f"({spec.rows(2)} rows of {spec.row_bytes} FP8 bytes, 16 heads), warm page "
                  "cache; time in us, ratio to our mapped table's packed rows")
            for name, why in (("engramdb", store_why), ("vLLM 0.34 disk offload", vllm_why)):
                if why:
                    print(f"  ({name} skipped: {why})")
            for tokens in tokens_list:
                ids = rng.integers(0, spec.rows(2), (tokens, spec.n_heads))
                if not _same_rows(mapped, resident, store, emb, ids):
                    raise AssertionError(f"the readers' rows differ at {tokens} tokens")
                fns = _variants(spec, mapped, resident, store, emb, tokens, rng)
                best = best_interleaved(fns, turns(fns, repeat))
                if tokens == tokens_list[0]:
                    print("  tokens  " + "  ".join(f"{n:>20}" for n in best))
                base = best["mapped packed"]
                print(f"  {tokens:6d}  " + "  ".join(
                    f"{t * 1e6:10.1f} ({t / base:5.2f}x)" for t in best.values()))
            print("  (rows equal across readers at every size, atol 0)")
        finally:
            if isolated is not None:
                for fd in getattr(emb, "_fds", {}).values():
                    os.close(fd)
                isolated.__exit__(None, None, None)
            close_table(mapped)
            close_table(resident)


def _warm(checkpoint: str, engramdb_dir: Path) -> None:
    """Every byte of the checkpoint and engramdb's rows read once (the page
    cache warm for every reader)."""
    paths = [Path(checkpoint), *sorted(engramdb_dir.glob("*.bin"))]
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
