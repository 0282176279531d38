"""Start-up: loading a checkpoint into a table, and a restart with and without the table service."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from numa_engram.store.fileformat import Layout
from numa_engram.store.storage import BackingFile

from .harness import best_interleaved, best_of, mem_available


def bench_load(gib: float) -> None:
    import torch
    from safetensors.torch import save_file

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads
    from numa_engram.checkpoints.checkpoint import TensorNames
    from numa_engram.errors import CapacityError
    from numa_engram.host import hugepages

    head_dim = 256
    per_head = int(gib * 2**30) // (head_dim + 8) // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=head_dim, compressed_vocab_size=99092,
                      pad_id=2)
    rows = spec.rows(1)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", "/tmp")) as d:
        path = os.path.join(d, "engram.safetensors")
        w_name, s_name = TensorNames().of(1)
        w = torch.randint(0, 256, (rows, head_dim), dtype=torch.uint8)
        s = torch.randint(110, 135, (rows, head_dim // 32), dtype=torch.uint8)
        save_file({w_name: w.view(torch.float8_e4m3fn), s_name: s.view(torch.float8_e8m0fnu)},
                  path)
        raw = os.path.join(d, "raw.bin")
        with open(raw, "wb") as fh:
            fh.write(w.numpy().tobytes())
            fh.write(s.numpy().tobytes())
        del w, s
        size = rows * spec.row_bytes
        layout = Layout.of([("weights", rows * head_dim), ("scales", rows * head_dim // 32)])

        def plain_copy():
            with BackingFile.create(layout, bytes(32), directory=None) as f:
                buf = f.mapping.array(f.layout.regions[0].offset, size)
                with open(raw, "rb") as fh:
                    fh.readinto(memoryview(buf))

        def create(page_size, load_threads):
            # timed from create() to READY: allocate, place, populate, load
            return lambda: SharedEngramTable.create(spec, 1, shard, checkpoint=path,
                                                    page_size=page_size,
                                                    load_threads=load_threads,
                                                    shared_load=load_threads > 1).close()

        variants = {"copy": plain_copy, "old": create("4K", 1), "new 4K": create("4K", 2)}
        try:
            hugepages.check_pool(size + (8 << 20), 2 << 20)
            variants["new 2M"] = create("2M", 2)
        except CapacityError as exc:
            print(f"  (2M pages skipped: {exc})")
        for fn in variants.values():  # warm the page cache and the reserved pages once
            fn()
        best = best_interleaved(variants, 3)
    print(f"== checkpoint load: {size / 2**30:.2f} GiB shard, create() to READY")
    print(f"  plain copy of the same bytes (page-cached file -> fresh table): "
          f"{size / best['copy'] / 2**30:6.2f} GiB/s")
    print(f"  old: 1 thread, 4K pages : {size / best['old'] / 2**30:6.2f} GiB/s")
    for name in [k for k in variants if k.startswith("new")]:
        print(f"  {name}, 2 threads     : {size / best[name] / 2**30:6.2f} GiB/s -> "
              f"{best['old'] / best[name]:.2f}x the old load"
              + (" (target >= 3x)" if "2M" in name else " (no target)"))


def _streamed_model(root: str, gib: float):
    """A model directory of one ~gib GiB layer, its checkpoint streamed
    (never the whole table in memory)."""
    from numa_engram import EngramSpec, write_synthetic_model

    per_head = int(gib * 2**30) // (256 + 8) // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=1000, pad_id=2)
    write_synthetic_model(root, spec, raw=True)
    return spec


def _vllm_plugin_times(model: str, sock: str, size: int,
                       releases: tuple[str, ...]) -> dict[str, tuple[float, float | None] | str]:
    """Per vLLM release, its own Engram (the wheel's, under the test stubs)
    through the plugin: seconds from ``_allocate_weights`` to ready rows
    (the views vLLM's kernel reads) attached from the service at ``sock``,
    and for a cold private table loaded by vLLM's loader (None where that
    does not fit beside the service); why not, where a release's sources
    cannot be had."""
    from tests.support import vllm_harness as harness

    out: dict[str, tuple[float, float | None] | str] = {}
    for version in releases:
        root, why = harness.wheel_sources(version)
        if root is None:
            out[version] = why
            continue
        with harness.isolated():
            out[version] = _release_times(harness, root, version, model, sock, size)
    return out


def _release_times(harness, root, version: str, model: str, sock: str,
                   size: int) -> tuple[float, float | None]:
    from numa_engram.integrations.vllm import patch, patches

    patches.FIRED.clear()
    nv, common = harness.vllm_modules(root, version)
    patch(nv, common)
    layout = harness.layout_of(common, model)

    def ready(config, load: bool) -> None:
        harness.State.config = config
        emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
        if load:
            harness.load_checkpoint(emb, model, layout.layer_ids[0])
        emb._storage()  # the views vLLM's kernel reads
        emb.numa_table.close()
    attached = harness.config(model, additional={"service": sock})
    t_attach = best_of(lambda: ready(attached, False), 5)
    # cold: a private table plus vLLM's loader's copy of each tensor, beside
    # the service's: measured only where that fits in memory
    if mem_available() < 2.5 * size:
        return t_attach, None
    t_cold = best_of(lambda: ready(harness.config(model), True), 2)
    return t_attach, t_cold


def _restart_times(gib: float, releases: tuple[str, ...]) -> tuple[int, float, float, dict]:
    """(table bytes, best cold start, best attach, the vLLM plugin's (attach,
    cold) per release of ``releases``) for a ~gib GiB table."""
    import subprocess

    from numa_engram import SharedEngramTable, shard_heads
    from numa_engram.store import serviceclient

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", "/tmp")) as d:
        model = os.path.join(d, "model")
        spec = _streamed_model(model, gib)
        shard = shard_heads(spec.bucket_sizes(1), 1, 0)

        def cold():
            SharedEngramTable.create(spec, 1, shard, checkpoint=model, directory=None).close()
        cold()  # the checkpoint into the page cache, as a restart finds it
        t_cold = best_of(cold, 2)
        sock = os.path.join(d, "run", "engram.sock")
        proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", "serve", model,
                                 "--socket", sock], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            while not (os.path.exists(sock) and serviceclient.status(sock)["ready"]):
                if proc.poll() is not None:
                    raise SystemExit(f"the service exited: {proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
            t_attach = best_of(
                lambda: SharedEngramTable.attach(spec, 1, shard, service=sock).close(), 5)
            plugin = _vllm_plugin_times(model, sock, spec.rows(1) * spec.row_bytes, releases)
        finally:
            proc.terminate()
            proc.wait()
    return spec.rows(1) * spec.row_bytes, t_cold, t_attach, plugin


def bench_restart(sizes: tuple[float, ...] = (1.0, 8.0),
                  releases: tuple[str, ...] = ("0.31.0",)) -> None:
    """Cold start (create + load from a page-cached checkpoint) against an
    engine restart that attaches to a table service's ready table; then
    through each release's vLLM Engram with the plugin."""
    print("== restart: cold create + load vs attach to the table service")
    attach_s = {}
    rows = []
    for gib in sizes:
        size, t_cold, t_attach, plugin = _restart_times(gib, releases)
        attach_s[gib] = t_attach
        print(f"  {size / 2**30:5.2f} GiB: cold {t_cold:7.3f} s ({size / t_cold / 2**30:.2f} "
              f"GiB/s), restart (attach) {t_attach * 1e3:7.3f} ms -> {t_cold / t_attach:,.0f}x "
              "faster (goal >= 50x at the large size)", flush=True)
        for version, got in plugin.items():
            rows.append((version, size, got))
    small, large = min(attach_s), max(attach_s)
    print(f"  attach time grows {attach_s[large] / attach_s[small]:.2f}x from {small} to {large} "
          "GiB (goal < 2x)")
    print("  through vLLM's Engram + the plugin: _allocate_weights to ready rows")
    print("  vLLM     table     attached     cold (create + vLLM's loader)   cold / attached")
    for version, size, got in sorted(rows):
        if isinstance(got, str):
            print(f"  {version:8} {size / 2**30:5.2f} GiB  not measured: {got}")
            continue
        p_attach, p_cold = got
        cold = ("not measured (no room beside the service)", "") if p_cold is None else \
            (f"{p_cold:8.3f} s", f"{p_cold / p_attach:,.0f}x")
        print(f"  {version:8} {size / 2**30:5.2f} GiB  {p_attach * 1e3:8.3f} ms  {cold[0]:>30}   "
              f"{cold[1]:>10}")
