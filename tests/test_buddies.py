"""Each stage's snapshot buddy (ldt.topology.buddies), by hand and over many layouts: the
data owner's stages never get one off its host, a cloud stage's copy goes to another cloud
host, and a DP replica on another host needs no copy. No processes."""

from __future__ import annotations

import itertools

import pytest

from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.topology.buddies import ALONE, COPY, EDGE, REPLICA, copy_holders, snapshot_buddies
from ldt.topology.ranks import Topology


def topo(tps, *, u_shape=False, dp=1, dps=None):
    stages = [StageConfig(f"s{i}", "cpu", t, None if dps is None else dps[i])
              for i, t in enumerate(tps)]
    return Topology.from_config(ClusterConfig(stages=stages, u_shape=u_shape, dp=dp))


def by_stage(plan):
    return [(b.stage, b.writer, b.holder, b.why) for b in plan]


def test_the_elastic_demo():
    """cpu_elastic's three hosts: the edge [0], cloud hosts [1] and [2]: the edge keeps its
    own, the two cloud stages hold each other's."""
    t = topo((1, 1, 1), u_shape=True)
    assert by_stage(snapshot_buddies(t, ["edge", "c1", "c2"], owner="edge")) == [
        (0, 0, None, EDGE), (1, 1, 2, COPY), (2, 2, 1, COPY)]


def test_two_stages_on_one_cloud_host_go_to_the_next():
    """TP 1/2/1/2 on edge | a a a | b b: stage 1 and 2 (host a) -> host b, stage 3 -> a; the
    holder is spread over the receiving host's ranks (ranks 1, 2, 3 -> 4, 5, 4), and a
    stage's holder is its writer's (copy_holders)."""
    t = topo((1, 2, 1, 2), u_shape=True)
    nodes = ["e", "a", "a", "a", "b", "b"]
    assert by_stage(snapshot_buddies(t, nodes, owner="e")) == [
        (0, 0, None, EDGE), (1, 1, 4, COPY), (2, 3, 4, COPY), (3, 4, 1, COPY)]


def test_a_replica_on_another_host_is_the_copy():
    """dp 2 (replica 1 on other hosts): every cloud stage's replica holds the same state;
    the edge's replica lives on the data owner's host too (the edge is one node)."""
    t = topo((1, 1), u_shape=True, dp=2)  # ranks: [0] [1] | [2] [3]
    assert by_stage(snapshot_buddies(t, ["e", "a", "e", "b"], owner="e")) == [
        (0, 0, None, EDGE), (1, 1, 3, REPLICA)]
    # both replicas on one host: not a copy that survives the host
    assert by_stage(snapshot_buddies(t, ["e", "a", "e", "a"], owner="e"))[1] == (
        1, 1, None, ALONE)


def test_no_data_owner_every_host_is_cloud():
    t = topo((2, 1))
    assert by_stage(snapshot_buddies(t, ["x", "x", "y"])) == [(0, 0, 2, COPY), (1, 2, 0, COPY)]
    assert by_stage(snapshot_buddies(t, ["x", "x", "x"])) == [(0, 0, None, ALONE),
                                                              (1, 2, None, ALONE)]


@pytest.mark.parametrize("tps,u_shape,dp", [((1, 2, 1), True, 1), ((2, 1, 1, 2), True, 2),
                                             ((1, 1, 1, 1), False, 1), ((2, 2), False, 3)])
def test_never_on_the_owner_nor_on_the_writers_host(tps, u_shape, dp):
    """Every assignment of the ranks to up to four hosts (rank 0 on the owner's host)."""
    t = topo(tps, u_shape=u_shape, dp=dp)
    hosts = ["own", "h1", "h2", "h3"]
    for rest in itertools.islice(itertools.product(hosts, repeat=t.world_size - 1), 400):
        nodes = ["own", *rest]
        for b in snapshot_buddies(t, nodes, owner="own"):
            ranks = {r for d in range(t.dp_of(b.stage)) for r in t.stage_ranks(b.stage, d)}
            on_owner = any(nodes[r] == "own" for r in ranks)
            assert (b.why == EDGE) == on_owner
            if b.holder is not None:
                assert nodes[b.holder] not in ("own", nodes[b.writer])
            assert (b.holder is None) == (b.why in (EDGE, ALONE))


def test_names_must_fit_the_world():
    with pytest.raises(ConfigError, match="2 node names for a world of 3 ranks"):
        snapshot_buddies(topo((2, 1)), ["x", "y"])
    with pytest.raises(ConfigError, match="data owner's node 'z' holds no rank"):
        snapshot_buddies(topo((2, 1)), ["x", "x", "y"], owner="z")


def test_every_rank_of_a_copied_stage_sends_its_own_part():
    """Snapshot parts are per rank: each rank of a ``copy`` stage has a holder on the buddy
    host, spread over its ranks; the data owner's ranks have none."""
    t = topo((1, 1, 1), u_shape=True)
    assert copy_holders(t, ["edge", "c1", "c2"], owner="edge") == {1: 2, 2: 1}
    t = topo((1, 2, 1, 2), u_shape=True)
    assert copy_holders(t, ["e", "a", "a", "a", "b", "b"], owner="e") == {
        1: 4, 2: 5, 3: 4, 4: 1, 5: 2}


def test_a_stage_over_several_hosts_spreads_its_copies_around_the_ring():
    """cpu_demo (TP 1/2/1) with every rank on a host of its own, as bench_snapshot runs it:
    each rank's part goes to the next cloud host in the ring (c1 -> c2 -> c3 -> c1), so each
    cloud host keeps one part, not the stage's buddy host two (the stage's TP ranks sent to
    each other's hosts, and stage 2 to one of them) and another host none."""
    t = topo((1, 2, 1), u_shape=True)
    assert copy_holders(t, ["e", "c1", "c2", "c3"], owner="e") == {1: 2, 2: 3, 3: 1}
    assert copy_holders(t, ["e", "c3", "c1", "c2"], owner="e") == {1: 2, 2: 3, 3: 1}
    assert copy_holders(t, ["e", "c1", "c3", "c2"], owner="e") == {1: 3, 2: 1, 3: 2}


@pytest.mark.parametrize("tps,u_shape,dp", [((1, 2, 1), True, 1), ((1, 2, 1, 2), True, 1),
                                             ((2, 1, 1, 2), False, 1)])
def test_every_part_goes_to_the_next_cloud_host_and_stages_agree(tps, u_shape, dp):
    """Every assignment of the ranks to up to four hosts: a ``copy`` stage's ranks send to a
    rank of the next cloud host after their own (sorted names, around), and each stage's
    buddy is its writer's holder."""
    t = topo(tps, u_shape=u_shape, dp=dp)
    hosts = ["own", "h1", "h2", "h3"]
    for rest in itertools.islice(itertools.product(hosts, repeat=t.world_size - 1), 400):
        nodes = ["own", *rest]
        holders = copy_holders(t, nodes, owner="own" if u_shape else None)
        cloud = sorted({n for n in nodes if n != "own" or not u_shape})
        for b in snapshot_buddies(t, nodes, owner="own" if u_shape else None):
            ranks = [r for d in range(t.dp_of(b.stage)) for r in t.stage_ranks(b.stage, d)]
            if b.why != COPY:
                assert not set(ranks) & holders.keys()
                continue
            assert holders[b.writer] == b.holder
            for r in ranks:
                after = cloud[(cloud.index(nodes[r]) + 1) % len(cloud)]
                assert nodes[holders[r]] == after, (nodes, r, holders)


def test_a_replica_is_the_copy_unless_the_optimizer_is_sharded():
    t = topo((1, 1), u_shape=True, dp=2)  # ranks: [0] [1] | [2] [3]
    nodes = ["e", "a", "e", "b"]
    assert copy_holders(t, nodes, owner="e") == {}  # replica 1 holds what rank 1 holds
    assert copy_holders(t, nodes, owner="e", sharded=True) == {1: 3, 3: 1}  # spans of its own
