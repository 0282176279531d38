#!/usr/bin/env python3
"""GPU check for a machine with an NVIDIA GPU (one run, < 5 minutes).

On one GPU, a registered table (default 16 GiB), each number beside a
baseline measured in the same run:
  (a) the fused Triton lookup: rows/s and GB/s of FP8 rows read;
  (b) the old torch path (index_select + dequant, ~19 kernels);
  (c) a host-to-device copy of as many bytes (copy engine);
  (d) the fused lookup with the SM cap (background: half the SMs) on a side
      stream while a matmul loop runs on the main stream: the matmuls'
      slowdown and the exposed wait;
  (e) CUDA graph capture of a lookup and replays with new ids each time;
every result bit-exact against the CPU kernel; cudaHostRegister seconds per
GiB; a Qwen4-Exp PLE shard's GPU row gather beside a copy of as many
bytes; tests/test_cuda.py run on the GPU.  Writes everything as JSON to --out.

    python tools/gpu_check.py --out gpu_check.json [--table-gib 16] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fill(table, rng) -> None:
    """Random FP8 rows at memory speed: one random block, copied over."""
    block_w = rng.integers(0, 256, (1 << 18, table.weights.shape[1]), dtype=np.uint8)
    block_s = rng.integers(100, 150, (1 << 18, table.scales.shape[1]), dtype=np.uint8)
    for start in range(0, table.weights.shape[0], 1 << 18):
        end = min(table.weights.shape[0], start + (1 << 18))
        table.weights[start:end] = block_w[: end - start]
        table.scales[start:end] = block_s[: end - start]


def timed(fn, n: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def copy_seconds(nbytes: int) -> float:
    """One host-to-device copy of ``nbytes`` from pinned memory (the copy
    engine: the baseline a lookup's bytes are measured against)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return timed(lambda: dst.copy_(host, non_blocking=True))


def rotating(sets: list):
    """What gives the next of ``sets`` at each call, round and round (no
    call finds the rows the last one read)."""
    turn = [0]

    def next_set():
        turn[0] += 1
        return sets[turn[0] % len(sets)]
    return next_set


def same(a, b) -> bool:
    import torch

    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def main() -> int:
    import torch

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads
    from numa_engram.bindings import cudart as cuda
    from numa_engram.lookup.prefetch import PrefetchScheduler

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--table-gib", type=float, default=16.0)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vllm-cache", default=None,
                   help="vLLM 0.31.0's files as tests/support/vllm_harness.py caches them "
                        "(carry it to a machine without network); default its cache directory")
    a = p.parse_args()
    doc: dict = {"ok": False}

    def write() -> None:
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(doc, fh, indent=2)

    ok, why = cuda.available()
    if not ok or not torch.cuda.is_available():
        doc["error"] = f"no usable GPU: {why or 'torch has no CUDA'}"
        print(f"gpu_check: {doc['error']}")
        write()
        return 2
    dev = 0
    props = torch.cuda.get_device_properties(dev)
    doc.update(device=props.name, sms=props.multi_processor_count, torch=torch.__version__)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    per_head = int(a.table_gib * 2**30) // 264 // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    t0 = time.perf_counter()
    table = SharedEngramTable.create(spec, 1, shard, register_device=dev)
    create_s = time.perf_counter() - t0
    fill(table, np.random.default_rng(0))
    gib = table.backing_bytes / 2**30
    reg_s = table.registration.seconds
    doc.update(table_gib=gib, create_s=create_s, register_s_per_gib=reg_s / gib)
    print(f"table {gib:.2f} GiB: create+place {create_s:.1f} s, cudaHostRegister "
          f"{reg_s / gib:.3f} s/GiB")
    write()

    rng = np.random.default_rng(1)
    id_sets = [np.stack([rng.integers(-1, b, a.tokens) for b in spec.bucket_sizes(1)], 1)
               for _ in range(8)]  # rotated so no call finds the rows the last one read
    dev_sets = [torch.from_numpy(x).cuda() for x in id_sets]
    refs = [table.lookup(x) for x in id_sets[:2]]
    out = torch.empty((a.tokens, 24, 256), dtype=torch.bfloat16, device="cuda")
    fused = table.lookup_cuda(dev_sets[0])
    view = table.device_view()
    exact = {"fused": same(fused, refs[0]), "torch": same(view.lookup_torch(dev_sets[0]),
                                                          refs[0])}
    packed_w, packed_s = table.lookup_cuda(dev_sets[1], packed=True)
    from numa_engram.model.fp8 import dequantize_rows

    exact["packed"] = same(dequantize_rows(packed_w.reshape(-1, 256), packed_s.reshape(-1, 8))
                           .view(a.tokens, 24, 256), refs[1])
    print(f"bit-exact vs the CPU kernel: {exact}")

    fp8_bytes = id_sets[0].size * 264
    next_ids = rotating(dev_sets)
    t_copy = copy_seconds(fp8_bytes)
    t_fused = timed(lambda: table.lookup_cuda(next_ids(), out=out))
    t_torch = timed(lambda: view.lookup_torch(next_ids()), 3)
    rows = id_sets[0].size
    for name, t in (("H2D copy (copy engine)", t_copy), ("fused Triton lookup", t_fused),
                    ("torch path", t_torch)):
        print(f"  {name:<24}: {rows / t / 1e6:8.1f} M rows/s, {fp8_bytes / t / 1e9:6.2f} GB/s "
              f"({t_copy / t:.2f} of the copy)")
    doc.update(rows=rows, copy_gbs=fp8_bytes / t_copy / 1e9, fused_gbs=fp8_bytes / t_fused / 1e9,
               torch_gbs=fp8_bytes / t_torch / 1e9, fused_rows_per_s=rows / t_fused,
               fused_vs_torch=t_torch / t_fused)
    write()

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls(n=4):
        for _ in range(n):
            x @ x
    t_alone = timed(matmuls, 5)
    with PrefetchScheduler({1: table}, {1: (24, 256)}, max_tokens=a.tokens, backend="cuda",
                           background=True) as sched:
        def step():
            sched.submit(1, next_ids())
            matmuls()
            sched.wait(1)
        t_step = timed(step, 5)
        report = sched.metrics_report()
    layer = report["1"]
    print(f"4 matmuls alone {t_alone * 1e3:.2f} ms; with a background lookup on the side "
          f"stream {t_step * 1e3:.2f} ms ({t_step / t_alone:.3f}x); exposed wait "
          f"{layer['mean_exposed_s'] * 1e3:.3f} ms, lookup {layer['mean_lookup_s'] * 1e3:.3f} ms")
    doc.update(matmul_ms=t_alone * 1e3, matmul_with_lookup_ms=t_step * 1e3,
               matmul_slowdown=t_step / t_alone, prefetch=report["1"])
    write()

    static_ids = dev_sets[0].clone()
    graph_out = torch.empty_like(out)
    table.lookup_cuda(static_ids, out=graph_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.lookup_cuda(static_ids, out=graph_out)
    replays_exact = True
    for k in range(3):
        static_ids.copy_(dev_sets[k + 2])
        graph.replay()
        torch.cuda.synchronize()
        replays_exact &= same(graph_out, table.lookup(id_sets[k + 2]))
    t_graph = timed(lambda: graph.replay())
    table.check_device_errors()
    doc.update(graph_replays_exact=replays_exact, graph_gbs=fp8_bytes / t_graph / 1e9)
    print(f"graph capture + 3 replays with new ids: bit-exact {replays_exact}, "
          f"{fp8_bytes / t_graph / 1e9:.2f} GB/s")
    table.close()
    doc["exact"] = exact
    doc["runtime"] = runtime_check()
    print(f"EngramRuntime device=0 vs the CPU runtime: {doc['runtime']}")
    doc["ple"] = ple_check()
    print(f"PLE rows on the device: {doc['ple']}")
    doc["vllm_plugin"] = plugin_check(a.vllm_cache)
    print(f"vLLM plugin on the device: {doc['vllm_plugin']}")
    doc["cuda_tests"] = cuda_tests_check()
    print(f"tests/test_cuda.py on this GPU: {doc['cuda_tests']}")
    doc["ok"] = all(exact.values()) and replays_exact and doc["runtime"]["exact"] and \
        doc["ple"]["exact"] and doc["ple"]["bad_id_recorded"] and \
        doc["vllm_plugin"].get("exact", True) and doc["cuda_tests"]["returncode"] == 0
    write()
    return 0 if doc["ok"] else 1


def runtime_check(steps: int = 8) -> dict:
    """EngramRuntime with device=0 against the CPU runtime on a synthetic
    model directory: the same rows, bit for bit, for prefill and decode
    steps; the mean step (begin_step + every embed) of each."""
    import tempfile

    import torch

    from numa_engram import EngramRuntime, EngramSpec, write_synthetic_model

    spec = EngramSpec.small(rows_per_head=50_000, n_head_per_ngram=8, head_dim=256,
                            max_ngram_size=4)
    rng = np.random.default_rng(5)
    requests, prompt = 16, 64
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic_model(tmp, spec)
        cpu = EngramRuntime.from_pretrained(model, max_tokens=2048, max_requests=requests)
        gpu = EngramRuntime.from_pretrained(model, max_tokens=2048, max_requests=requests,
                                            device=0)
        exact, seconds = True, {"cpu": 0.0, "gpu": 0.0}
        with cpu, gpu:
            for n in range(steps):
                if n == 0:  # prefill: every request's prompt
                    slots = np.repeat(np.arange(requests), prompt)
                    positions = np.tile(np.arange(prompt), requests)
                else:  # decode: one token per request
                    slots = np.arange(requests)
                    positions = np.full(requests, prompt - 1 + n)
                ids = rng.integers(0, spec.compressed_vocab_size - 1, len(slots))
                want = []
                for name, rt in (("cpu", cpu), ("gpu", gpu)):
                    t0 = time.perf_counter()
                    rt.begin_step(ids, slots, positions)
                    rows = [rt.embed(layer) for layer in rt.layer_ids]
                    torch.cuda.synchronize()
                    seconds[name] += time.perf_counter() - t0
                    if name == "cpu":
                        want = [r.clone() for r in rows]
                    else:
                        exact &= all(same(g, w) for g, w in zip(rows, want))
    return {"exact": bool(exact), "cpu_step_ms": seconds["cpu"] / steps * 1e3,
            "gpu_step_ms": seconds["gpu"] / steps * 1e3}


def ple_check(gib: float = 2.0, tokens: int = 8192) -> dict:
    """A registered Qwen4-Exp PLE shard (FP8, 160-byte rows, ETP rank 1 of
    2): the Triton row gather against the CPU lookup, bit for bit, BF16 and
    packed, its rate beside a host-to-device copy of as many bytes, and the
    device error record for an id past the layer."""
    import torch

    from numa_engram.errors import LookupIdError
    from numa_engram.model.ple import PLESpec
    from numa_engram.tables.pletable import SharedPLETable

    base = int(gib * 2**30) // 160 // 16
    spec = PLESpec(layer_ids=[1], ple_embed_dim=2560, vocab_size=151_936, eos_token_id=2,
                   ngram_vocab_size_base=base)
    table = SharedPLETable.create(spec, 1, mode="independent", register_device=0)
    with table:
        table.weights[:] = np.random.default_rng(3).integers(0, 256, table.weights.shape,
                                                             dtype=np.uint8)
        rng = np.random.default_rng(4)
        id_sets = [rng.integers(0, spec.rows(1), (tokens, spec.n_heads)) for _ in range(8)]
        dev_sets = [torch.from_numpy(x).cuda() for x in id_sets]
        exact = same(table.lookup_cuda(dev_sets[0]), table.lookup(id_sets[0])) and \
            np.array_equal(table.lookup_cuda(dev_sets[1], packed=True).cpu().numpy(),
                           table.lookup_packed(id_sets[1]))
        nbytes = id_sets[0].size * spec.row_bytes
        out = torch.empty((tokens, spec.n_heads, spec.head_dim), dtype=torch.bfloat16,
                          device="cuda")
        next_ids = rotating(dev_sets)
        t_copy = copy_seconds(nbytes)
        t_rows = timed(lambda: table.lookup_cuda(next_ids(), out=out))
        bad = dev_sets[0].clone()
        bad[5, 2] = spec.rows(1)
        table.lookup_cuda(bad)
        try:
            table.device_rows().check_errors()
            recorded = False
        except LookupIdError:
            recorded = True
    return {"exact": bool(exact), "bad_id_recorded": recorded,
            "table_gib": table.backing_bytes / 2**30, "rows": id_sets[0].size,
            "rows_gbs": nbytes / t_rows / 1e9, "copy_gbs": nbytes / t_copy / 1e9,
            "of_the_copy": t_copy / t_rows}


def cuda_tests_check() -> dict:
    """tests/test_cuda.py on this GPU, in a process of its own (registration,
    UVA lookups, graph replays, tier mapped's pinned staging to the device):
    its exit status and summary lines (a skip names why)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_cuda.py"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode,
            "summary": [line for line in lines if "SKIPPED" in line or "FAILED" in line] +
            lines[-1:]}


def plugin_check(cache: str | None) -> dict:
    """The vLLM plugin's device checks, with vLLM 0.31.0's own Engram
    modules (the wheel's, under the test stubs; its lookup kernel compiled
    for this GPU): per page size, a private table (memfd) and one attached
    read-only from a table service (its registration read-only), the
    parameters pinned (``is_pinned()``), vLLM's kernel over our views
    bit-exact with our CPU lookup, and attach + register seconds per GiB."""
    import tempfile

    import torch

    os.environ["TRITON_INTERPRET"] = "0"  # vLLM's kernel compiled, not interpreted
    if cache:
        os.environ["NUMA_ENGRAM_VLLM_CACHE"] = cache
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from numa_engram import EngramSpec, write_synthetic_model
    from numa_engram.host.hugepages import pool_pages
    from numa_engram.integrations.vllm import patch
    from numa_engram.runtime.modeldir import ModelDirectory
    from numa_engram.service.tableservice import TableService
    from tests.support import vllm_harness as harness

    root, why = harness.wheel_sources()
    if root is None:
        return {"skipped": why}
    nv, common = harness.vllm_modules(root)
    patch(nv, common)
    spec = EngramSpec.small(rows_per_head=200_000, n_head_per_ngram=8, head_dim=256,
                            max_ngram_size=4)
    out: dict = {"exact": True}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_synthetic_model(os.path.join(tmp, "m"), spec))
        layout = harness.layout_of(common, model)
        layer = layout.layer_ids[0]
        rng = np.random.default_rng(9)
        sizes = np.asarray(spec.bucket_sizes(layer))
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        ids = base + rng.integers(0, 1 << 40, (4096, len(sizes))) % sizes
        for page in ("4K", "2M"):
            if page == "2M" and pool_pages(2 << 20) * (2 << 20) < 2 * spec.table_bytes():
                out[page] = {"skipped": "no free 2M huge pages for the tables"}
                continue
            one: dict = {}
            harness.State.config = harness.config(model, additional={"page_size": page})
            emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
            harness.load_checkpoint(emb, model, layer)
            one["pinned"] = bool(emb.weight.is_pinned() and emb.weight_scale_inv.is_pinned())
            got = emb(torch.from_numpy(ids).cuda()).cpu()
            want = emb.numa_table.lookup(ids, id_format="global")
            one["exact_private"] = same(got, want)
            emb.numa_table.close()
            service = TableService(ModelDirectory.open(model), os.path.join(tmp, "s.sock"),
                                   page_size=page)
            service.start()
            service.load_all()
            try:
                harness.State.config = harness.config(
                    model, additional={"page_size": page, "service": service.socket_path})
                t0 = time.perf_counter()
                emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
                emb._storage()
                seconds = time.perf_counter() - t0
                table = emb.numa_table
                one["attach_register_s_per_gib"] = seconds / (table.backing_bytes / 2**30)
                # registered as the mapping is: read-only (cudaHostRegisterReadOnly)
                one["registered_read_only"] = table.registration is not None and \
                    not table._backing.mapping.writable
                one["exact_attached"] = same(emb(torch.from_numpy(ids).cuda()).cpu(), want)
                table.close()
            finally:
                service.stop()
            out[page] = one
            out["exact"] &= one["exact_private"] and one["exact_attached"] and one["pinned"]
    return out


if __name__ == "__main__":
    sys.exit(main())
