#!/usr/bin/env python3
"""GPU check for a machine with an NVIDIA GPU (< 5 minutes).

Prints, each beside a baseline measured in the same run:
  - cudaHostRegister time per GiB of a placed table;
  - UVA (zero-copy) gather + dequant and the staged path (CPU kernel into
    pinned memory + async copy), bit-exact against the CPU reference, and
    their GB/s of FP8 rows next to a plain host-to-device copy of as many bytes;
  - exposed wait of the Engram lookup behind a synthetic matmul workload,
    with prefetch (submitted layers ahead) and without.
Writes the numbers as JSON to $OUT/gpu_check.json when $OUT is set.

    python tools/gpu_check.py [--table-gib 4] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from numa_engram import EngramSpec, SharedEngramTable, cuda, shard_heads
    from numa_engram.lookup import staged_lookup
    from numa_engram.prefetch import PrefetchScheduler

    p = argparse.ArgumentParser()
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=8192)
    a = p.parse_args()
    ok, why = cuda.available()
    if not ok or not torch.cuda.is_available():
        print(f"gpu_check: no usable GPU: {why or 'torch has no CUDA'}")
        return 2
    dev = 0
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")
    per_head = int(a.table_gib * 2**30) // 264 // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    doc: dict = {"device": props.name}

    t0 = time.perf_counter()
    table = SharedEngramTable.create(spec, 1, shard, register_device=dev)
    create_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    for start in range(0, shard.num_rows, 1 << 20):
        end = min(shard.num_rows, start + (1 << 20))
        table.weights[start:end] = rng.integers(0, 256, (end - start, 256), dtype=np.uint8)
        table.scales[start:end] = rng.integers(0, 256, (end - start, 8), dtype=np.uint8)
    gib = table.backing_bytes / 2**30
    reg_s = table.registration.seconds
    print(f"table {gib:.2f} GiB: create+place {create_s:.2f} s, cudaHostRegister {reg_s:.2f} s "
          f"= {reg_s / gib:.3f} s/GiB (vLLM on H200: ~0.1 s/GB)")
    doc.update(table_gib=gib, register_s_per_gib=reg_s / gib)

    ids_np = np.stack([rng.integers(-1, b, a.tokens) for b in spec.bucket_sizes(1)], 1)
    ids = torch.from_numpy(ids_np).cuda()
    ref = table.lookup(ids_np)
    uva = table.lookup_cuda(ids)
    pinned = torch.empty_like(ref).pin_memory()
    out = torch.empty_like(ref, device="cuda")
    staged = staged_lookup(table.weights, table.scales, ids_np, head_start=0,
                           bucket_sizes=spec.bucket_sizes(1), pinned=pinned, out=out, threads=4)
    torch.cuda.synchronize()
    exact_uva = torch.equal(uva.cpu().view(torch.int16), ref.view(torch.int16))
    exact_staged = torch.equal(staged.cpu().view(torch.int16), ref.view(torch.int16))
    print(f"bit-exact vs CPU reference: UVA {exact_uva}, staged {exact_staged}")

    fp8_bytes = ids_np.size * 264
    host = torch.empty(fp8_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(fp8_bytes, dtype=torch.uint8, device="cuda")

    def timed(fn, n=10):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    t_copy = timed(lambda: dst.copy_(host, non_blocking=True))
    t_uva = timed(lambda: table.lookup_cuda(ids, out=out, validate=False))
    t_staged = timed(lambda: staged_lookup(table.weights, table.scales, ids_np, head_start=0,
                                           bucket_sizes=spec.bucket_sizes(1), pinned=pinned,
                                           out=out, threads=4))
    for name, t in (("plain H2D copy", t_copy), ("UVA gather+dequant", t_uva),
                    ("staged CPU+H2D", t_staged)):
        print(f"  {name:<20}: {fp8_bytes / t / 1e9:7.2f} GB/s of FP8 rows "
              f"({t_copy / t:.2f} of the plain copy)")
    doc.update(exact_uva=exact_uva, exact_staged=exact_staged, copy_gbs=fp8_bytes / t_copy / 1e9,
               uva_gbs=fp8_bytes / t_uva / 1e9, staged_gbs=fp8_bytes / t_staged / 1e9)

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def layer():
        return x @ x

    with PrefetchScheduler({1: lambda i, o: table.lookup_cuda(i, out=o, validate=False)},
                           {1: (24, 256)}, max_tokens=a.tokens, backend="cuda") as s:
        def step(prefetch: bool):
            if prefetch:
                s.submit(1, ids)
            for _ in range(4):
                layer()
            if not prefetch:
                s.submit(1, ids)
            s.wait(1)
            layer()
        t_on = timed(lambda: step(True), 5)
        t_off = timed(lambda: step(False), 5)
        t_compute = timed(lambda: [layer() for _ in range(5)], 5)
    print(f"step with 5 matmul layers: compute alone {t_compute * 1e3:.2f} ms, with lookup: "
          f"prefetch on {t_on * 1e3:.2f} ms (exposed {max(0, t_on - t_compute) * 1e3:.2f} ms), "
          f"off {t_off * 1e3:.2f} ms (exposed {max(0, t_off - t_compute) * 1e3:.2f} ms)")
    doc.update(step_compute_ms=t_compute * 1e3, step_prefetch_on_ms=t_on * 1e3,
               step_prefetch_off_ms=t_off * 1e3)
    table.close()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0 if exact_uva and exact_staged else 1


if __name__ == "__main__":
    sys.exit(main())
