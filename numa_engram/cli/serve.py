"""``numa-engram serve`` (the table service) and ``numa-engram status`` (its
readiness probe)."""

from __future__ import annotations

import argparse

from .args import POLICY_HELP, emit, page_size_arg, positive_int

READY, NOT_READY = 0, 1  # status's exit codes (2: no service, as any other error)


def cmd_serve(args: argparse.Namespace) -> int:
    """Hold every table of a model directory for this host: load once (or
    adopt what systemd's fd store kept), seal, hand out descriptors on
    --socket until stopped."""
    from ..runtime.hubcache import model_path
    from ..runtime.modeldirs import open_model_directory
    from ..service import systemd
    from ..service.tableservice import TableService
    from ..userfiles import printable

    path = model_path(args.model_dir)  # a hub id: its snapshot in the local cache
    model = open_model_directory(path)  # its config.json says which family
    service = TableService(model, args.socket, tp=args.tp, placement=args.placement,
                           page_size=args.page_size, group=args.group,
                           load_threads=args.load_threads)
    adopted = service.adopt(systemd.listen_fds())
    service.start()
    try:
        print(f"numa-engram serve: {len(service.tables)} tables of {printable(model.path)} on "
              f"{printable(service.socket_path)} ({adopted} adopted from the fd store)",
              flush=True)
        service.load_all()
        doc = service.status()
        print(f"numa-engram serve: {sum(t['state'] == 'ready' for t in doc['tables'])} of "
              f"{len(doc['tables'])} tables ready", flush=True)
        while not service.wait(1.0):  # a signal stops the wait between seconds
            pass
    finally:
        service.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """What a table service holds: each table's state, load progress,
    bytes per node, attaches and startup phases.  Exit 0 when every table
    is ready, 1 while some are not (a readiness probe), 2 without a service."""
    from ..store import serviceclient

    doc = serviceclient.status(args.socket)
    emit(args, doc, status_text(doc))
    return READY if doc.get("ready") else NOT_READY


def status_text(doc: dict) -> str:
    from ..units import fmt_bytes, unit_for

    lines = [f"table service pid {doc['service_pid']} on {doc['socket']}: {doc['model_dir']}, "
             f"{doc['page_size'] // 1024} KiB pages, placement {doc['placement']}, "
             f"{'ready' if doc['ready'] else 'NOT ready'}"]
    for t in doc["tables"]:
        lines.append("  " + _table_line(t, fmt_bytes, unit_for))
    return "\n".join(lines)


def _table_line(t: dict, fmt_bytes, unit_for) -> str:
    done, total = t["progress"]
    unit = unit_for(max(t["bytes"], 1))
    where = ", ".join(f"node {n}: {fmt_bytes(b, unit)}" for n, b in
                      t["bytes_per_node"].items()) or "nodes unknown"
    state = t["state"] + (f" {done / total:.0%}" if t["state"] == "loading" and total else "")
    flags = (" sealed" if t["sealed"] else "") + (" adopted" if t["adopted"] else "")
    if t["state"] == "ready" and not t["sealed"]:
        flags += " (NOT handed out: unsealed)"
    load = t["startup_s"].get("load")
    speed = f", loaded at {total / load / 2**30:.2f} GiB/s" if load else ""
    copy = "all nodes" if t["node"] is None else f"node {t['node']}"
    error = f"; {t['error']}" if t["error"] else ""
    return (f"layer {t['layer']} heads [{t['heads'][0]}, {t['heads'][1]}) copy {copy}: "
            f"{state}{flags}, {fmt_bytes(t['bytes'], unit)} ({where}), {t['attaches']} "
            f"attaches{speed}{error}")


HELP = ("hold a model's tables for this host: load once, seal, hand "
        "out descriptors to engines on a Unix socket")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram serve``'s arguments."""
    sp.add_argument("model_dir", help="the model directory (config.json, tokenizer, checkpoint)"
                    ", or a hub id (ORG/NAME) whose snapshot is in the local Hugging Face cache")
    sp.add_argument("--socket", required=True, help="the Unix socket engines attach through")
    sp.add_argument("--tp", type=positive_int, default=1, help="TP shards of each layer")
    sp.add_argument("--placement", default="interleave",
                    help=POLICY_HELP + "; replicate-per-node: one copy per node, each client "
                    "gets its node's")
    sp.add_argument("--page-size", type=page_size_arg, default="4K", help="4K, 2M or 1G")
    sp.add_argument("--group", default=None,
                    help="a group whose members may attach too (else only this uid and root)")
    sp.add_argument("--load-threads", type=positive_int, default=None,
                    help="threads per table load (default: one per CPU, at most 8)")


STATUS_HELP = "what a table service holds; exit 0 when ready, 1 if not"


def add_status_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram status``'s arguments."""
    sp.add_argument("--socket", required=True, help="the service's socket")
