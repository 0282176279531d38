"""The tiers a table's rows may be (docs/design.md, "Tiers"), by name: one
object per tier that builds a member's table from its ``CreateRequest``,
whatever its family, asked by the table base class (``familytable``).  A
new tier is a module with its object and one entry in ``TIERS``."""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import SpecError
from ..groups.group import SingleProcessGroup, as_group
from . import protocol
from .mappedtier import MAPPED
from .protocol import Built
from .request import CreateRequest


class Tier(Protocol):
    def build(self, group: Any, req: CreateRequest) -> Built:
        """This member's table of ``req`` (``group``: the create's, or None)."""
        ...


class Resident:
    """A table file made and loaded by the sharing protocol over the
    group (``protocol``), every collective bounded by the request's
    timeout."""

    def build(self, group: Any, req: CreateRequest) -> Built:
        grp = SingleProcessGroup() if group is None else as_group(group)
        with grp.bounded(req.options.timeout_s):
            return protocol.create(grp, req)


TIERS: dict[str, Tier] = {"resident": Resident(), "mapped": MAPPED}


def tier_named(name: str) -> Tier:
    """The tier called ``name`` (a SpecError naming the tiers otherwise)."""
    if not isinstance(name, str) or name not in TIERS:
        raise SpecError(f"tier must be one of {tuple(TIERS)}, got {name!r}")
    return TIERS[name]
