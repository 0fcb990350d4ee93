"""format/tree.py: the one model of the state tree that capture builds and every reader walks."""

import pytest
import torch

from async_ckpt.errors import CorruptSnapshotError
from async_ckpt.format import tree as tree_model
from async_ckpt.format.tree import Leaf, NodeKind
from async_ckpt.train.capture import capture


def _captured():
    model = torch.nn.Linear(2, 1)
    return model, capture({"model": model, "extra": {"weird key": torch.zeros(3),
                                                     "meta": (torch.float16, torch.Size([2]))}})


def test_walk_meets_every_node_typed_parents_first_in_stored_order():
    _, captured = _captured()
    nodes = list(tree_model.walk(captured.tree, "here"))
    assert [(n.keys, n.kind) for n in nodes] == [
        (("model",), NodeKind.OBJECT), (("extra",), NodeKind.DICT),
        (("extra", "weird key"), NodeKind.TENSOR), (("extra", "meta"), NodeKind.VALUE)]
    assert nodes[0].has_metadata and not nodes[3].has_metadata
    assert [n.path for n in nodes[2:]] == ['extra["weird key"]', "extra.meta"]
    found = [leaf for node in nodes for leaf in tree_model.leaves(node)]
    assert found == [("model.weight", Leaf.TENSOR, 0), ("model.bias", Leaf.TENSOR, 1),
                     ('extra["weird key"]', Leaf.TENSOR, 2),
                     ("extra.meta[0]", Leaf.DTYPE, "float16"), ("extra.meta[1]", Leaf.SIZE, [2])]


def test_rebuild_decodes_each_leaf_through_the_callers_function():
    model, captured = _captured()
    seen = []

    def leaf(kind, payload):
        seen.append(kind)
        return captured.tensors[payload] if kind is Leaf.TENSOR else NotImplemented

    with pytest.raises(CorruptSnapshotError, match=r"unknown tag '\$dtype'"):
        tree_model.rebuild(captured.tree, leaf, False, "here")  # a leaf the caller does not take
    assert seen[:3] == [Leaf.TENSOR] * 3 and seen[-1] is Leaf.DTYPE
    only = tree_model.rebuild(tree_model.only(captured.tree, "model"), leaf, False, "here")
    assert only.value["model"].kind is NodeKind.OBJECT
    assert only.value["model"].value["weight"] is captured.tensors[0]
    assert only.value["model"].value._metadata == model.state_dict()._metadata
    assert tree_model.only(captured.tree, "nope") is None


@pytest.mark.parametrize("bad", [
    {"kind": "dict", "entries": {"a": {"kind": ["dict"]}}},  # a kind JSON could not hash
    {"kind": "dict", "entries": {"a": {"kind": "module"}}},
    {"kind": "dict", "entries": {"a": {"kind": "dict", "entries": []}}},
    {"kind": "dict", "entries": {"a": 3}},
    {"kind": "value", "state": 1},  # the root is not a dict
])
def test_walk_refuses_a_malformed_tree_with_a_typed_error_naming_the_file(bad):
    with pytest.raises(CorruptSnapshotError, match="^here: "):
        list(tree_model.walk(bad, "here"))


def test_walk_refuses_a_tree_nested_deeper_than_the_reader_allows():
    deep = {"kind": "value", "state": 1}
    for _ in range(tree_model.MAX_TREE_DEPTH):
        deep = {"kind": "dict", "entries": {"k": deep}}
    assert len(list(tree_model.walk(deep, "here"))) == tree_model.MAX_TREE_DEPTH
    with pytest.raises(CorruptSnapshotError, match="malformed state tree"):
        list(tree_model.walk({"kind": "dict", "entries": {"k": deep}}, "here"))


@pytest.mark.parametrize("payload", [-1, 3, True, 1.0, "0", None, [0]])
def test_a_leaf_naming_no_entry_of_its_table_is_refused(payload):
    """Every reader indexes the tensor tables through table_entry: a crafted number (negative,
    past the end, or not an int at all: Python indexes with -1 and True) is damage, not an
    IndexError or someone else's tensor."""
    with pytest.raises(CorruptSnapshotError, match=r"here: \$tensor .* not in its table of 3"):
        tree_model.table_entry(Leaf.TENSOR, payload, 3, "here")
    assert tree_model.table_entry(Leaf.DTENSOR, 2, 3, "here") == 2


def _digests_of(tree):
    """``reshard._digests`` of a shard holding ``tree`` (and no tensors)."""
    from types import SimpleNamespace

    from async_ckpt.read.reshard import _digests

    reader = SimpleNamespace(tensors=(), storages=(), dtensors=(), tree=tree, path="rank-1")
    return _digests(reader, None, None)


def test_the_ranks_digests_compare_values_not_the_order_of_their_keys():
    """What tells per-rank state from state the ranks held alike at another world size: equal
    for the same values whatever their dicts' key order, different for another value, a dtype
    leaf compared by its name."""
    def tree(state):
        return tree_model.dict_node({"extra": tree_model.value_node(state)})

    a = {"x": 1, "y": [2.5, {"$dtype": "bfloat16"}]}
    b = {"y": [2.5, {"$dtype": "bfloat16"}], "x": 1}
    assert _digests_of(tree(a)) == _digests_of(tree(b))
    assert _digests_of(tree(a)) != _digests_of(tree({**a, "x": 2}))
    assert _digests_of(tree(a)) != _digests_of(tree({**a, "y": [2.5, {"$dtype": "float16"}]}))


def test_a_crafted_deep_value_in_another_ranks_shard_is_damage_not_a_recursion_error():
    """Another rank's tree is compared, never rebuilt: JSON nested deeper than any value the
    encoder writes makes its entries count as differing (no digest), as any malformed tree
    does; the deepest value it writes still gets its digest."""
    from async_ckpt.format import values

    deep = 0
    for _ in range(600):
        deep = [deep]
    assert _digests_of(tree_model.dict_node({"extra": tree_model.value_node(deep)})) == {}
    deepest = 0
    for _ in range(values.MAX_DEPTH - 1):
        deepest = {(1,): deepest}  # a keyed dict: three levels of JSON per level
    encoded = values.encode(deepest)
    assert set(_digests_of(tree_model.dict_node({"extra": tree_model.value_node(encoded)}))) == {
        "extra"}
