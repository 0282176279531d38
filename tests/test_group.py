"""Groups (sharing/group.py): sharing groups as the caller separated them, the roll call of a
collective that timed out."""

import pytest

from . import dist_scenarios as scenarios
from .dist_harness import run_world, same_failure


@pytest.mark.multiproc
def test_sharing_groups_never_merge_what_the_caller_separated():
    results = run_world(4, scenarios.groups_limited, gpus_per_host=2)
    assert [r["group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]], results
    results = run_world(4, scenarios.groups_limited, within=[[0, 3], [1, 2]])
    assert [r["group"] for r in results] == [[0, 3], [1, 2], [1, 2], [0, 3]], results
    results = run_world(4, scenarios.groups_limited, gpus_per_host=2, within=[[0], [1, 2, 3]])
    assert [r["group"] for r in results] == [[0], [1], [2, 3], [2, 3]], results



@pytest.mark.multiproc
def test_a_group_timeout_names_the_members_that_did_not_arrive():
    results = run_world(3, scenarios.peer_never_joins, timeout_s=60)
    same_failure(results, "GroupTimeout", "member(s) at world rank(s) [2] did not arrive",
                  ranks={0, 1})
