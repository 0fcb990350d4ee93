"""The state tree of a shard's index (docs/FORMAT.md section 5): its node kinds, the leaves it adds
to the value trees, and the one walker every reader goes through.

A node is an ``object``, ``tensor``, ``dict`` or ``value`` (``NodeKind``); all but a dict hold a
value tree (section 6) whose ``Leaf`` nodes stand for tensors and torch's objects. Capture builds
the tree with the constructors here (``dict_node``, ``object_node``, ``leaf_node``, ...);
readers meet it only through ``walk`` (the stored nodes, typed, not decoded), ``leaves`` and
``leaf_of`` (the leaves of a value tree) and ``rebuild`` (the ``Entry`` tree, the caller's
``leaf`` decoding tensors: torch tensors on the read side, stand-ins in ``native.py``). No module
outside ``format/`` knows a tag or a node's keys. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

from ..errors import CorruptSnapshotError
from . import values

MAX_TREE_DEPTH = 100
RNG_KEY = "__async_ckpt_rng__"  # the top-level entry under which the engine saves the global RNGs


class NodeKind(enum.StrEnum):
    """What a node of the state tree holds, and so how restore puts it back (FORMAT.md 5)."""

    OBJECT = "object"  # an object's state_dict(), given to its load_state_dict()
    TENSOR = "tensor"  # a registered tensor, copied into
    DICT = "dict"  # a dict of entries, each restored in turn
    VALUE = "value"  # a plain value, assigned into its parent dict


class Leaf(enum.Enum):
    """The leaves the state tree adds to section 6's value trees, each ``{tag: payload}``."""

    TENSOR = "$tensor"  # payload: the tensor's number in the index's ``tensors``
    DTENSOR = "$dtensor"  # payload: the sharded tensor's number in ``dtensors`` (3.7)
    DTYPE = "$dtype"  # payload: a torch dtype's name, "bfloat16"
    SIZE = "$size"  # payload: a torch.Size as a list of ints
    DEVICE = "$device"  # payload: a torch.device's name, "cuda:0"


_LEAF_OF_TAG = {leaf.value: leaf for leaf in Leaf}
_NODE_KIND_OF = {kind.value: kind for kind in NodeKind}


def leaf_node(leaf: Leaf, payload: Any) -> dict:
    """The encoded node of a leaf, as capture writes it into a value tree."""
    return {leaf.value: payload}


_TENSOR_TAG = Leaf.TENSOR.value


def tensor_leaf(number: int) -> dict:
    """``leaf_node(Leaf.TENSOR, number)`` at the cost of a literal: capture writes one per
    tensor, in ``snapshot()``'s blocking time."""
    return {_TENSOR_TAG: number}


def leaf_of(node: Any) -> Optional[tuple[Leaf, Any]]:
    """``(leaf, payload)`` where an encoded node is one of ``Leaf``'s, else None (nothing is
    checked beyond the tag: a malformed payload is the caller's to refuse)."""
    if type(node) is not dict or len(node) != 1:
        return None
    (tag, payload), = node.items()
    leaf = _LEAF_OF_TAG.get(tag)
    return None if leaf is None else (leaf, payload)


def table_entry(leaf: Leaf, payload: Any, count: int, where: str) -> int:
    """The number a ``$tensor`` or ``$dtensor`` leaf names, checked against its table of
    ``count`` entries (the index's ``tensors`` or ``dtensors``): the one rule every reader of a
    crafted tree goes through before it indexes a list. Raises CorruptSnapshotError naming
    ``where``."""
    if type(payload) is not int or not 0 <= payload < count:
        shown = repr(payload)
        raise CorruptSnapshotError(
            f"{where}: {leaf.value} {shown[:40]} is not in its table of {count}")
    return payload


# ------------------------------------------------------------------------------- building a tree


def dict_node(entries: Mapping[str, dict]) -> dict:
    """A dict of entries; the tree's root is one, of the registered state's top-level entries."""
    return {"kind": NodeKind.DICT.value, "entries": dict(entries)}


_ABSENT = object()


def object_node(state: Any = _ABSENT, metadata: Any = _ABSENT) -> dict:
    """An object's node; no ``state`` where it is left empty (``check_registrable``), a
    module's ``metadata`` (its state dict's ``_metadata``, encoded) where it has one."""
    node = {"kind": NodeKind.OBJECT.value}
    if state is not _ABSENT:
        node["state"] = state
    if metadata is not _ABSENT:
        node["metadata"] = metadata
    return node


def tensor_node(state: Any) -> dict:
    return {"kind": NodeKind.TENSOR.value, "state": state}


def value_node(state: Any) -> dict:
    return {"kind": NodeKind.VALUE.value, "state": state}


# ------------------------------------------------------------------------------- reading a tree


def only(tree: Any, entry: str) -> Optional[dict]:
    """The tree with only its top-level ``entry``, or None where it has no such entry."""
    entries = tree.get("entries") if isinstance(tree, dict) else None
    if not isinstance(entries, dict) or entry not in entries:
        return None
    return dict_node({entry: entries[entry]})


@dataclass(frozen=True)
class Node:
    """One stored node of a state tree, as ``walk`` meets it: its ``keys`` from the root (the
    first is its top-level entry), its ``kind``, and for all but ``dict`` its encoded value tree
    ``state`` and (a module's, where ``has_metadata``) ``metadata``, not decoded."""

    keys: tuple[str, ...]
    kind: NodeKind
    state: Any = None
    metadata: Any = None
    has_metadata: bool = False

    @property
    def path(self) -> str:
        """The key path, for messages: ``model``, ``opt.state``, ``extra["a b"]``."""
        return functools.reduce(values.child_path, self.keys, "")

    @property
    def top(self) -> str:
        return self.keys[0]


def walk(tree: Any, where: str) -> Iterator[Node]:
    """Every node of a state tree below its root, each parent before its children, in stored
    order. Lazy; raises CorruptSnapshotError naming ``where`` for a malformed root or node when it
    gets there."""
    if not isinstance(tree, dict) or tree.get("kind") != NodeKind.DICT:
        raise CorruptSnapshotError(f"{where}: the state tree's root is not a dict")
    todo = [((key,), child) for key, child in reversed(_entries(tree, where))]
    while todo:
        keys, node = todo.pop()
        kind = _node_kind(node)
        if kind is None or len(keys) > MAX_TREE_DEPTH:
            raise CorruptSnapshotError(f"{where}: malformed state tree")
        if kind is NodeKind.DICT:
            yield Node(keys, kind)
            todo.extend((keys + (k,), child) for k, child in reversed(_entries(node, where)))
        else:
            yield Node(keys, kind, node.get("state"), node.get("metadata"), "metadata" in node)


def leaves(node: Node) -> Iterator[tuple[str, Leaf, Any]]:
    """``(key path, leaf, payload)`` of every leaf of a node's value tree (none for a ``dict``
    node). Raises CorruptSnapshotError for a malformed value tree."""
    for keys, _, value in values.walk(node.state):
        found = leaf_of(value)
        if found is not None:  # a path is built only here: a deep tree's are long (issue 28)
            yield (functools.reduce(values.child_path, keys, node.path), *found)


def canonical(value: Any, leaf: Callable[[Leaf, Any], Any], where: str) -> Any:
    """An encoded value tree (a node's ``state`` or ``metadata``) with each leaf of the state
    tree (``Leaf``) replaced by ``leaf(leaf, payload)``: what the ranks' digests of their entries
    compare (``json.dumps(..., sort_keys=True)`` of it ignores the order of a dict's keys).
    JSON nested deeper than any encoded value is (each value level takes at most
    ``_JSON_LEVELS_PER_VALUE`` levels of JSON) is CorruptSnapshotError, never a RecursionError."""
    def walk(v: Any, depth: int) -> Any:
        if depth > _JSON_LEVELS_PER_VALUE * (values.MAX_DEPTH + 1):
            raise CorruptSnapshotError(f"{where}: malformed state tree (nested too deep)")
        found = leaf_of(v)
        if found is not None:
            return leaf(*found)
        if isinstance(v, dict):
            return {k: walk(x, depth + 1) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        return v

    return walk(value, 0)


_JSON_LEVELS_PER_VALUE = 3  # a keyed dict's {"$dict": [[key, value], ...]}


def _node_kind(node: Any) -> Optional[NodeKind]:
    kind = node.get("kind") if isinstance(node, dict) else None
    return _NODE_KIND_OF.get(kind) if type(kind) is str else None


def _entries(node: dict, where: str) -> list[tuple[str, Any]]:
    entries = node.get("entries")
    if not isinstance(entries, dict):
        raise CorruptSnapshotError(f"{where}: malformed state tree")
    return list(entries.items())


@dataclass
class Entry:
    """A restored entry, tagged with how it was captured (object, tensor, dict or value).

    ``borrowed`` (the root entry of a snapshot read with ``mapped=True`` or a ``scratch``): the
    addresses of the storages over memory lent for the read (a shard file's mapping, a staging
    slot). Restore copies them into the registered objects' own memory and must not hand them
    over: an object keeping one would keep a file mapped, or see the next snapshot's bytes."""

    kind: NodeKind
    value: Any  # for a DICT: dict[str, Entry]
    borrowed: frozenset = frozenset()
    differing: frozenset = frozenset()  # read with compare_ranks: entries the ranks held unalike
    from_slot: int = 0  # bytes viewed in a staging slot instead of read (ReadOptions.slot_copies)

    def plain(self) -> Any:
        if self.kind == NodeKind.DICT:
            return {k: e.plain() for k, e in self.value.items()}
        return self.value


def rebuild(tree: Any, leaf: Callable[[Leaf, Any], Any], allow_pickle: values.AllowPickle,
            path: str, unpickle: Optional[Callable[[bytes], Any]] = None) -> Entry:
    """The ``Entry`` tree of a state tree, every value decoded (``values.decode``, with its
    ``allow_pickle``; ``unpickle``, when given, turns a ``$pickle`` node's bytes into its value)
    and every ``Leaf`` by ``leaf(leaf, payload)``, which returns NotImplemented for a leaf it does
    not take. A module's state dict comes back as an ``OrderedDict`` with its ``_metadata``, as
    ``state_dict()`` made it. Malformed trees raise CorruptSnapshotError naming ``path``."""
    def decode_leaf(node: dict) -> Any:  # values.decode asks only for a node of one tag
        (tag, payload), = node.items()
        kind = _LEAF_OF_TAG.get(tag)
        return NotImplemented if kind is None else leaf(kind, payload)

    def decode(node: Any) -> Any:
        return values.decode(node, allow_pickle=allow_pickle, leaf=decode_leaf, unpickle=unpickle)

    top = Entry(NodeKind.DICT, {})
    dicts = {(): top}  # the dict entries made so far, by their keys
    for node in walk(tree, path):
        if node.kind is NodeKind.DICT:
            entry = dicts[node.keys] = Entry(NodeKind.DICT, {})
        else:
            entry = Entry(node.kind, _value(node, decode, path))
        dicts[node.keys[:-1]].value[node.keys[-1]] = entry
    return top


def _value(node: Node, decode: Callable[[Any], Any], path: str) -> Any:
    """The decoded value of an ``object``, ``tensor`` or ``value`` node."""
    value = decode(node.state)
    if node.kind is NodeKind.VALUE and isinstance(value, dict) and all(
            isinstance(k, str) for k in value):
        # the writer keeps a dict of str keys as a "dict" entry, never as a plain value: one
        # restored as a value would turn the slot into a dict that later snapshots cannot fill
        raise CorruptSnapshotError(f"{path}: malformed state tree (a dict of str keys as a "
                                   "plain value)")
    if node.has_metadata:  # a module's state dict: its _metadata carries per-module versions
        metadata = decode(node.metadata)
        if not isinstance(value, dict) or not _is_module_metadata(metadata):
            raise CorruptSnapshotError(f"{path}: malformed module state")
        value = collections.OrderedDict(value)
        value._metadata = metadata
    return value


def _is_module_metadata(metadata: Any) -> bool:
    """``state_dict()._metadata`` as torch writes it: module prefix -> {"version": int, ...}."""
    return isinstance(metadata, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and type(v.get("version", 0)) is int
        for k, v in metadata.items())
