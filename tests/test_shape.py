"""The cluster's shape (rudra_zmq/shape.py): the one object that knows the parameter servers,
their ranges and parts, their names and files, hosts and tree plan; one server is a set of
one. Pure: no sockets, no files."""

from pathlib import Path

import numpy as np
import pytest

from cluster import small_config
from rudra_zmq.config import ConfigError
from rudra_zmq.shape import ClusterShape, Share, part_bounds, split


def test_the_servers_ranges_are_the_split_of_the_vector_and_one_server_serves_it_whole():
    three = ClusterShape(3).sized(10)
    assert [s.share for s in three.servers] == [Share((x,)) for x in split(10, 3)]
    assert [s.label for s in three.servers] == ["ps", "ps1", "ps2"] == three.labels
    (one,) = ClusterShape(1).sized(10).servers
    assert one.share == Share.whole(10) and one.label == "ps"


def test_each_part_has_a_global_index_its_server_and_its_place_in_the_vector():
    shape = ClusterShape(2, parts_per_range=3, stripes=False).sized(10)  # [0, 5), [5, 10)
    parts = shape.parts
    assert [p.index for p in parts] == list(range(6))
    assert [p.server for p in parts] == [0, 0, 0, 1, 1, 1]
    assert [(p.lo, p.hi) for p in parts] == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10)]
    assert [p.at for p in shape.parts_of(1)] == [0, 2, 4]  # offsets in server 1's range
    assert shape.server(1).bounds == [0, 2, 4, 5]
    assert shape.parts_of(0) == parts[:3]
    # one server, one part: the whole vector is one part of it
    (whole,) = ClusterShape(1).sized(10).parts
    assert (whole.index, whole.server, whole.lo, whole.hi, whole.at) == (0, 0, 0, 10, 0)


def test_a_range_smaller_than_its_parts_has_one_part_per_float():
    shape = ClusterShape(2, parts_per_range=8, stripes=False).sized(5)  # 3 and 2 floats
    assert [len(s.parts) for s in shape.servers] == [3, 2]
    assert [(p.lo, p.hi) for p in shape.parts] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_the_parts_covering_a_range_of_the_vector_are_found_across_servers():
    shape = ClusterShape(2, parts_per_range=3, stripes=False).sized(10)
    assert [p.index for p in shape.covering(0, 10)] == list(range(6))
    assert [p.index for p in shape.covering(3, 6)] == [1, 2, 3]  # across the servers' bound
    assert [p.index for p in shape.covering(4, 5)] == [2]
    assert [p.index for p in shape.covering(9, 10)] == [5]
    assert shape.covering(5, 5) == []
    with pytest.raises(ValueError, match=r"\[8, 11\) is not within the vector of 10 floats"):
        shape.covering(8, 11)


def test_striped_parts_deal_the_vector_to_the_servers_in_turn_each_holding_them_end_to_end():
    shape = ClusterShape(2, parts_per_range=3).sized(10)  # 6 parts: 2, 2, 2, 2, 1, 1 floats
    assert shape.striped
    parts = shape.parts
    assert [(p.lo, p.hi) for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9), (9, 10)]
    assert [p.index for p in parts] == list(range(6))
    assert [p.server for p in parts] == [0, 1, 0, 1, 0, 1]  # part j to server j mod K
    assert [p.at for p in shape.parts_of(0)] == [0, 2, 4]  # end to end in its local vector
    assert shape.server(0).bounds == [0, 2, 4, 5] == shape.server(1).bounds
    first = shape.server(0).share
    assert first.key == [[0, 2], [4, 6], [8, 9]] and first.numel == 5
    assert first.dirname == "stripes-0-2-x3" and not first.contiguous
    assert shape.server(0).eval_fields == {"range": [[0, 2], [4, 6], [8, 9]]}
    assert Share.from_key(first.key, 10) == first
    assert shape.eval_server({"range": [[0, 2], [4, 6], [8, 9]]}) == 0
    # the parts cut each server's local vector as the server cuts it (shape.part_bounds)
    for k, n in [(3, 1000), (8, 10_000_019), (4, 37)]:
        many = ClusterShape(k, parts_per_range=16).sized(n)
        for s in many.servers:
            assert s.bounds == [0, *[p.at for p in s.parts[1:]], s.share.numel]
            assert s.bounds == part_bounds(s.share.numel, len(s.parts))
        assert sum(s.share.numel for s in many.servers) == n


def test_stripes_spread_every_layer_over_every_server_where_ranges_leave_it_to_one():
    """What striping is for: backward finishes the last layer first, and its gradient must
    reach every server's link. A 20-layer model, K = 8, 16 parts: each layer's floats go to
    at least 6 servers; in ranges, to at most 2 (the layout the timeline showed idle)."""
    layer, k = 500_000, 8
    striped = ClusterShape(k, parts_per_range=16).sized(20 * layer)
    ranges = ClusterShape(k, parts_per_range=16, stripes=False).sized(20 * layer)
    for i in range(20):
        lo, hi = i * layer, (i + 1) * layer
        assert len({p.server for p in striped.covering(lo, hi)}) >= 6
        assert len({p.server for p in ranges.covering(lo, hi)}) <= 2
    # the last layer (backward's first bucket) reaches every server but at most two
    assert len({p.server for p in striped.covering(19 * layer, 20 * layer)}) >= k - 2


def test_a_shares_gather_and_the_shapes_join_put_every_float_back_in_its_place():
    n = 1003
    vector = np.arange(n, dtype=np.float32)
    for shape in (
        ClusterShape(3, parts_per_range=4).sized(n),
        ClusterShape(3, parts_per_range=4, stripes=False).sized(n),
        ClusterShape(1, parts_per_range=4).sized(n),
    ):
        local = [s.share.gather(vector) for s in shape.servers]
        for s, w in zip(shape.servers, local):  # each part's floats at its offset
            for p in s.parts:
                np.testing.assert_array_equal(w[p.at : p.at + p.numel], vector[p.lo : p.hi])
        np.testing.assert_array_equal(shape.join(local), vector)
        unsized = ClusterShape(shape.count, shape.parts_per_range, stripes=shape.stripes)
        np.testing.assert_array_equal(unsized.join(local), vector)  # sized from the files


def test_one_server_and_whole_messages_keep_the_ranges_layout_under_stripes():
    for k, parts in [(1, 4), (3, 1)]:
        a = ClusterShape(k, parts_per_range=parts).sized(100)
        b = ClusterShape(k, parts_per_range=parts, stripes=False).sized(100)
        assert not a.striped and a.servers == b.servers
        assert all(s.share.contiguous for s in a.servers)


def test_ranges_and_parts_wait_for_the_models_size():
    shape = ClusterShape(2, parts_per_range=4)
    assert [s.share for s in shape.servers] == [None, None] and shape.labels == ["ps", "ps1"]
    with pytest.raises(ValueError, match="model's size"):
        shape.parts  # noqa: B018
    with pytest.raises(ValueError, match="server 1's range is not known"):
        shape.server(1).bounds  # noqa: B018


def test_more_servers_than_parameters_are_refused_naming_both():
    with pytest.raises(ConfigError, match="architecture.servers=4 is more than the model's 3"):
        ClusterShape(4).sized(3)
    asked = []
    ClusterShape(1).check_size(lambda: asked.append(1) or 0)
    assert asked == []  # one server fits any model: its size is not even asked
    with pytest.raises(ConfigError, match="more than the model's 3 parameters"):
        ClusterShape(4).check_size(lambda: 3)


def test_the_shape_comes_from_the_config_once():
    cfg = small_config("architecture.servers=2", "wire.parts=4", "sync.protocol=hardsync")
    shape = ClusterShape.of(cfg, 100)
    assert (shape.count, shape.parts_per_range, shape.numel) == (2, 4, 100)
    assert len(shape.parts) == 8 and shape.tree is None
    adv = ClusterShape.of(small_config("architecture.kind=adv", "sync.learners=4"))
    assert adv.tree is not None and adv.numel is None


def test_one_server_keeps_the_layout_of_runs_before_servers_had_ranges():
    run = Path("/runs/r")
    (one,) = ClusterShape(1).sized(10).servers
    assert one.files_dir(run) == run and one.checkpoint_dir(run) == run / "checkpoints"
    assert one.args == [] and one.record == {} and one.eval_fields == {}
    assert one.name == one.title() == "parameter server" and one.of_range == ""
    assert ClusterShape(1).joined_dirs(run) == ()  # its files are the run's own
    assert ClusterShape(1).describe() == []


def test_each_of_several_servers_has_its_own_folder_name_and_fields():
    run = Path("/runs/r")
    shape = ClusterShape(2).sized(10)
    second = shape.server(1)
    assert second.files_dir(run) == run / "servers" / "server-1"
    assert second.checkpoint_dir(run) == run / "checkpoints" / "range-5-10"
    assert second.args == ["--shard", "1"] and second.record == {"server": 1}
    assert second.eval_fields == {"range": [5, 10]} and second.name == "parameter server 1"
    assert second.title() == "parameter server 1 of 2 (range [5, 10) of 10)"
    assert second.of_range == " of server 1's range"
    assert shape.joined_dirs(run) == (run / "servers/server-0", run / "servers/server-1")
    assert shape.eval_record([3, 4]) == {"server_ts": [3, 4]}


def test_a_record_or_an_eval_is_told_to_its_server_by_the_fields_it_carries():
    one, two = ClusterShape(1).sized(10), ClusterShape(2).sized(10)
    assert one.record_server({"type": "done"}) == 0  # the only server names none
    assert two.record_server({"type": "done", "server": 1}) == 1
    assert two.record_server({"type": "done"}) is None
    assert two.record_server({"type": "done", "server": 2}) is None
    assert one.eval_server({"epoch": 1.0}) == 0
    assert two.eval_server({"range": [5, 10]}) == 1
    assert two.eval_server({"range": [0, 6]}) is None and two.eval_server({}) is None


def test_a_command_lines_shard_picks_a_server_and_is_required_only_with_several():
    assert ClusterShape(1).pick(None).index == 0 and ClusterShape(1).pick(0).index == 0
    with pytest.raises(ValueError, match="one parameter server .* --shard is 0 or absent"):
        ClusterShape(1).pick(1)
    assert ClusterShape(3).pick(2, "tree node").index == 2
    for bad in (None, 3, -1):
        with pytest.raises(
            ValueError,
            match=rf"give --shard I, the range this tree node serves, 0..2 \(got {bad}\)",
        ):
            ClusterShape(3).pick(bad, "tree node")


def test_one_tree_per_range_and_a_learner_reaches_its_leaf_in_each():
    cfg = small_config(
        "architecture.kind=adv",
        "architecture.fanout=2",
        "sync.learners=4",
        "architecture.servers=2",
    )
    shape = ClusterShape.of(cfg)
    labels = [label for label, _, _ in shape.tree_processes()]
    assert labels == ["node0", "node1", "node0s1", "node1s1"]
    assert shape.first_hops(3) == ["node1", "node1s1"]
    assert ClusterShape(2).first_hops(3) == ["ps", "ps1"]  # Rudra-base: the servers
    assert ClusterShape(2).tree_processes() == []


def test_servers_are_placed_on_hosts_in_turn():
    shape = ClusterShape(3)
    assert [s.host for s in shape.servers] == [None] * 3
    assert [s.host for s in shape.placed(None, "a", ["b", "c"]).servers] == ["a", "a", "a"]
    assert [s.host for s in shape.placed(["learners"], "a", ["b", "b", "c"]).servers] == [
        "b",
        "c",
        "b",
    ]
    assert [s.host for s in shape.placed(["x", "y"], "a", []).servers] == ["x", "y", "x"]
