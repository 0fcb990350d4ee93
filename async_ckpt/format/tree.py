"""The state tree of a shard's index (docs/FORMAT.md section 5): its node kinds and the one walker
that rebuilds it.

A node is an ``object``, ``tensor``, ``dict`` or ``value``; all but ``dict`` hold a value tree
(section 6) whose tags for tensors and torch's objects belong to the caller, who decodes them
with a ``leaf``. The read side rebuilds torch tensors (``read/snapshot.py``); the writer rebuilds
the same tree with stand-ins when it writes a snapshot in torch's own file format
(``format/native.py``). Nothing here imports torch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import CorruptSnapshotError
from . import values

NODE_KINDS = ("object", "tensor", "dict", "value")
MAX_TREE_DEPTH = 100


@dataclass
class Entry:
    """A restored entry, tagged with how it was captured (object, tensor, dict or value).

    ``borrowed`` (the root entry of a snapshot read with ``mapped=True`` or a ``scratch``): the
    addresses of the storages over memory lent for the read (a shard file's mapping, a staging
    slot). Restore copies them into the registered objects' own memory and must not hand them
    over: an object keeping one would keep a file mapped, or see the next snapshot's bytes."""

    kind: str
    value: Any  # for "dict": dict[str, Entry]
    borrowed: frozenset = frozenset()
    differing: frozenset = frozenset()  # read with compare_ranks: entries the ranks held unalike

    def plain(self) -> Any:
        if self.kind == "dict":
            return {k: e.plain() for k, e in self.value.items()}
        return self.value


def rebuild(tree: Any, leaf: Callable[[dict], Any], allow_pickle: values.AllowPickle, path: str,
            unpickle: Optional[Callable[[bytes], Any]] = None) -> Entry:
    """The ``Entry`` tree of a state tree, every value decoded with ``leaf`` for the caller's
    tags (``values.decode``, with its ``allow_pickle``; ``unpickle``, when given, turns a
    ``$pickle`` node's bytes into its value). A module's state dict comes back as an
    ``OrderedDict`` with its ``_metadata``, as ``state_dict()`` made it. Malformed trees raise
    CorruptSnapshotError naming ``path``."""
    def decode(node: Any) -> Any:
        return values.decode(node, allow_pickle=allow_pickle, leaf=leaf, unpickle=unpickle)

    def entry(node: Any, depth: int) -> Entry:
        if (not isinstance(node, dict) or node.get("kind") not in NODE_KINDS
                or depth > MAX_TREE_DEPTH):
            raise CorruptSnapshotError(f"{path}: malformed state tree")
        if node["kind"] == "dict":
            if not isinstance(node.get("entries"), dict):
                raise CorruptSnapshotError(f"{path}: malformed state tree")
            return Entry("dict", {k: entry(v, depth + 1) for k, v in node["entries"].items()})
        value = decode(node.get("state"))
        if node["kind"] == "value" and isinstance(value, dict) and all(
                isinstance(k, str) for k in value):
            # the writer keeps a dict of str keys as a "dict" entry, never as a plain value: one
            # restored as a value would turn the slot into a dict that later snapshots cannot fill
            raise CorruptSnapshotError(f"{path}: malformed state tree (a dict of str keys as a "
                                       "plain value)")
        if "metadata" in node:  # a module's state dict: its _metadata carries per-module versions
            metadata = decode(node["metadata"])
            if not isinstance(value, dict) or not _is_module_metadata(metadata):
                raise CorruptSnapshotError(f"{path}: malformed module state")
            value = collections.OrderedDict(value)
            value._metadata = metadata
        return Entry(node["kind"], value)

    if not isinstance(tree, dict) or tree.get("kind") != "dict":
        raise CorruptSnapshotError(f"{path}: the state tree's root is not a dict")
    return entry(tree, 0)


def _is_module_metadata(metadata: Any) -> bool:
    """``state_dict()._metadata`` as torch writes it: module prefix -> {"version": int, ...}."""
    return isinstance(metadata, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and type(v.get("version", 0)) is int
        for k, v in metadata.items())
