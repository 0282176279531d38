"""The main job on a default table (``numa-engram demo``): a synthetic
safetensors checkpoint, DP replicas in real processes over gloo sharing one
placed copy, lookups checked bit-exact, placement and memory reported."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import numpy as np

LAYER_MATCH = "numa-engram-"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(rank: int, procs: int, port: int, spec_doc: dict, ckpt: str, directory: str,
             tokens: int, policy: str, conn, show_progress: bool = False) -> None:
    # the parent stops us with SIGTERM when it is stopped: unwind, so a table
    # being created is removed on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import torch
    import torch.distributed as dist

    from ..host.procfs import smaps
    from ..lookup.cpu import reference_lookup
    from ..model.hashing import ngram_hashes
    from ..model.sharding import shard_heads
    from ..model.spec import EngramSpec
    from ..progress import terminal_bar
    from ..sharing.group import TorchGroup
    from ..sharing.table import SharedEngramTable

    result: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=procs, timeout=timedelta(seconds=300))
        spec = EngramSpec.from_dict(spec_doc)
        tables = {}
        t0 = time.perf_counter()
        for layer in spec.layer_ids:
            shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
            tables[layer] = SharedEngramTable.create(
                spec, layer, shard, group=TorchGroup(None, 300) if procs > 1 else None,
                mode="auto", checkpoint=ckpt, directory=directory, placement=policy,
                lookup_threads=max(1, (os.cpu_count() or 1) // procs),
                progress=terminal_bar(f"load layer {layer}")
                if show_progress and rank == 0 else None)
        result["create_s"] = time.perf_counter() - t0
        ids_tok = np.random.default_rng(rank).integers(0, spec.compressed_vocab_size, tokens)
        exact, rate = True, []
        for layer, table in tables.items():
            ids = ngram_hashes(spec, ids_tok, layer)
            out = table.lookup(ids)
            t1 = time.perf_counter()
            table.lookup(ids, out=out)
            rate.append(ids.size / (time.perf_counter() - t1))
            sample = slice(0, min(256, tokens))
            want = reference_lookup(table.weights, table.scales, ids[sample], head_start=0,
                                    bucket_sizes=spec.bucket_sizes(layer))
            exact &= torch.equal(out[sample].view(torch.int16), want.view(torch.int16))
        if procs > 1:
            dist.barrier()
        memory = smaps("self", LAYER_MATCH)
        result.update(exact=bool(exact), rows_per_s=float(np.mean(rate)),
                      pss_rss=(memory.pss, memory.rss),
                      modes=[t.mode_report() for t in tables.values()],
                      placement=[_placement_dict(t) for t in tables.values()],
                      ok=True)
        if procs > 1:
            dist.barrier()
        for t in tables.values():
            t.close()
    except Exception as exc:  # report to the parent instead of hanging it
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    conn.send(json.dumps(result, default=str))
    conn.close()
    os._exit(0)


def run_demo(spec_name: str = "small", procs: int = 2, directory: str = "/dev/shm",
             tokens: int = 4096, policy: str = "gpu-local", show_progress: bool = False) -> dict:
    from ..model.spec import EngramSpec
    from ..sharing.checkpoint import write_synthetic_checkpoint

    spec = EngramSpec.named(spec_name)
    with tempfile.TemporaryDirectory(prefix="numa-engram-demo-") as tmp:
        ckpt = str(write_synthetic_checkpoint(os.path.join(tmp, "engram.safetensors"), spec))
        ctx = mp.get_context("spawn")
        port = _free_port()
        pipes = [ctx.Pipe(duplex=False) for _ in range(procs)]
        workers = [ctx.Process(target=_replica, args=(r, procs, port, spec.to_dict(), ckpt,
                                                      directory, tokens, policy, pipes[r][1],
                                                      show_progress))
                   for r in range(procs)]
        try:
            for w in workers:
                w.start()
            for _, child in pipes:
                child.close()
            results = _collect(pipes)
        finally:  # also when this process is interrupted: stop the replicas it started
            for w in workers:
                if w.pid is not None:
                    w.join(10 if not sys.exc_info()[0] else 0)
                    if w.is_alive():
                        w.terminate()
                        w.join()
    return _summarise(spec, procs, results)


def _placement_dict(table: Any) -> dict | None:
    report = table.placement_report()
    return None if report is None else report.to_dict()


def _collect(pipes) -> list[dict]:
    results = []
    for r, (parent, _) in enumerate(pipes):
        try:
            results.append(json.loads(parent.recv()) if parent.poll(600) else
                           {"rank": r, "ok": False, "error": "no answer in 600 s"})
        except EOFError:
            results.append({"rank": r, "ok": False, "error": "replica died"})
    return results


def _summarise(spec, procs: int, results: list[dict]) -> dict:
    from ..units import fmt_bytes, node_list, unit_for

    ok = all(r.get("ok") for r in results)
    unit = unit_for(spec.table_bytes())
    lines = [f"Engram demo: {len(spec.layer_ids)} layers x {spec.n_hash_cols} heads x "
             f"{spec.head_dim} dims, {fmt_bytes(spec.table_bytes(), unit)} of FP8 rows, "
             f"{procs} DP replicas"]
    for r in results:
        if not r.get("ok"):
            lines.append(f"  replica {r['rank']}: FAILED {r.get('error')}")
            continue
        mode = r["modes"][0]
        frac = min(p["fraction_on_plan"] for p in r["placement"])
        nodes = r["placement"][0]["bytes_per_node"]
        lines.append(f"  replica {r['rank']}: mode {mode['mode']} (group "
                     f"{node_list(mode['sharing_group'])}), created+loaded in "
                     f"{r['create_s']:.2f} s, on nodes " + ", ".join(
                         f"{n}: {fmt_bytes(b, unit)}" for n, b in nodes.items())
                     + f", {frac:.0%} on plan, lookups {r['rows_per_s'] / 1e6:.2f} M rows/s, "
                     f"bit-exact {r['exact']}, table PSS {fmt_bytes(r['pss_rss'][0], unit)}")
    if ok:
        pss = sum(r["pss_rss"][0] for r in results)
        one_copy = sum(m["backing_bytes"] for m in results[0]["modes"])
        lines.append(f"  sum of PSS over replicas: {fmt_bytes(pss, unit)} = "
                     f"{pss / one_copy:.2f} copies of the table files")
        ok = all(r["exact"] for r in results)
    return {"ok": ok, "replicas": results, "text": "\n".join(lines)}


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on a default table: write a synthetic checkpoint, start
    --procs DP replicas over gloo that share one placed copy, look rows up,
    check them bit-exact, and show placement and memory."""
    from .. import progress
    from .args import emit

    doc = run_demo(spec_name=args.spec, procs=args.procs, directory=args.directory,
                   tokens=args.tokens, policy=args.policy,
                   show_progress=progress.wanted(args.json))
    emit(args, doc, doc["text"])
    return 0 if doc["ok"] else 1
