"""What a shared table reports: its counters (``TableStats``, what a
serving stack exports), its mode and placement (``ModeReport``, for the
deployment log), the bytes a process accounts for, and the table
service's descriptor of a shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from ..literals import PageSize
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..store import serviceclient
from .request import shard_key


@dataclass(frozen=True)
class TableStats:
    """What a serving stack exports about one table (``table.stats()``).
    Placement figures are those of the last ``placement_report()`` (a page
    walk of a 190 GiB table is ~50 M pages: never done per call)."""

    layer_id: int
    head_start: int
    head_end: int
    mode: str
    table_bytes: int
    lookups: int            # calls, CPU and GPU
    rows: int               # rows asked for (DEAD ones included)
    bytes_read: int         # rows x row bytes
    lookup_seconds: float   # CPU lookups' kernel time, counted by the kernel (GPU time:
                            # the scheduler's CUDA events)
    fraction_on_plan: float | None
    bytes_per_node: dict[int, int]
    # the memory this process accounts for: its own copy, or a shared copy
    # when it leads the group (so a sum over processes counts each copy
    # once); 0 for attached tables (their holder accounts for them)
    physical_bytes: int = 0
    bad_id_lookups: int = 0     # lookups refused for ids outside the shard's buckets
    failed_lookups: int = 0     # lookups that failed otherwise
    latency: tuple = ()         # CPU lookups' kernel times: Histogram.snapshot()


def accounted_bytes(mode: str, leader: bool, backing_bytes: int) -> int:
    """What a table's process accounts for (``TableStats.physical_bytes``):
    its own copy, or a shared copy when it leads the group, else 0."""
    return backing_bytes if mode == "independent" or mode == "dp_shared" and leader else 0


class PlacementSummary(TypedDict):
    policy: str
    planned_bytes_per_node: dict[int, int]
    fraction_on_plan: float | None
    pages_per_node: dict[int, int] | None


class _CommonReport(TypedDict):
    family: str  # model.families.Family.name
    tier: str  # resident | mapped
    mode: str  # dp_shared | independent | attached | service | mapped
    requested_mode: str  # auto | dp_shared | independent | attach | service
    fallback_reason: str
    layer_id: int
    row_start: int
    row_end: int
    num_rows: int
    sharing_group: list[int]  # world ranks
    member_pids: list[int]
    leader: bool
    backing_path: str
    backing_bytes: int
    placement: PlacementSummary | None
    registered_device: int | None
    lookup_threads: int
    lookup_cpus: list[int]
    identity: dict[str, Any]
    startup_s: dict[str, float]  # this member's create (or attach) steps, in seconds
    startup_gib_per_s: dict[str, float]


class ModeReport(_CommonReport, total=False):
    """What ``mode_report()`` says a member really runs (JSON-ready): the
    keys every table has, then its family's (how its shard is named)."""

    embedding_dp_size: int  # Engram
    head_start: int  # Engram
    head_end: int  # Engram
    etp_rank: int  # PLE
    etp_size: int  # PLE


def service_descriptor(spec: TableFamily, layer_id: int, shard: ShardInfo, service: str,
                       node: int, page_size: PageSize | int, timeout_s: float,
                       trust: serviceclient.ServiceTrust) -> tuple[int, int]:
    """(the descriptor the table service on ``service`` hands over for this
    table's shard and ``page_size``, its copy on ``node``; the service's uid)."""
    from ..host.hugepages import parse_page_size

    request = serviceclient.TableRequest(spec.fingerprint, shard_key(layer_id, shard),
                                         parse_page_size(page_size), node)
    fd, _, uid = serviceclient.fetch(service, request, timeout_s, trust)
    return fd, uid
