"""Groups (groups/group.py): sharing groups as the caller separated them (the rule, then one
real world).  The roll call of a collective that timed out: test_shared_table.py's
test_peer_that_never_joins_times_out_everywhere_naming_it."""

import pytest

from numa_engram.errors import TopologyError
from numa_engram.groups.group import RankIdentity, caller_limit, identity_groups
from numa_engram.groups.identity import HostIdentity
from numa_engram.model.sharding import WorldLayout

from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world


def _groups(world, gpus_per_host=None, within=None):
    """Each rank's sharing group on one machine, limited as sharing_groups limits it."""
    layout = None if gpus_per_host is None else WorldLayout(tp=1, dp=world,
                                                            gpus_per_host=gpus_per_host)
    host = HostIdentity("boot", 0, (40, 1), "host")
    identities = [RankIdentity(r, 0, host, None, "mnt", caller_limit(r, layout, None, within))
                  for r in range(world)]
    groups = identity_groups(identities)
    return [list(next(g for g in groups if r in g)) for r in range(world)]


def test_the_callers_layout_and_within_groups_limit_the_measured_ones():
    assert _groups(4) == [[0, 1, 2, 3]] * 4
    assert _groups(4, gpus_per_host=2) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _groups(4, within=[[0, 3], [1, 2]]) == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert _groups(4, gpus_per_host=2, within=[[0], [1, 2, 3]]) == [[0], [1], [2, 3], [2, 3]]


def test_within_must_put_each_rank_in_exactly_one_group():
    with pytest.raises(TopologyError, match=r"rank 1 in exactly one group, it is in 2"):
        caller_limit(1, None, None, [[0, 1], [1, 2]])
    with pytest.raises(TopologyError, match=r"rank 3 in exactly one group, it is in 0"):
        caller_limit(3, None, None, [[0, 1], [2]])


@pytest.mark.multiproc
def test_sharing_groups_never_merge_what_the_caller_separated():
    results = run_world(4, scenarios.groups_limited, gpus_per_host=2, within=[[0], [1, 2, 3]])
    assert [r["group"] for r in results] == [[0], [1], [2, 3], [2, 3]], results
