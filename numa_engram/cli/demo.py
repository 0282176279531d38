"""The main job (``numa-engram demo``): a model directory (a synthetic one
as DeepSeek ships it, or ``--model DIR``) served by ``EngramRuntime`` in DP
replicas, real processes over gloo sharing one placed copy per layer.
Each replica runs prefill chunks, decode steps, an image span and a request
resumed by ``restore``; every step's rows are checked bit-exact against the
plain route (whole sequences hashed, rows read from the checkpoint files
and dequantised by the reference); the memory proof and the startup phases
are reported."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Any

import numpy as np

from ..literals import DEFAULT_DIRECTORY
from .args import POLICY_HELP, positive_int

LAYER_MATCH = "numa-engram-"
MAX_TOKENS = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- stream --

def demo_requests(vocab: int, image_id: int | None, seed: int) -> list[dict]:
    """Three requests: a long prompt in prefill chunks, a prompt with an
    image span, and one resumed at position 48 (a prefix-cache hit: its
    first 48 tokens were processed elsewhere)."""
    rng = np.random.default_rng(seed)

    def words(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, vocab, size=n)]
    with_image = words(40)
    if image_id is not None:
        with_image[10:16] = [image_id] * 6
    return [{"seq": words(112), "chunks": [32, 32, 32], "start": 0},
            {"seq": with_image + words(12), "chunks": [20, 20], "start": 0},
            {"seq": words(64), "chunks": [8], "start": 48}]


def demo_steps(requests: list[dict], steps: int) -> list[dict]:
    """Packed steps: each live request's next prefill chunk, else one
    decode token; requests interleaved."""
    cursor = [r["start"] for r in requests]
    chunk = [0] * len(requests)
    out = []
    for _ in range(steps):
        ids, slots, positions = [], [], []
        for slot, req in enumerate(requests):
            if cursor[slot] >= len(req["seq"]):
                continue
            n = req["chunks"][chunk[slot]] if chunk[slot] < len(req["chunks"]) else 1
            chunk[slot] += 1
            end = min(len(req["seq"]), cursor[slot] + n)
            ids += req["seq"][cursor[slot]:end]
            slots += [slot] * (end - cursor[slot])
            positions += list(range(cursor[slot], end))
            cursor[slot] = end
        out.append({"ids": ids, "slots": slots, "positions": positions})
    return out


class CheckpointRows:
    """Rows of a layer's tensors read straight from the checkpoint files
    (a read-only memory map at each tensor's offset): the reference the
    loaded tables are checked against."""

    def __init__(self, model_dir: str, spec: Any, layer: int) -> None:
        from ..checkpoints.checkpoint import resolve

        plan = resolve(model_dir, spec, layer)
        self.weights = np.memmap(plan.weights.path, np.uint8, "r", plan.weights.data_offset,
                                 (spec.rows(layer), spec.head_dim))
        self.scales = np.memmap(plan.scales.path, np.uint8, "r", plan.scales.data_offset,
                                (spec.rows(layer), spec.scales_per_row))

    def dequantized(self, rows: np.ndarray, block: int) -> Any:
        from ..model.fp8 import dequantize_rows

        flat = rows.reshape(-1)
        out = dequantize_rows(np.ascontiguousarray(self.weights[flat]),
                              np.ascontiguousarray(self.scales[flat]), block)
        return out.reshape(*rows.shape, -1)


def reference_embeddings(model: Any, checkpoint: dict, requests: list[dict]) -> dict:
    """Per layer and request: BF16 rows of every position of the whole
    sequence (hashed in one go with the DEAD rule, global rows)."""
    from ..model.hashing import sequence_hashes

    spec, dead = model.spec, set(model.dead_ids)
    out: dict = {}
    for layer in spec.layer_ids:
        out[layer] = []
        for req in requests:
            ids = [-1 if t in dead else int(model.token_map[t]) for t in req["seq"]]
            rows = sequence_hashes(spec, ids, layer) + spec.head_offsets(layer)
            out[layer].append(checkpoint[layer].dequantized(rows, spec.block))
    return out


# --------------------------------------------------------------- replica --

def _replica(rank: int, procs: int, port: int, model_dir: str, directory: str, policy: str,
             steps: int, conn: Any) -> None:
    # the parent stops us with SIGTERM when it is stopped: unwind, so a table
    # being created is removed on the way out
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    import torch
    import torch.distributed as dist

    from ..host.procfs import smaps
    from ..runtime.engramruntime import EngramRuntime

    result: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=procs, timeout=timedelta(seconds=300))
        rt = EngramRuntime.from_pretrained(model_dir, sharing="auto", placement=policy,
                                           directory=directory, max_tokens=MAX_TOKENS,
                                           max_requests=4)
        spec, model = rt.spec, rt.model
        requests = demo_requests(len(model.token_map), (model.dead_ids or (None,))[0], rank)
        checkpoint = {layer: CheckpointRows(model_dir, spec, layer) for layer in spec.layer_ids}
        want = reference_embeddings(model, checkpoint, requests)
        for slot, req in enumerate(requests):
            if req["start"]:  # resumed: the runner's look-back window before its start
                rt.restore(slot, req["start"], req["seq"][req["start"] - 8:req["start"]])
        exact, tokens = True, 0
        for step in demo_steps(requests, steps):
            rt.begin_step(step["ids"], step["slots"], step["positions"])
            tokens += len(step["ids"])
            for layer in spec.layer_ids:
                got = rt.embed(layer)
                ref = torch.stack([want[layer][s][p] for s, p in
                                   zip(step["slots"], step["positions"])]) if step["ids"] \
                    else got[:0]
                exact &= torch.equal(got.view(torch.int16), ref.view(torch.int16))
        dist.barrier()
        memory = smaps("self", LAYER_MATCH)
        report, stats = rt.mode_report(), rt.stats()
        result.update(exact=bool(exact), tokens=tokens, steps=stats["steps"],
                      pss_rss=(memory.pss, memory.rss), report=report,
                      lookup_s=sum(v["table"]["lookup_seconds"]
                                   for v in stats["layers"].values()), ok=True)
        dist.barrier()
        rt.close()
    except Exception as exc:  # report to the parent instead of hanging it
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    conn.send(json.dumps(result, default=str))
    conn.close()
    os._exit(0)


def run_demo(model_dir: str | None = None, spec_name: str = "small", procs: int = 2,
             directory: str = DEFAULT_DIRECTORY, policy: str = "gpu-local",
             steps: int = 12) -> dict:
    """Serve ``model_dir`` (None: a synthetic model of spec ``spec_name``)
    in ``procs`` DP replicas; the per-replica results and a summary."""
    from ..model.spec import EngramSpec
    from ..runtime.modeldir import write_synthetic_model

    with tempfile.TemporaryDirectory(prefix="engram-demo-") as tmp:
        if model_dir is None:
            model_dir = str(write_synthetic_model(os.path.join(tmp, "model"),
                                                  EngramSpec.named(spec_name)))
        ctx = mp.get_context("spawn")
        port = _free_port()
        pipes = [ctx.Pipe(duplex=False) for _ in range(procs)]
        workers = [ctx.Process(target=_replica, args=(r, procs, port, model_dir, directory,
                                                      policy, steps, pipes[r][1]))
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
    return _summarise(model_dir, procs, results)


def _collect(pipes: list) -> list[dict]:
    results = []
    for r, (parent, _) in enumerate(pipes):
        try:
            results.append(json.loads(parent.recv()) if parent.poll(600) else
                           {"rank": r, "ok": False, "error": "no answer in 600 s"})
        except EOFError:
            results.append({"rank": r, "ok": False, "error": "replica died"})
    return results


def _phases(startup: dict) -> str:
    shown = [k for k in ("read", "checks", "create", "populate", "map", "register", "load")
             if k in startup]
    return ", ".join(f"{k} {startup[k]:.2f}" for k in shown)


def _summarise(model_dir: str, procs: int, results: list[dict]) -> dict:
    from ..units import fmt_bytes, unit_for

    ok = all(r.get("ok") for r in results)
    good = [r for r in results if r.get("ok")]
    lines = [f"Engram demo: {procs} DP replicas serving {model_dir} through EngramRuntime"]
    if good:
        layers = good[0]["report"]["layers"]
        total = sum(v["backing_bytes"] for v in layers.values())
        unit = unit_for(total)
        lines[0] += (f" ({len(layers)} Engram layers, {fmt_bytes(total, unit)} of table files "
                     "per copy)")
    for r in results:
        if not r.get("ok"):
            lines.append(f"  replica {r['rank']}: FAILED {r.get('error')}")
            continue
        rep = r["report"]
        first = next(iter(rep["layers"].values()))
        placement = first.get("placement") or {}
        frac = placement.get("fraction_on_plan")
        lines.append(
            f"  replica {r['rank']}: mode {rep['mode']} (sharing group: ranks "
            f"{first['sharing_group']}), startup {rep['startup_s']['total']:.2f} s "
            f"({_phases(rep['startup_s'])}); {r['steps']} steps, {r['tokens']} tokens (prefill "
            f"chunks, decode steps, an image span, a restored request), rows bit-exact "
            f"{r['exact']}" + ("" if frac is None else f", {frac:.0%} on plan")
            + f", table PSS {fmt_bytes(r['pss_rss'][0], unit)}")
    if ok:
        pss = sum(r["pss_rss"][0] for r in results)
        lines.append(f"  sum of PSS over replicas: {fmt_bytes(pss, unit)} = "
                     f"{pss / total:.2f} copies of the table files")
        ok = all(r["exact"] for r in results)
        lines.append("  proved: every replica's rows equal the checkpoint's through the plain "
                     "route" if ok else "  FAILED: rows differ from the reference")
    return {"ok": ok, "replicas": results, "text": "\n".join(lines)}


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: serve a model directory (--model, or a synthetic one)
    in --procs DP replicas through EngramRuntime, check every step's rows
    bit-exact, and show sharing, placement, memory and startup phases."""
    from .args import emit

    doc = run_demo(model_dir=args.model, spec_name=args.spec, procs=args.procs,
                   directory=args.directory, policy=args.policy, steps=args.steps)
    emit(args, doc, doc["text"])
    return 0 if doc["ok"] else 1


HELP = ("serve a model directory through EngramRuntime in DP replicas "
        "sharing placed tables, rows checked")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram demo``'s arguments."""
    sp.add_argument("--model", default=None,
                    help="a model directory (config.json, tokenizer.json, safetensors); "
                    "default: a synthetic one of --spec")
    sp.add_argument("--spec", default="small",
                    help="the synthetic model's spec: demo, small, tiny or a JSON file")
    sp.add_argument("--procs", type=positive_int, default=2,
                    help="DP replicas sharing the tables")
    sp.add_argument("--steps", type=positive_int, default=12,
                    help="serving steps per replica")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY,
                    help="a tmpfs directory")
