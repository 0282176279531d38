"""EngramRuntime scenarios run by tests/support/dist_harness.py in each spawned rank."""

from types import SimpleNamespace

import torch.distributed as dist

from numa_engram import EngramRuntime, SharedEngramTable, shard_heads

from .runtime_plan import reference_rows, replica_plan, same_bits, sp_window

STEPS = 9


def tp_dp_groups(rank, tp, dp):
    """The stack's TP group and node-local EDP group of ``rank`` (TP-minor
    world ranks); every rank creates every group, in one order."""
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    edp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    return tp_groups[rank // tp], edp_groups[rank % tp]


def coordinator(pg, ranks):
    """What vLLM's GroupCoordinator shows of a group (its surface only)."""
    return SimpleNamespace(rank_in_group=dist.get_rank(pg), world_size=dist.get_world_size(pg),
                           cpu_group=pg, device_group=pg, ranks=list(ranks))


def serve(rank, world, *, model_dir, tp, sharing, sequence_parallel=False, give_edp=False,
          give_counts=False, as_coordinators=False):
    """Run the planned steps through EngramRuntime; compare every layer's
    rows of every step with the single-process reference."""
    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_group, edp_group = tp_dp_groups(rank, tp, dp)
    if as_coordinators:
        tp_group = coordinator(tp_group, [dp_rank * tp + t for t in range(tp)])
        edp_group = coordinator(edp_group, [d * tp + tp_rank for d in range(dp)])
    rt = EngramRuntime.from_pretrained(model_dir, tp_group=tp_group, sharing=sharing,
                                       edp_group=edp_group if give_edp else None,
                                       max_tokens=64, max_requests=6,
                                       sequence_parallel=sequence_parallel, timeout_s=60)
    spec, model = rt.spec, rt.model
    reference = {layer: SharedEngramTable.create(spec, layer, shard_heads(
        spec.bucket_sizes(layer), 1, 0), checkpoint=model_dir, mode="independent")
        for layer in spec.layer_ids}
    vocab, image = len(model.token_map), model.dead_ids[0]
    plans = [replica_plan(1000 + d, STEPS, vocab, image) for d in range(dp)]
    mismatches, tokens, idle = [], 0, 0
    for n, step in enumerate(plans[dp_rank]):
        for slot in step.releases:
            rt.release(slot)
        for slot, position, prefix in step.restores:
            rt.restore(slot, position, prefix)
        counts = [len(p[n].ids) for p in plans] if give_counts else None
        rt.begin_step(step.ids, step.slots, step.positions, commit=step.commit_array(),
                      counts=counts)
        tokens += len(step.ids)
        idle += not step.ids
        for layer in spec.layer_ids:
            got = rt.embed(layer)
            want = reference_rows(model, reference, step, layer)
            if sequence_parallel:
                want = sp_window(want, tp, tp_rank)
            if not same_bits(got, want):
                mismatches.append((n, layer, list(got.shape), list(want.shape)))
    report = rt.mode_report()
    stats = rt.stats()
    rt.close()
    for table in reference.values():
        table.close()
    return {"mismatches": mismatches, "tokens": tokens, "idle_steps": idle,
            "restores": sum(len(s.restores) for s in plans[dp_rank]),
            "speculative": sum(not c for s in plans[dp_rank] for c in s.commit),
            "images": sum(t == image for s in plans[dp_rank] for t in s.ids),
            "mode": report["mode"], "embedding_dp_size": report["embedding_dp_size"],
            "edp_group": report["edp_group"],
            "heads": {str(k): v["tp_heads"] for k, v in report["layers"].items()},
            "sharing_group": report["layers"][spec.layer_ids[0]]["sharing_group"],
            "startup": sorted(report["startup_s"]), "steps": stats["steps"]}


def disagree(rank, world, *, model_dir):
    """TP ``world`` ranks that embed layers in different orders, then begin
    steps of different token counts, then agree: what each call raised,
    and whether the agreeing step's rows are the reference's."""
    tp_group = dist.new_group(list(range(world)))
    rt = EngramRuntime.from_pretrained(model_dir, tp_group=tp_group, sharing="independent",
                                       max_tokens=16, max_requests=2, timeout_s=60)
    spec = rt.spec
    raised = {}
    rt.begin_step([5, 6, 7], [0, 0, 0], [0, 1, 2])
    order = spec.layer_ids if rank == 0 else spec.layer_ids[::-1]
    for layer in order:
        try:
            rt.embed(layer)
            raised.setdefault("order", []).append(None)
        except Exception as exc:
            raised.setdefault("order", []).append(f"{type(exc).__name__}: {exc}")
    rt.release(0)
    n = 3 + rank  # one token more on each rank
    rt.begin_step(list(range(5, 5 + n)), [1] * n, list(range(n)))
    try:
        rt.embed(spec.layer_ids[0])
        raised["count"] = None
    except Exception as exc:
        raised["count"] = f"{type(exc).__name__}: {exc}"
    rt.release(1)
    reference = SharedEngramTable.create(spec, spec.layer_ids[0], shard_heads(
        spec.bucket_sizes(spec.layer_ids[0]), 1, 0), checkpoint=model_dir,
        mode="independent")
    ids = rt.begin_step([8, 9], [0, 0], [0, 1])
    got = rt.embed(spec.layer_ids[0])
    agreed = same_bits(got, reference.lookup(ids[:, 0], id_format="global"))
    rt.close()
    reference.close()
    return {"raised": raised, "agreed": agreed}
