"""The closed sets of strings the public API takes, as ``Literal`` types, so
a type checker catches ``mode="indepndent"`` before a run does.  Each has
its tuple of values for the runtime checks."""

from __future__ import annotations

from typing import Literal, get_args

from .errors import SpecError

SharingMode = Literal["independent", "dp_shared", "dp_sharded"]
"""Who holds a copy of a table: each replica, one node-local sharing group,
or TP x EDP head slices (``plan --mode``, a deployment's mode)."""
SHARING_MODES: tuple[str, ...] = get_args(SharingMode)

CreateMode = Literal["auto", "dp_shared", "independent"]
"""What ``SharedEngramTable.create`` is asked to do (``mode=``)."""
CREATE_MODES: tuple[str, ...] = get_args(CreateMode)

RuntimeSharing = Literal["auto", "dp_shared", "independent", "dp_sharded"]
"""What ``EngramRuntime`` is asked to do (``sharing=``): a create mode, or
the DP-sharded lookup."""
RUNTIME_SHARING: tuple[str, ...] = get_args(RuntimeSharing)

DEFAULT_DIRECTORY = "/dev/shm"
"""Where shared table files live unless told (a tmpfs)."""

IdFormat = Literal["bucket", "global"]
"""What hash ids count: buckets within each head, or rows of the layer's table."""
ID_FORMATS: tuple[str, ...] = get_args(IdFormat)

PageSize = Literal["4K", "2M", "1G"]
"""Page sizes by name (an int byte count is taken too)."""
PAGE_SIZES: tuple[str, ...] = get_args(PageSize)

Policy = str
"""A placement policy: 'gpu-local', 'interleave', 'interleave:0,2',
'node:1', 'bind:0-1', 'preferred:1', 'replicate-per-node' or 'none' (the
node-list forms make it an open set: checked by ``parse_policy``)."""


def check_id_format(id_format: object) -> IdFormat:
    """The one check of an ``id_format=`` argument (a SpecError, which is a
    ValueError, naming the value and the choices)."""
    if id_format not in ID_FORMATS:
        raise SpecError(f"id_format must be one of {ID_FORMATS} ('bucket': bucket ids within "
                        f"each head, as ngram_hashes gives them; 'global': rows of the layer's "
                        f"whole table), got {id_format!r}")
    return id_format  # type: ignore[return-value]  # one of the literals, checked above
