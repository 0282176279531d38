"""The command line's argument types and shared helpers: sizes, counts, seconds, page sizes,
simulated topologies, specs, and printing a table or its JSON."""

from __future__ import annotations

import argparse
import json
import os
import re

from ..errors import NumaEngramError
from ..userfiles import read_regular

SIMULATE = re.compile(r"^(\d+)x(\d+)$", re.IGNORECASE)



def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain numbers are bytes; > 0."""
    from ..units import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0 (e.g. 64M)")
    return value



def register_rates(text: str) -> dict[str, float]:
    """'4K=0.1,2M=0.01' (or a bare number: 4K's) -> {'4K': 0.1, '2M': 0.01}."""
    from ..host.hugepages import SIZES

    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.rpartition("=")
        name = name.strip().upper() or "4K"
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if name not in SIZES or not rate >= 0:
            raise argparse.ArgumentTypeError(f"{part!r} is not PAGE=SECONDS with PAGE one of "
                                             f"{list(SIZES)} (e.g. 4K=0.1,2M=0.01)")
        out[name] = rate
    return out


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else a message naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value
    return parse



positive_int, non_negative_int = int_at_least(1), int_at_least(0)



def non_negative_seconds(text: str) -> float:
    """An argparse type: seconds >= 0 (checked before anything is created)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value



# plan lays out every rank of the world; beyond this many GPUs the answer
# takes seconds and megabytes, and no deployment is that large
MAX_PLAN_WORLD = 4096



def page_size_arg(text: str) -> int:
    from ..host import hugepages

    try:
        return hugepages.parse_page_size(text)
    except NumaEngramError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



def simulate_arg(text: str) -> str:
    """'2x4' (sockets x GPUs per socket) or an existing topology JSON file."""
    m = SIMULATE.match(text)
    if os.path.exists(text) or (m and int(m[1]) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"--simulate {text!r}: write SOCKETSxGPUS_PER_SOCKET with sockets >= 1 and GPUs >= 0 "
        "(e.g. 2x4), or the path of a topology JSON file")



def load_topology(simulate: str | None):
    from ..host.topology import Topology

    if not simulate:
        return Topology.detect()
    if os.path.lexists(simulate):  # a regular file under a bound: never a FIFO or device
        return Topology.from_dict(json.loads(read_regular(simulate, "the topology file")))
    sockets, _, gpus = simulate.lower().partition("x")
    return Topology.from_dict({"sockets": int(sockets), "gpus_per_socket": int(gpus or 0)})



def emit(args: argparse.Namespace, doc: object, text: str) -> None:
    print(json.dumps(doc, indent=2, default=str) if args.json else text)



def progress_bar(args: argparse.Namespace, label: str):
    """A progress(done, total) bar on stderr, or None: only for a terminal,
    never with --json."""
    from .. import progress

    return progress.terminal_bar(label) if progress.wanted(args.json) else None



def load_spec(name: str):
    from ..model.spec import EngramSpec

    return EngramSpec.named(name)



POLICY_HELP = ("gpu-local, node:N, bind:NODES (e.g. 0-1), preferred:N, interleave, "
               "interleave:NODES (e.g. 0,2), replicate-per-node or none")
