"""numa-engram plan: what one host of a deployment needs, under each policy:
bytes per node, copies, remote reads, page tables, whether it fits."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import CheckpointError, SpecError, TopologyError
from ..literals import SHARING_MODES
from ..userfiles import printable, read_regular
from .args import (
    MAX_PLAN_WORLD,
    POLICY_HELP,
    emit,
    load_topology,
    non_negative_int,
    page_size_arg,
    parse_size,
    positive_int,
    register_rates,
    simulate_arg,
)


def plan_spec(args: argparse.Namespace):
    """The spec: ``--model DIR`` (its config.json, and tokenizer when there),
    ``--spec`` a config.json or a named/JSON spec."""
    from ..model.families import family_of_config
    from ..model.spec import EngramSpec

    source = args.model or args.spec
    config = _config_doc(source, model=bool(args.model))
    if config is None:
        return EngramSpec.named(source)
    _, doc = config
    family = family_of_config(doc)
    if family.needs_token_map and os.path.isdir(source) and \
            os.path.lexists(os.path.join(source, "tokenizer.json")):
        return family.part("directory").open(source).spec  # the hashing spec
    return family.spec_of_config(doc)  # the sizes need no tokenizer


def _config_doc(source: str, model: bool) -> tuple[str, dict] | None:
    """(path, document) of a model's config.json: the one in the directory
    ``source``, or the file ``--spec`` names when it is one (each read as a
    regular file under a bound: a FIFO or device is refused by name); None
    for a named or JSON spec."""
    from ..model.families import has_tables
    from ..runtime.modeldir import CONFIG_FILE, read_config_file

    if os.path.isdir(source):
        path = os.path.join(source, CONFIG_FILE)
        return path, read_config_file(path)
    if model:
        raise CheckpointError(f"--model {printable(source)!r} does not exist or is not a "
                              "directory; pass the model directory holding config.json")
    if not os.path.lexists(source):
        return None  # a spec's name
    data = read_regular(source, "the spec file", error=SpecError)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None  # EngramSpec.named says it is not JSON
    return (source, doc) if has_tables(doc) else None


def cmd_plan(args: argparse.Namespace) -> int:
    """One host of TP x DP under a mode and policy: regions and where they
    go, bytes per node, remote reads, the other policies side by side, page
    tables per process and per host, memory per mode, what to provision,
    and whether it fits (exit 1 when not, with the commands that fix it)."""
    from ..model.sharding import WorldLayout
    from ..store.deployment import plan_deployment

    if args.tp * args.dp > MAX_PLAN_WORLD:
        raise TopologyError(f"--tp {args.tp} x --dp {args.dp} is {args.tp * args.dp} GPUs, above "
                            f"the {MAX_PLAN_WORLD} a plan lays out; plan the hosts one "
                            "deployment really has")
    spec, topo = plan_spec(args), load_topology(args.simulate)
    per_host = args.gpus_per_host or len(topo.gpus) or args.tp * args.dp
    world = WorldLayout(args.tp, args.dp, per_host)
    d = plan_deployment(spec, world, args.mode, args.policy, topo, args.page_size)
    if not args.simulate:
        _check_this_host(d, args.page_size)
    doc, text = _report(args, d, topo, _memory(args, topo))
    emit(args, doc, text)
    return 0 if d.fits else 1


def _check_this_host(d, page_size: int) -> None:
    """On the host itself: each node's free huge pages for tables on huge
    pages.  Tables on 4 KiB pages are memfds, shared ones too (handed over
    at a socket), so /dev/shm's size does not matter: their memory is the
    nodes', checked per node."""
    from ..host import hugepages
    from ..units import fmt_bytes

    if page_size == hugepages.SIZES["4K"]:
        return
    for node, need in d.chosen.bytes_per_node.items():
        free = hugepages.pool_pages(page_size, node) * page_size
        if need > free:
            d.shortfalls.append(f"node {node}'s {hugepages.name_of(page_size)} pool has "
                                f"{fmt_bytes(free)} free, the tables need {fmt_bytes(need)}")


def _memory(args: argparse.Namespace, topo) -> dict:
    """The memory budget and where it comes from (--memory-budget; a
    simulated host's nodes; else this host's cgroup limit or MemAvailable,
    the smaller), and /dev/shm's size on this host."""
    from ..host.accounting import host_memory

    if args.memory_budget:
        return {"budget": args.memory_budget, "source": "--memory-budget"}
    if args.simulate:
        total = sum(n.mem_total for n in topo.nodes)
        known = all(n.mem_total for n in topo.nodes)
        return {"budget": total if known else None, "source": "the simulated nodes' memory"}
    host = host_memory()
    limit = host.cgroup.limit if host.cgroup else None
    source = (f"the memory cgroup {printable(host.cgroup.path)}'s limit"
              if host.cgroup and limit == host.budget else "MemAvailable")
    return {"budget": host.budget, "source": source, "mem_available": host.available,
            "cgroup_limit": limit, "shm_bytes": host.shm_total}


def _tiers(args: argparse.Namespace, d, modes: dict, memory: dict) -> tuple[list, dict | None]:
    """Each mode's verdict: resident, mapped (its hit rate by --profile) or
    neither; the chosen mode's, when not resident, is a shortfall."""
    from ..store import accessprofile
    from ..store.deployment import tier_verdict
    from ..units import fmt_bytes

    profile = args.profile and accessprofile.load(
        read_regular(args.profile, "the profile", error=SpecError), printable(args.profile))

    def hit_rate(budget: int) -> float:
        # a budget holds the same fraction of the profiled table as of this one
        scale = profile["table_bytes"] / d.spec.table_bytes()
        return accessprofile.curve_fraction(profile["curve"], int(budget * scale))

    out = [tier_verdict(d.spec, m, hosts[min(hosts)], memory["budget"], args.batch,
                        hit_rate if profile else None) for m, hosts in modes.items()]
    for v in out:
        if v.mode == d.chosen.mode and v.tier not in ("resident", "unknown"):
            d.shortfalls.append(f"{fmt_bytes(v.resident_bytes)} of {v.mode} tables per host "
                                f"do not fit the memory budget, {fmt_bytes(v.budget or 0)} "
                                f"({memory['source']})")
            d.fixes.append(v.why if v.tier == "mapped" else
                           "a larger memory budget: the mapped tier needs at least one "
                           "step's pages")
    return out, profile or None


def _report(args: argparse.Namespace, d, topo, memory: dict) -> tuple[dict, str]:
    from ..store.deployment import REGION_LEGEND, mode_memory, recommendation
    from ..units import fmt_bytes, node_list, text_table, unit_for

    spec, world, chosen = d.spec, d.world, d.chosen
    unit = unit_for(*(r.length for r in d.regions), *chosen.bytes_per_node.values())
    copies = d.plan.copies  # replicate-per-node: a copy of each region on every node
    placed = (lambda _pr: f"a copy bound to each of nodes {node_list(topo.node_ids)}") \
        if copies > 1 else (lambda pr: f"{pr.memory_policy} {node_list(pr.nodes)}")
    rows = [[r.name, f"{r.length / unit[1]:.2f}", node_list(r.reader_nodes), placed(pr)]
            for r, pr in zip(d.regions, d.plan.ranges)]
    # each mode's memory under this policy (replicate-per-node multiplies a
    # shared copy; private copies and DP-sharded slices are never replicated)
    # (a mode this TP x DP cannot shard is left out: the plan's notes say why)
    modes = {}
    for m in SHARING_MODES:
        try:
            modes[m] = {h: b * (copies if m == "dp_shared" else 1)
                        for h, b in mode_memory(spec, m, world).per_host.items()}
        except TopologyError:
            if m == chosen.mode:
                raise
    tables = d.page_tables()
    processes = len(d.mapped_per_process)
    remote = ("unknown (first touch)" if chosen.remote_fraction is None
              else f"{chosen.remote_fraction:.1%}")
    per_node = ", ".join(f"node {n} {b / unit[1]:.2f} {unit[0]}"
                         for n, b in chosen.bytes_per_node.items()) or "decided by first touch"
    source = printable(args.model or args.spec)
    lines = [f"{source}: {len(spec.layer_ids)} layers, {spec.n_hash_cols} heads, "
             f"{fmt_bytes(spec.table_bytes())} in all; TP{world.tp} x DP{world.dp}, "
             f"{world.gpus_per_host} GPUs per host, mode {chosen.mode}, policy {chosen.policy}",
             text_table(["region", unit[0], "readers on nodes", "placed"], rows),
             REGION_LEGEND,
             f"bytes per NUMA node (one host): {per_node}; {chosen.copies:.2f} copies of the "
             f"tables, {fmt_bytes(chosen.host_bytes)}",
             f"expected fraction of remote row reads: {remote}"]
    lines += [f"note: {n}" for n in d.notes]
    lines.append("the same host under other choices:")
    lines.append(text_table(["mode", "policy", "memory per host", "copies", "remote reads"],
                            [[o.mode, o.policy, fmt_bytes(o.host_bytes), f"{o.copies:.2f}",
                              "unknown" if o.remote_fraction is None else
                              f"{o.remote_fraction:.1%}"]
                             for o in [chosen, *d.alternatives]], left=2))
    lines.append(recommendation(d))
    lines.append(f"page tables (last level) of {processes} processes mapping their shards: " +
                 "; ".join(f"{name} pages {fmt_bytes(t['per_process'])} per process, "
                           f"{fmt_bytes(t['per_host'])} per host" for name, t in tables.items()))
    for m, hosts in modes.items():
        lines.append(f"memory per host, {m:<12} under {chosen.policy}: " + ", ".join(
            f"host {h} {fmt_bytes(b)}" for h, b in hosts.items()))
    extra = _operator_numbers(args, d)
    lines += [f"{k}: {v['text']}" for k, v in extra.items()]
    tiers, profile = _tiers(args, d, modes, memory)
    lines.append(_memory_line(memory))
    if profile:
        lines.append(f"profile: {profile.get('tokens', 0):,} tokens read "
                     f"{fmt_bytes(profile.get('working_set_bytes', 0))} of pages; the hit rates "
                     "are this corpus's (more or other text reads more rows)")
    lines.append(text_table(["mode", "tables per host", "tier", "page hits, at most"],
                            [[v.mode, fmt_bytes(v.resident_bytes), v.tier,
                              "" if v.hit_rate is None else f"{v.hit_rate:.1%}"]
                             for v in tiers], left=3))
    lines += [f"tier, {v.mode}: {v.why}" for v in tiers]
    lines += [f"DOES NOT FIT: {s}" for s in d.shortfalls]
    lines += [f"fix: {f}" for f in d.fixes]
    doc = {"plan": d.plan.to_dict(), "bytes_per_node": chosen.bytes_per_node,
           "remote_fraction": chosen.remote_fraction, "copies": chosen.copies,
           "host_bytes": chosen.host_bytes, "mode_memory": modes,
           "page_table_bytes": {k: v["per_process"] for k, v in tables.items()},
           "page_tables": tables, "mapped_per_process": d.mapped_per_process,
           "regions": [{"name": r.name, "bytes": r.length, "readers": list(r.reader_nodes)}
                       for r in d.regions],
           "alternatives": [o.to_dict() for o in d.alternatives], "notes": d.notes,
           "recommendation": recommendation(d), "fits": d.fits, "shortfalls": d.shortfalls,
           "fixes": d.fixes, "memory": memory, "tiers": [v.to_dict() for v in tiers],
           **{k: v["value"] for k, v in extra.items()}}
    return doc, "\n".join(lines)


def _memory_line(memory: dict) -> str:
    from ..units import fmt_bytes

    budget = "unknown" if memory["budget"] is None else fmt_bytes(memory["budget"])
    line = f"memory budget: {budget} ({memory['source']})"
    if memory.get("mem_available") is not None:
        line += f"; MemAvailable {fmt_bytes(memory['mem_available'])}"
    if memory.get("cgroup_limit") is not None:
        line += f", cgroup limit {fmt_bytes(memory['cgroup_limit'])}"
    if memory.get("shm_bytes") is not None:
        line += (f"; /dev/shm {fmt_bytes(memory['shm_bytes'])} (not needed: 4 KiB tables "
                 "are memfds, huge-page tables live on hugetlbfs)")
    return line


def _operator_numbers(args: argparse.Namespace, d) -> dict:
    """Load time, DP-sharded exchange bytes per step, CUDA registration time."""
    from ..model.families import family_of
    from ..units import fmt_bytes

    spec, world, chosen = d.spec, d.world, d.chosen
    load_s = chosen.host_bytes / (args.read_gbps * 1e9)
    edp = world.edp_size()
    exchanged = family_of(spec).dp_sharded_exchange_bytes(spec, world, args.batch)
    biggest = max(d.mapped_per_process.values())
    from ..host.hugepages import SIZES

    register_s = {name: (biggest / 1e9 * args.register_s_per_gb[name]
                         if name in args.register_s_per_gb else None) for name in SIZES}
    register_text = "; ".join(
        f"{name} pages {s_:.1f} s at {args.register_s_per_gb[name]} s/GB" if s_ is not None
        else f"{name} pages not measured (pass --register-s-per-gb {name}=S)"
        for name, s_ in register_s.items())
    sharded = {"value": exchanged, "text": f"{fmt_bytes(exchanged)} per member per step at "
               f"--batch {args.batch} tokens (EDP {edp}: rows of the other members' slices)"}
    if any(n.startswith("dp_sharded is not an option") for n in d.notes):
        sharded = {"value": None, "text": "none: dp_sharded is not an option at this TP x DP"}
    return {
        "load_seconds": {"value": load_s, "text": f"{load_s:.0f} s at {args.read_gbps} GB/s"},
        "dp_sharded_exchange_bytes": sharded,
        "register_seconds_per_process": {
            "value": register_s, "text": f"cudaHostRegister of a process's "
            f"{fmt_bytes(biggest)}: {register_text}"},
    }


HELP = ("what one host of a deployment needs: bytes per node, copies, "
        "remote reads, page tables, capacity (exit 1 when it does not fit)")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram plan``'s arguments."""
    sp.add_argument("--spec", default="v4-flash",
                    help="demo, v4-flash, small, tiny, a JSON spec or a model's config.json")
    sp.add_argument("--model", default=None, help="a model directory (its config.json)")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K, 2M or 1G: huge-page pools per node are then planned")
    sp.add_argument("--read-gbps", type=float, default=2.0,
                    help="checkpoint read speed for the load time")
    sp.add_argument("--batch", type=positive_int, default=256,
                    help="tokens per step for the DP-sharded exchange")
    sp.add_argument("--register-s-per-gb", type=register_rates, default="4K=0.1",
                    help="cudaHostRegister seconds per GB per page size, e.g. 4K=0.1,2M=0.01 "
                    "(4K: vLLM's on an H200); a size not given is reported as not measured")
    sp.add_argument("--tp", type=positive_int, default=2, help="tensor parallel")
    sp.add_argument("--dp", type=positive_int, default=4, help="data parallel")
    sp.add_argument("--gpus-per-host", dest="gpus_per_host", type=non_negative_int, default=0,
                    help="GPUs per host (0: from the topology)")
    sp.add_argument("--mode", default="dp_shared", choices=list(SHARING_MODES),
                    help="who holds rows")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--simulate", type=simulate_arg, help="'2x4' or a topology JSON file")
    sp.add_argument("--memory-budget", dest="memory_budget", type=parse_size, default=None,
                    help="memory the tables may take, e.g. 64G (default: the cgroup's limit "
                    "or MemAvailable, the smaller; a simulated host's nodes)")
    sp.add_argument("--profile", default=None,
                    help="a row-access profile (numa-engram profile --out) for the mapped "
                    "tier's expected hit rate")
