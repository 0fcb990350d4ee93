"""Helpers to fuzz real async_ckpt checkpoints: build one, mutate copies of it, check the outcome.

Used by ``tests/test_fuzz.py``; kept apart so that other tests can reuse the pieces:

- :func:`make_state` / :func:`train` / :func:`build_pristine`: a small real training state (a
  ``Linear(4, 3)`` model, AdamW after a step, a scheduler, a dict of plain values incl. a NumPy
  array, a compressible int tensor (``zstd`` codec) and a float pattern (``planes`` codec), a
  registered ``torch.Generator`` and ``numpy`` ``Generator``) and a directory with two committed
  snapshots (step 1 stored raw, step 2 with ``compression="zstd"``), kept in memory as bytes;
- :func:`rewrite_shard` / :func:`fix_manifest`: write a shard with a new index (same header and
  chunk bytes, new trailer with the XXH3-64 of the new index) and make the manifest's ``bytes``
  and ``index_xxh3`` agree, so that checksums prove nothing (the attacker model);
- the mutations (dataclasses with a readable ``repr``, which Hypothesis prints when a case fails)
  and their Hypothesis strategies (:func:`mutation_strategy`);
- :func:`hang_guard` (SIGALRM in the main thread), :class:`Sandbox` (sentinels around the
  checkpoint directory), :func:`diff` (bit-exact comparison), :func:`draw_in_child` (draws from
  every RNG in a forked child, so a crafted generator state that crashes the process is reported
  instead of killing the test run), and :class:`FuzzLog` (outcome counts and distinct failures).

Safety: every directory a mutated name can reach (``..``, ``../..``, absolute paths) lies inside a
per-case sandbox. Absolute paths in mutations are placeholders (``<abs:sentinel>``) that resolve
to paths inside the sandbox, never to a real system path such as ``/etc`` (the tests may run as
root), and generated text never contains ``/``.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import faulthandler
import json
import os
import pickle
import random
import shutil
import signal
import struct
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import xxhash
import zstandard
from hypothesis import strategies as st

# --- the on-disk format, from docs/FORMAT.md (not imported from the library under test) ---------

HEADER_SIZE = 16
STORAGE_ALIGNMENT = 64  # version 5: each storage's first chunk at a multiple of it
TRAILER = struct.Struct("<QQQ8s")  # index offset, index length, xxh3-64 of the index, magic
TRAILER_MAGIC = b"ACKPTEND"
MANIFEST = "manifest.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# --- the training state -----------------------------------------------------------------------

STEPS = (1, 2)
COMPRESSION = {1: None, 2: "zstd"}  # step 1 stored raw, step 2 with the zstd and planes codecs
PRISTINES = ("plain", "incremental")
"""The pristine checkpoints fuzzed: ``plain`` (steps 1 raw and 2 zstd, by two engines) and
``incremental`` (one zstd engine with ``incremental=True``: step 2 changes only part of the state,
so its shard refers to step 1's chunks, shard format 3 and manifest ``refers``)."""


def make_state(seed: int = 0) -> dict:
    """The registered state: the same keys, shapes and kinds whatever the seed."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    extra = {
        "epoch": seed, "name": "run-\u03b1", "ratio": 0.5, "big": 2**70, "nan": float("nan"),
        "pair": (1, "a"), "blob": b"\x00\xff",
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
        "zeros": torch.zeros(512, dtype=torch.int32),  # compresses whole: codec "zstd"
        "pattern": (torch.arange(512) % 4).float() + seed,  # floats, exponents repeat: "planes"
    }
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": extra,
             "gen": torch.Generator().manual_seed(seed + 1),
             "nprng": np.random.default_rng(seed + 2)}
    train(state)
    return state


def train(state: dict, everything: bool = True) -> None:
    """One training step that changes every entry (so the two snapshots differ everywhere), or
    with ``everything=False`` every entry but the ``zeros`` and ``pattern`` tensors (which an
    incremental snapshot then refers to)."""
    model, optimizer = state["model"], state["optimizer"]
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    state["scheduler"].step()
    state["extra"]["epoch"] += 1
    if everything:
        with torch.no_grad():
            state["extra"]["pattern"].add_(1)
            state["extra"]["zeros"][0] += 1
    torch.rand(1, generator=state["gen"])
    state["nprng"].random()
    random.random()
    np.random.random()


# --- the pristine checkpoint ------------------------------------------------------------------


@dataclass
class Shard:
    """One committed shard of the pristine checkpoint, parsed."""

    alias: str  # "step1-shard"
    relpath: str  # "step-000...1.abcd1234/rank-00000.ackpt"
    dir: str
    step: int
    data: bytes
    index: dict
    index_offset: int

    @property
    def prefix(self) -> bytes:
        """Header and chunks: everything before the index."""
        return self.data[:self.index_offset]


@dataclass
class Pristine:
    """The pristine checkpoint in memory, and what loading it returns."""

    files: dict[str, bytes]  # relpath -> bytes, every regular file under the directory
    dirs: list[str]  # relpaths of the directories under it
    manifest: dict
    shards: dict[str, Shard]  # alias -> shard
    refs: dict[int, tuple]  # step -> load(dir, step=step)
    aliases: dict[str, str]  # alias -> relpath: step1-shard, step2-shard, step1-dir, ...
    decoded: dict = field(default_factory=dict)  # (alias, storage, chunk) -> what its zstd frame holds
    chunk_data: dict = field(default_factory=dict)  # (alias, storage, chunk) -> the chunk's raw bytes
    _strategies: dict = field(default_factory=dict)

    def path_of(self, alias: str) -> str:
        return self.aliases.get(alias, alias)

    def shard_by_alias(self, alias: str) -> Shard:
        return self.shards[alias]

    def write(self, root: str, skip: Callable[[str], bool] = lambda name: False) -> None:
        """Write the pristine files under ``root`` (which must exist)."""
        for d in self.dirs:
            if not skip(d):
                os.makedirs(os.path.join(root, d), exist_ok=True)
        for rel, data in self.files.items():
            if not skip(rel):
                with open(os.path.join(root, rel), "wb") as f:
                    f.write(data)


def referring_storages(shard: Shard) -> list[int]:
    """The storages of ``shard`` that refer to an earlier snapshot's chunks (shard format 3)."""
    return [i for i, s in enumerate(shard.index["storages"]) if "ref" in s]


def stored_storages(shard: Shard) -> list[int]:
    """The storages of ``shard`` whose chunks it holds."""
    return [i for i, s in enumerate(shard.index["storages"]) if "chunks" in s]


def parse_shard(data: bytes) -> tuple[dict, int]:
    """The index of a well-formed shard and where it starts."""
    offset, length, digest, magic = TRAILER.unpack(data[-TRAILER.size:])
    assert magic == TRAILER_MAGIC and offset + length + TRAILER.size == len(data)
    blob = data[offset:offset + length]
    assert xxhash.xxh3_64_intdigest(blob) == digest
    return json.loads(blob), offset


def read_tree(root: str) -> tuple[dict[str, bytes], list[str]]:
    files, dirs = {}, []
    for parent, subdirs, names in os.walk(root):
        for d in subdirs:
            dirs.append(os.path.relpath(os.path.join(parent, d), root))
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files, sorted(dirs)


def build_pristine(root: str, variant: str = "plain") -> Pristine:
    """Two committed snapshots (steps 1 and 2, trained in between) written by real engines, as
    ``variant`` (one of ``PRISTINES``) says."""
    from async_ckpt import CheckpointEngine, load

    state = make_state(0)
    if variant == "incremental":
        with CheckpointEngine(root, state, compression="zstd", heartbeat_interval=None,
                              incremental=True) as engine:
            engine.snapshot(STEPS[0])
            engine.wait()  # committed: only then may step 2 refer to it
            train(state, everything=False)
            engine.snapshot(STEPS[1])
    else:
        for step in STEPS:
            with CheckpointEngine(root, state, compression=COMPRESSION[step],
                                  heartbeat_interval=None) as engine:
                engine.snapshot(step)
            train(state)
    files, dirs = read_tree(root)
    manifest = json.loads(files[MANIFEST])
    assert [s["step"] for s in manifest["snapshots"]] == list(STEPS), manifest
    shards, aliases = {}, {MANIFEST: MANIFEST}
    for record in manifest["snapshots"]:
        rel = os.path.join(record["dir"], record["shards"][0]["file"])
        index, offset = parse_shard(files[rel])
        alias = f"step{record['step']}-shard"
        shards[alias] = Shard(alias, rel, record["dir"], record["step"], files[rel], index, offset)
        aliases[alias] = rel
        aliases[f"step{record['step']}-dir"] = record["dir"]
    refs = {step: load(root, step=step) for step in STEPS}
    assert diff(refs[1], refs[2]) is not None, "the two snapshots must differ"
    pristine = Pristine(files, dirs, manifest, shards, refs, aliases)
    exercised = list(shards.values()) if variant == "incremental" else [shards["step2-shard"]]
    codecs = {c["codec"] for shard in exercised for s in shard.index["storages"]
              for c in s.get("chunks", ())}
    assert {"zstd", "planes"} <= codecs, f"{variant} must exercise zstd and planes, has {codecs}"
    if variant == "incremental":
        assert referring_storages(shards["step2-shard"]), "step 2 must refer to step 1"
        assert pristine.manifest["snapshots"][1].get("refers"), "the manifest must say so"
    for alias, shard in shards.items():
        for i, s in enumerate(shard.index["storages"]):
            for j, c in enumerate(s.get("chunks", ())):
                stored = shard.data[c["offset"]:c["offset"] + c["stored"]]
                raw = stored
                if c["codec"] == "zstd":
                    raw = pristine.decoded[alias, i, j] = zstandard.ZstdDecompressor().decompress(stored)
                elif c["codec"] == "planes":
                    low = sum(n for _, n in c["planes"][:-1])
                    top = pristine.decoded[alias, i, j] = zstandard.ZstdDecompressor().decompress(stored[low:])
                    planes = np.frombuffer(stored[:low] + top, np.uint8).reshape(s["itemsize"], -1)
                    raw = planes.T.tobytes()  # unshuffle: byte p of element i is planes[p, i]
                assert len(raw) == c["raw"]
                pristine.chunk_data[alias, i, j] = raw
    return pristine


# --- rewriting shards and the manifest (checksums recomputed: they prove nothing) -------------


def rewrite_shard(prefix: bytes, index_blob: bytes) -> tuple[bytes, str]:
    """A shard with ``prefix`` (header and chunks), the given index and a matching trailer;
    returns its bytes and the index checksum as the manifest records it."""
    digest = xxhash.xxh3_64_intdigest(index_blob)
    data = prefix + index_blob + TRAILER.pack(len(prefix), len(index_blob), digest, TRAILER_MAGIC)
    return data, f"{digest:016x}"


def fix_manifest(manifest: dict, shard_dir: str, size: int, index_xxh3: str) -> dict:
    """The manifest with the ``bytes``/``index_xxh3`` of the rank-0 shard in ``shard_dir`` (and
    the snapshot's ``stored_bytes``) updated."""
    manifest = copy.deepcopy(manifest)
    for record in manifest["snapshots"]:
        if record["dir"] == shard_dir:
            record["shards"][0]["bytes"] = size
            record["shards"][0]["index_xxh3"] = index_xxh3
            record["stored_bytes"] = size
    return manifest


def manifest_bytes(doc: Any, ctx: Optional[dict] = None, ensure_ascii: bool = True) -> bytes:
    """The manifest as the library writes it (compact), hostile values spliced in."""
    return dump_json(doc, ctx or {}, ensure_ascii=ensure_ascii, separators=(",", ":"))


def index_bytes(doc: Any, ctx: Optional[dict] = None, ensure_ascii: bool = True) -> bytes:
    """A shard index as the writer writes it (compact), hostile values spliced in."""
    return dump_json(doc, ctx or {}, ensure_ascii=ensure_ascii, separators=(",", ":"))


# --- hostile values ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    """A value to put into a JSON document. ``kind`` is "py" (a Python value, written by
    ``json.dumps(allow_nan=True)``), "raw" (JSON text spliced in as is: deep nesting, huge
    numbers) or "ctx" (resolved per case: absolute paths inside the sandbox, a pickle)."""

    label: str
    kind: str
    payload: Any

    def __repr__(self) -> str:
        return self.label

    def _repr_pretty_(self, printer, cycle) -> None:  # how Hypothesis prints a failing case
        printer.text(repr(self))


def _py(value: Any, label: Optional[str] = None) -> Hostile:
    text = label or repr(value)
    return Hostile(text if len(text) <= 80 else text[:60] + f"...<{len(text)} chars>", "py", value)


def _raw(text: str, label: str) -> Hostile:
    return Hostile(label, "raw", text)


def _ctx(name: str) -> Hostile:
    return Hostile(f"<{name}>", "ctx", name)


def nested(depth: int, kind: str) -> Hostile:
    if kind == "list":
        return _raw("[" * depth + "]" * depth, f"<list nested {depth} deep>")
    return _raw('{"a":' * depth + "1" + "}" * depth, f"<dict nested {depth} deep>")


def deep_long_keys(depth: int, key_chars: int, leaves: int) -> dict:
    """A state-tree node ``depth`` dicts deep, each keyed by a ``key_chars``-long name, over
    ``leaves`` plain values: key paths of ``depth * key_chars`` characters for every leaf."""
    node = {"kind": "dict", "entries": {str(j): {"kind": "value", "state": j}
                                        for j in range(leaves)}}
    for level in range(depth):
        node = {"kind": "dict", "entries": {"k" * key_chars + str(level): node}}
    return node


# Names that point out of the checkpoint directory, at itself, or are not names at all. Absolute
# paths are placeholders resolved inside the sandbox (see the module docstring).
PATH_LIKE = [
    "../x", "../outside.bin", "../sentinel", "../sentinel.txt", "..", "../..", "../../outer_sentinel",
    _ctx("abs:sentinel"), _ctx("abs:outside_file"), _ctx("abs:ckpt"), ".", "", "a/b", "x\x00y",
    "\x00", "manifest.json", "rank-00000.ackpt", ".lock-rank00000",
    "step-00000000000000000001.00000000", "step-00000000000000000002", "~", "-rf", " ",
]

_FIXED = [
    # wrong types
    [], {}, [1, 2], {"a": 1}, "x", "", True, False, None, 0.5, -0.0, 1e308, 0, 1, 2, [None], [[]],
    # integers at and past every boundary
    2**64, 2**80, -1, -2**63, 2**63, 2**63 - 1, 2**62, 2**31, 2**32, 2**30, 2**30 + 1, -(2**80),
    10**30,
    # non-finite numbers (what json.dumps(allow_nan=True) writes)
    float("nan"), float("inf"), float("-inf"),
    # long text
    _py("A" * 100_000, "'A' * 100000"), _py({"K" * 100_000: 1}, "{'K' * 100000: 1}"),
    _py(["x"] * 10_000, "['x'] * 10000"),
    # unicode: NUL, lone surrogates, BOM, right-to-left override, astral
    "\x00", "\ud800", "\udfff", "a\udcffb", "\ufeff", "\u202e", "\U0001f600", "\uffff",
    # tagged nodes of the value encoding, well-formed and not
    {"$tensor": 0}, {"$tensor": 11}, {"$tensor": 10**20}, {"$tensor": -1}, {"$tensor": "0"},
    {"$tensor": 0.0}, {"$dtype": "float32"}, {"$dtype": "qint8"}, {"$dtype": "nope"},
    {"$size": [2, 3]}, {"$size": [-1]}, {"$size": [2**70]}, {"$size": "x"},
    {"$device": "cpu"}, {"$device": "cuda:99"}, {"$device": "meta"}, {"$device": "bogus"},
    {"$int": "0x10"}, {"$int": "zz"}, {"$int": 5}, _py({"$int": "0x" + "f" * 100_000}, "{'$int': '0x' + 'f' * 100000}"),
    {"$float": "nan"}, {"$float": "inf"}, {"$float": "bogus"}, {"$float": 1.0},
    {"$str": "!!"}, {"$str": "gICA"}, {"$bytes": "===="}, {"$bytes": 5}, {"$bytearray": "AA=="},
    {"$tuple": 5}, {"$tuple": [1]}, {"$set": [[1], [2]]}, {"$set": [1, 1]}, {"$frozenset": [{}]},
    {"$dict": [[[1], 2]]}, {"$dict": [[1, 2], [1, 3]]}, {"$dict": 5}, {"$unknown": 1},
    {"$x": 1, "y": 2}, {"$$x": 1}, {"$": 1},
    {"$ndarray": {"dtype": "<f8", "shape": [2**40], "data": ""}},
    {"$ndarray": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}},
    {"$ndarray": {"dtype": "<f4", "shape": [-1], "data": ""}},
    {"$ndarray": {"dtype": "<f4", "shape": [1] * 65, "data": "AAAAAA=="}},
    {"$ndarray": {"dtype": "|b1", "shape": [1], "data": "Ag=="}},
    {"$npscalar": {"dtype": "<M8", "data": "AAAAAAAAAAA="}},
    {"$npscalar": {"dtype": "<f4", "data": ""}},
    _ctx("pickle"),
    # index-shaped values
    {"offset": 16, "stored": 2**62, "raw": 1, "xxh3": "0" * 16, "codec": "zstd"},
    {"offset": 16, "stored": 1, "raw": 2**30, "xxh3": "0" * 16, "codec": "raw"},
    {"nbytes": 2**40, "itemsize": 1, "float": False, "chunks": []},
    {"storage": 0, "offset": 0, "dtype": "float32", "shape": [2**31, 2**31], "stride": [0, 0]},
    {"storage": 0, "offset": 0, "dtype": "float32", "shape": [3, 4], "stride": [0, 0]},
    {"storage": 0, "offset": 2**62, "dtype": "float32", "shape": [1], "stride": [1]},
    {"storage": 0, "offset": 0, "dtype": "float32", "shape": [3, 4], "stride": [-4, 1]},
    {"storage": None, "offset": 0, "dtype": "float32", "shape": [0, 2**62], "stride": [1, 1]},
    {"kind": "value", "state": 1}, {"kind": "object", "state": None}, {"kind": "dict", "entries": 5},
    {"kind": "tensor", "state": {"$tensor": 0}}, {"kind": "bogus"},
    "float8_e4m3fn", "bfloat16", "complex128", "bool", "qint8", "quint4x2", "uint64", "bits8",
    "zstd", "planes", "raw", "big", "little", "PCG64", "MT19937", "Philox", "0" * 16, "f" * 16,
    ["zstd", 2**62], ["raw", -1], ["planes", 1], [["raw", 1]],
    # the classes of issue 28: a value for a registered object, dtypes torch cannot copy, small
    # storages behind huge stride-0 shapes, keys made to collide in Python's hash, deep trees of
    # long keys, long chains of references
    {"kind": "value", "state": "pwned"}, {"kind": "value", "state": {"a": 1}},
    {"kind": "value", "state": {"$tensor": 0}}, {"kind": "dict", "entries": {}},
    "quint8", "qint32", "quint2x4", "uint1", "uint7", "int1", "int4",
    {"storage": 0, "offset": 0, "dtype": "float32", "shape": [2**15, 2**15], "stride": [0, 0]},
    {"storage": 0, "offset": 0, "dtype": "uint8", "shape": [2**18, 2**18], "stride": [0, 0]},
    _py({"$dict": [[{"$int": hex(k * (2**61 - 1))}, 0] for k in range(1, 3001)]},
        "<$dict of 3000 int keys that share a hash>"),
    _py({"$set": [{"$int": hex(k * (2**61 - 1))} for k in range(1, 3001)]},
        "<$set of 3000 ints that share a hash>"),
    _py(deep_long_keys(40, 2000, 500), "<tree 40 deep of 2000-char keys, 500 leaves>"),
    _py([f"step-{i:020d}.{i:08x}" for i in range(20_000)], "<20000 snapshot directory names>"),
]

# Raw JSON text python's json module reads (and writes with allow_nan=True or not at all).
_RAW = [
    _raw("1" + "0" * 5000, "<int with 5001 digits>"),
    _raw("-" + "9" * 400, "<int with 400 digits>"),
    _raw("1e999", "1e999"), _raw("-1e999", "-1e999"), _raw("1e-400", "1e-400"),
    _raw("NaN", "NaN"), _raw("Infinity", "Infinity"), _raw("-Infinity", "-Infinity"),
    _raw('"\\ud800\\udc00"', "<escaped surrogate pair>"), _raw('"\\udc80"', "<escaped lone surrogate>"),
]

_text = st.lists(st.one_of(st.characters(exclude_characters="/"),
                           st.sampled_from(["\x00", "\ud800", "\udfff", "..", "$", "\\", "%s", "{}"])),
                 max_size=12).map("".join)


def hostile_values() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from([v if isinstance(v, Hostile) else _py(v) for v in _FIXED]),
        st.sampled_from([v if isinstance(v, Hostile) else _py(v) for v in PATH_LIKE]),
        st.sampled_from(_RAW),
        st.builds(nested, st.integers(50, 5000), st.sampled_from(["list", "dict"])),
        _text.map(_py),
        st.integers(-(2**70), 2**70).map(_py),
        st.floats().map(_py),
    )


def hostile_keys() -> st.SearchStrategy:
    return st.one_of(st.sampled_from(["extra", "$tensor", "$pickle", "$int", "kind", "state",
                                      "entries", "__proto__", "$$x", "$", "", "\x00", "\ud800",
                                      "K" * 100_000, "storages", "chunks", "replica", "rank"]),
                     _text)


# --- JSON documents with hostile values spliced in --------------------------------------------


def resolve(h: Hostile, ctx: dict, ensure_ascii: bool) -> str:
    """The JSON text of a hostile value in a case's context."""
    if h.kind == "raw":
        return h.payload
    value = h.payload
    if h.kind == "ctx":
        value = ctx[h.payload]
    return json.dumps(value, allow_nan=True, ensure_ascii=ensure_ascii)


def dump_json(doc: Any, ctx: dict, ensure_ascii: bool = True, **kw) -> bytes:
    """``json.dumps(doc, allow_nan=True)`` with every :class:`Hostile` replaced by its text.
    Without ``ensure_ascii`` the text is UTF-8 with lone surrogates kept (invalid UTF-8)."""
    hostile: dict[str, Hostile] = {}

    def swap(v):
        if isinstance(v, Hostile):
            token = f"@@fuzz-token-{len(hostile)}@@"
            hostile[token] = v
            return token
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(doc), allow_nan=True, ensure_ascii=ensure_ascii, **kw)
    for token, h in hostile.items():
        text = text.replace(json.dumps(token), resolve(h, ctx, ensure_ascii), 1)
    return text.encode("utf-8", "surrogatepass")


Path = tuple  # keys (str) and list positions (int) from the document's root


def fmt_path(path: Path) -> str:
    out = ""
    for k in path:
        if isinstance(k, int):
            out += f"[{k}]"
        elif k.isidentifier():
            out += f".{k}"
        else:
            out += f"[{k!r}]"
    return out.lstrip(".") or "<root>"


def _node(doc: Any, path: Path) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def edit_json(doc: Any, path: Path, op: str, value: Any = None, key: Any = None) -> Any:
    """A copy of ``doc`` with one edit at ``path``: replace, delete, duplicate (a list element),
    add_key (to an object), append (to a list)."""
    doc = copy.deepcopy(doc)
    if op == "replace" and not path:
        return value
    if op == "add_key":
        _node(doc, path)[key] = value
    elif op == "append":
        _node(doc, path).append(value)
    else:
        parent, last = _node(doc, path[:-1]), path[-1]
        if op == "replace":
            parent[last] = value
        elif op == "delete":
            del parent[last]
        elif op == "duplicate":
            parent.insert(last, copy.deepcopy(parent[last]))
        else:
            raise ValueError(op)
    return doc


def near_values(v: Any) -> list:
    """Values of about the same shape as ``v`` but just out of range: what a type check passes
    and a range check must catch."""
    if type(v) is bool:
        out = [not v, 0, 1, "true"]
    elif type(v) is int:
        out = [v - 1, v + 1, -v, 2 * v, 1000 * v + 7, v + 2**32, v + 2**64, 0, -1, 1, 10**6, 2**20,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, 624, 625, 16,
               float(v), str(v)]
    elif type(v) is float:
        out = [-v, 0.0, -0.0, 1e308, 5e-324, float("nan"), float("inf"), float("-inf"), str(v)]
        out += [int(v)] if v == v and abs(v) < 1e300 else []
    elif type(v) is str:
        out = ["", v + "x", v[:-1], v.upper(), v * 2, "0" * len(v), "-" + v, v + "=", v + "0" * 40,
               v[: len(v) // 2], v.encode("utf-8", "surrogatepass").hex()]
    elif type(v) is list:
        out = [v[:-1], v + v[-1:], [], v[::-1], [v], v * 2]
    elif type(v) is dict:
        out = [{}, [v], {k: v[k] for k in list(v)[:-1]}, dict(reversed(list(v.items())))]
    else:
        out = [0, "", [], {}]
    return [x for x in out if not (type(x) is type(v) and x == v)] or [None]


def _flat_paths(doc: Any, path: Path = (), keep: int = 3) -> list:
    """Every path in ``doc``, but of long lists only the first ``keep`` and the last element
    (a 625-word RNG state would drown everything else)."""
    out = [path] if path else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _flat_paths(v, path + (k,), keep)
    elif isinstance(doc, list):
        positions = range(len(doc)) if len(doc) <= keep + 1 else [*range(keep), len(doc) - 1]
        for i in positions:
            out += _flat_paths(doc[i], path + (i,), keep)
    return out


def json_edit_strategy(doc: Any, hotspots: tuple = (), stop_weight: int = 4,
                       only: Optional[list] = None) -> st.SearchStrategy:
    """(path, op, value, key) for one edit of ``doc``. The path comes, as likely each way, from a
    random walk from the root (each sibling as likely as the next), a random walk from one of
    ``hotspots`` (prefixes worth aiming at, e.g. RNG states), or uniformly from every field; the
    value is hostile (any type) or near the original (same shape, out of range)."""
    flat = _flat_paths(doc)
    hotspots = [h for h in hotspots if _has(doc, h)]

    @st.composite
    def walk(draw, start: Path) -> Path:
        path, node = start, _node(doc, start)
        while isinstance(node, (dict, list)) and node:
            if path and draw(st.integers(0, stop_weight)) == 0:
                break
            k = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
            path, node = path + (k,), node[k]
        return path

    paths = [walk(()), st.sampled_from(flat)]
    if hotspots:
        paths.append(st.sampled_from(hotspots).flatmap(walk))
    if only is not None:  # just these paths (and what lies under them)
        paths = [st.sampled_from([p for p in flat if any(p[:len(o)] == o for o in only)])]

    @st.composite
    def edits(draw) -> tuple:
        path = draw(st.one_of(*paths))
        node = _node(doc, path)
        parent = _node(doc, path[:-1]) if path else None
        ops = ["replace", "replace", "delete"] if path else []
        ops += ["add_key"] if isinstance(node, dict) else []
        ops += ["append"] if isinstance(node, list) else []
        ops += ["duplicate"] if isinstance(parent, list) else []
        op = draw(st.sampled_from(ops))
        value = key = None
        if op in ("replace", "add_key", "append"):
            near = st.sampled_from(near_values(node)).map(_py)
            value = draw(st.one_of(hostile_values(), near, near) if op == "replace"
                         else hostile_values())
        if op == "add_key":
            key = draw(hostile_keys())
        return path, op, value, key

    return edits()


def _has(doc: Any, path: Path) -> bool:
    try:
        _node(doc, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


# Prefixes of a shard index worth aiming at: the generator states (crafted ones crash C code),
# the tables a reader follows (storages, chunks, tensors) and the state tree's entries.
_RNG = ("tree", "entries", "__async_ckpt_rng__", "state")
INDEX_HOTSPOTS = (
    _RNG + ("python",), _RNG + ("python", "$tuple", 1, "$tuple"), _RNG + ("numpy",),
    _RNG + ("numpy", "$tuple"), _RNG + ("numpy", "$tuple", 1, "$ndarray"), _RNG + ("torch",),
    ("tree", "entries", "gen", "state"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "state"),
    ("tree", "entries", "optimizer", "state"), ("tree", "entries", "scheduler", "state"),
    ("tree", "entries", "model"), ("tree", "entries", "extra", "entries"), ("tree",),
    ("storages",), ("storages", 0), ("storages", 9, "chunks", 0), ("tensors",), ("tensors", 0),
)
# The generator states of a shard index, and the fields in them that C code uses as positions.
RNG_PATHS = [_RNG, ("tree", "entries", "gen", "state"), ("tree", "entries", "nprng", "state")]
RNG_POSITIONS = [
    _RNG + ("numpy", "$tuple", 2), _RNG + ("numpy", "$tuple", 3), _RNG + ("numpy", "$tuple", 4),
    _RNG + ("numpy", "$tuple", 1, "$ndarray"), _RNG + ("python", "$tuple", 1, "$tuple", 624),
    _RNG + ("python", "$tuple", 2), _RNG + ("python", "$tuple", 0),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "state", "state"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "state", "inc"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "has_uint32"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "uinteger"),
    ("tree", "entries", "nprng", "state", "numpy_bit_generator", "bit_generator"),
]

MANIFEST_HOTSPOTS = (("snapshots",), ("snapshots", 0), ("snapshots", 1),
                     ("snapshots", 0, "shards", 0), ("snapshots", 1, "shards", 0))


# --- mutations --------------------------------------------------------------------------------


class Mutation:
    """One change to a copy of the pristine checkpoint. ``relaxed``: the change, with checksums
    recomputed, legitimately describes other data (a different tensor view, a different value),
    so a successful read need not be bit-identical to a committed snapshot."""

    relaxed = False
    manifest_level = False  # whether it can make the manifest list nothing at all
    asked_bytes = 0  # bytes a read may rightly return or check beyond the pristine's (memory bound)

    def _repr_pretty_(self, printer, cycle) -> None:  # how Hypothesis prints a failing case
        printer.text(repr(self))

    def apply(self, p: Pristine, root: str, ctx: dict) -> None:
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class ByteFlip(Mutation):
    file: str
    flips: tuple  # (offset, xor mask)

    def __repr__(self):
        return f"ByteFlip({self.file}, " + ", ".join(f"@{o}^0x{m:02x}" for o, m in self.flips) + ")"

    def apply(self, p, root, ctx):
        data = bytearray(p.files[p.path_of(self.file)])
        for offset, mask in self.flips:
            data[offset] ^= mask
        _write(os.path.join(root, p.path_of(self.file)), bytes(data))

    @property
    def manifest_level(self):
        return self.file == MANIFEST


@dataclass(frozen=True, repr=False)
class Truncate(Mutation):
    file: str
    length: int

    def __repr__(self):
        return f"Truncate({self.file} to {self.length} bytes)"

    def apply(self, p, root, ctx):
        _write(os.path.join(root, p.path_of(self.file)), p.files[p.path_of(self.file)][:self.length])

    @property
    def manifest_level(self):
        return self.file == MANIFEST


@dataclass(frozen=True, repr=False)
class IndexEdit(Mutation):
    """A JSON edit of a shard's index; trailer and manifest fixed up to match."""

    shard: str
    path: Path
    op: str
    value: Any = None
    key: Any = None
    raw_utf8: bool = False  # write non-ASCII as UTF-8 (lone surrogates: invalid UTF-8)

    def __repr__(self):
        return f"IndexEdit({self.shard}: {_edit_text(self)})"

    @property
    def relaxed(self):
        return bool(self.path) and self.path[0] in ("tree", "tensors")

    def apply(self, p, root, ctx):
        shard = p.shard_by_alias(self.shard)
        doc = edit_json(shard.index, self.path, self.op, self.value, self.key)
        data, digest = rewrite_shard(shard.prefix, index_bytes(doc, ctx, not self.raw_utf8))
        _write(os.path.join(root, shard.relpath), data)
        _write(os.path.join(root, MANIFEST),
               manifest_bytes(fix_manifest(p.manifest, shard.dir, len(data), digest)))


@dataclass(frozen=True, repr=False)
class ManifestEdit(Mutation):
    """A JSON edit of manifest.json, or its snapshots list replaced by ``order`` (positions of
    the pristine snapshots, duplicates allowed)."""

    path: Path = ()
    op: str = "replace"
    value: Any = None
    key: Any = None
    raw_utf8: bool = False
    order: Optional[tuple] = None
    manifest_level = True

    def __repr__(self):
        if self.order is not None:
            return f"ManifestEdit(snapshots = pristine snapshots {list(self.order)})"
        return f"ManifestEdit({_edit_text(self)})"

    def apply(self, p, root, ctx):
        if self.order is not None:
            doc = copy.deepcopy(p.manifest)
            doc["snapshots"] = [copy.deepcopy(p.manifest["snapshots"][i]) for i in self.order]
        else:
            doc = edit_json(p.manifest, self.path, self.op, self.value, self.key)
        _write(os.path.join(root, MANIFEST), manifest_bytes(doc, ctx, not self.raw_utf8))


def _edit_text(m) -> str:
    what = {"replace": f"= {m.value!r}", "delete": "deleted", "duplicate": "duplicated",
            "append": f"append {m.value!r}", "add_key": f"add key {_short(m.key)} = {m.value!r}"}[m.op]
    return f"{fmt_path(m.path)} {what}" + (", raw UTF-8" if m.raw_utf8 else "")


FILE_KINDS = ["delete", "directory", "fifo", "symlink_outside", "symlink_outside_copy",
              "dangling_symlink", "symlink_loop", "empty_file"]
DIR_KINDS = ["delete", "file", "fifo", "symlink_outside_dir", "symlink_outside_copy",
             "dangling_symlink", "empty_dir"]


@dataclass(frozen=True, repr=False)
class ReplaceFile(Mutation):
    """A shard file, the manifest or a snapshot directory replaced by something else."""

    target: str
    kind: str

    def __repr__(self):
        return f"ReplaceFile({self.target} -> {self.kind})"

    @property
    def manifest_level(self):
        return self.target == MANIFEST

    def apply(self, p, root, ctx):
        path = os.path.join(root, p.path_of(self.target))
        remove(path)
        kind = self.kind
        if kind == "delete":
            return
        if kind == "directory" or kind == "empty_dir":
            os.mkdir(path)
        elif kind in ("file", "empty_file"):
            _write(path, b"")
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink_outside":
            os.symlink(ctx["abs:outside_file"], path)
        elif kind == "symlink_outside_dir":
            os.symlink(ctx["abs:sentinel"], path)
        elif kind == "symlink_outside_copy":  # the same bytes, outside the checkpoint directory
            copy_path = os.path.join(ctx["abs:mid"], "outside-copy-" + os.path.basename(path))
            remove(copy_path)  # left by an earlier case in the same sandbox
            if self.target.endswith("-dir"):
                os.mkdir(copy_path)
                for rel, data in p.files.items():
                    if rel.startswith(p.path_of(self.target) + os.sep):
                        _write(os.path.join(copy_path, os.path.basename(rel)), data)
            else:
                _write(copy_path, p.files[p.path_of(self.target)])
            os.symlink(copy_path, path)
        elif kind == "dangling_symlink":
            os.symlink(os.path.join(ctx["abs:mid"], "does-not-exist"), path)
        elif kind == "symlink_loop":
            os.symlink(os.path.basename(path), path)
        else:
            raise ValueError(kind)


_BOMB = {}


def _bomb(content_size: bool) -> bytes:
    if content_size not in _BOMB:
        _BOMB[content_size] = zstandard.ZstdCompressor(
            level=3, write_content_size=content_size).compress(b"\x00" * (64 << 20))
    return _BOMB[content_size]


def claim_size(frame: bytes, size: int) -> bytes:
    """``frame`` (a zstd frame without checksum and with a window of at most 128 KiB) with a
    header that declares ``size`` decoded bytes."""
    fhd = frame[4]
    single, fcs_flag, did = (fhd >> 5) & 1, fhd >> 6, fhd & 3
    header = 5 + (0 if single else 1) + (0, 1, 2, 4)[did] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
    assert not (fhd >> 2) & 1, "no checksum expected"
    return ZSTD_MAGIC + bytes([0xC0, 0x38]) + struct.pack("<Q", size) + frame[header:]


PAYLOADS = ["recompress_same", "claims_true_size", "claims_1TiB", "claims_2**62", "bomb_64MiB",
            "bomb_64MiB_no_size", "frame_short", "frame_long", "two_frames", "truncated_frame",
            "skippable_then_frame", "garbage", "empty"]


def payload_bytes(kind: str, data: bytes) -> bytes:
    """What to store instead of a zstd frame that decodes to ``data``."""
    z = zstandard.ZstdCompressor(level=3)
    if kind == "recompress_same":
        return zstandard.ZstdCompressor(level=19).compress(data)
    if kind == "claims_true_size":
        return claim_size(z.compress(data), len(data))
    if kind == "claims_1TiB":
        return claim_size(z.compress(data), 1 << 40)
    if kind == "claims_2**62":
        return claim_size(z.compress(data), 1 << 62)
    if kind == "bomb_64MiB":
        return _bomb(True)
    if kind == "bomb_64MiB_no_size":
        return _bomb(False)
    if kind == "frame_short":
        return z.compress(data[:-1])
    if kind == "frame_long":
        return z.compress(data + b"\x00")
    if kind == "two_frames":
        return z.compress(data) + z.compress(data)
    if kind == "truncated_frame":
        frame = z.compress(data)
        return frame[:len(frame) // 2]
    if kind == "skippable_then_frame":
        return b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"skip" + z.compress(data)
    if kind == "garbage":
        return ZSTD_MAGIC + bytes(range(7, 250, 3))
    if kind == "empty":
        return b""
    raise ValueError(kind)


# Payloads that decode to exactly the original bytes: a reader may accept them.
SAME_DATA_PAYLOADS = {"recompress_same", "claims_true_size"}


@dataclass(frozen=True, repr=False)
class ChunkPayload(Mutation):
    """A zstd chunk (or the zstd plane of a planes chunk) replaced by another payload, with the
    chunk table, chunk checksum, later offsets, trailer and manifest all fixed up."""

    shard: str
    storage: int
    chunk: int
    payload: str

    def __repr__(self):
        return f"ChunkPayload({self.shard}: storages[{self.storage}].chunks[{self.chunk}] <- {self.payload})"

    def apply(self, p, root, ctx):
        data, digest = chunk_replaced(p, self.shard, self.storage, self.chunk, self.payload)
        shard = p.shard_by_alias(self.shard)
        _write(os.path.join(root, shard.relpath), data)
        _write(os.path.join(root, MANIFEST),
               manifest_bytes(fix_manifest(p.manifest, shard.dir, len(data), digest)))


def chunk_replaced(p: Pristine, alias: str, si: int, ci: int, payload: str) -> tuple[bytes, str]:
    """The shard with the zstd frame of one chunk (or of its zstd plane) replaced."""
    new = payload_bytes(payload, p.decoded[alias, si, ci])

    def edit(c: dict, stored: bytes) -> bytes:
        if c["codec"] == "planes":
            low = sum(n for _, n in c["planes"][:-1])
            c["planes"][-1][1] = len(new)
            return stored[:low] + new
        return new

    return rebuild_shard(p, alias, {(si, ci): edit})


def rebuild_shard(p: Pristine, alias: str, edits: dict) -> tuple[bytes, str]:
    """The shard rewritten with ``edits[(storage, chunk)](chunk_dict, stored) -> new stored`` (the
    function may change the chunk's other fields): checksums of edited chunks, every offset, the
    index and the trailer recomputed; returns the bytes and the index checksum."""
    shard = p.shard_by_alias(alias)
    index = copy.deepcopy(shard.index)
    body = bytearray(shard.data[:HEADER_SIZE])
    for i, s in enumerate(index["storages"]):
        for j, c in enumerate(s.get("chunks", ())):
            if j == 0 and index["format_version"] >= 5:  # each storage aligned, zeros before it
                body += bytes(-len(body) % STORAGE_ALIGNMENT)
            stored = shard.data[c["offset"]:c["offset"] + c["stored"]]
            if (i, j) in edits:
                stored = edits[i, j](c, stored)
                c["xxh3"] = xxhash.xxh3_64_hexdigest(stored)
            c["offset"], c["stored"] = len(body), len(stored)
            body += stored
    return rewrite_shard(bytes(body), index_bytes(index))


@dataclass(frozen=True, repr=False)
class TensorBytes(Mutation):
    """The data of one storage changed (``value`` written as a ``width``-byte little-endian int
    at ``offset``, modulo the storage size) and re-encoded (zstd stays zstd, planes becomes raw),
    with every checksum fixed up. Any data is well-formed, so a read may succeed with it
    (``relaxed``); a crafted generator state must still never crash a draw."""

    shard: str
    storage: int
    offset: int
    width: int
    value: int
    relaxed = True

    def __repr__(self):
        return (f"TensorBytes({self.shard}: storages[{self.storage}] bytes "
                f"{self.offset}..+{self.width} = {self.value:#x})")

    def apply(self, p, root, ctx):
        data, digest = tensor_bytes_replaced(p, self.shard, self.storage, self.offset, self.width,
                                             self.value)
        shard = p.shard_by_alias(self.shard)
        _write(os.path.join(root, shard.relpath), data)
        _write(os.path.join(root, MANIFEST),
               manifest_bytes(fix_manifest(p.manifest, shard.dir, len(data), digest)))


def tensor_bytes_replaced(p: Pristine, alias: str, si: int, offset: int, width: int,
                          value: int) -> tuple[bytes, str]:
    storage = p.shard_by_alias(alias).index["storages"][si]
    raw = bytearray(b"".join(p.chunk_data[alias, si, j] for j in range(len(storage["chunks"]))))
    if raw:
        offset %= len(raw)
        patch = (value % 2 ** (8 * width)).to_bytes(width, "little")[:len(raw) - offset]
        raw[offset:offset + len(patch)] = patch
    edits, start = {}, 0
    for j, c in enumerate(storage["chunks"]):
        piece = bytes(raw[start:start + c["raw"]])
        start += c["raw"]

        def edit(c: dict, stored: bytes, piece=piece) -> bytes:
            if c["codec"] == "zstd":
                return zstandard.ZstdCompressor(level=3).compress(piece)
            c["codec"] = "raw"
            c.pop("planes", None)
            return piece

        edits[si, j] = edit
    return rebuild_shard(p, alias, edits)


@dataclass(frozen=True, repr=False)
class MisalignedViews(Mutation):
    """A shard laid out again as an older version writes it (4: chunks back to back, no
    alignment) behind a filler storage of ``shift`` bytes, so that its storages start off their
    dtypes' alignment; and tensor ``retype`` (if any) made a stride-0 view of ``length`` elements
    of ``dtype`` (the view of issue 40 whose ``clone`` crashed on a misaligned mapping)."""

    shard: str
    shift: int
    retype: Optional[int] = None
    dtype: str = "complex128"
    length: int = 1000346

    relaxed = True  # other storages numbers and, retyped, other data

    def __repr__(self):
        what = "" if self.retype is None else (
            f", tensor {self.retype} as {self.dtype}[{self.length}] stride 0")
        return f"MisalignedViews({self.shard}: storages shifted by {self.shift}{what})"

    def apply(self, p, root, ctx):
        shard = p.shard_by_alias(self.shard)
        index = copy.deepcopy(shard.index)
        area = [bytes(self.shift)]
        position = HEADER_SIZE + self.shift
        for storage in index["storages"]:
            for chunk in storage.get("chunks", ()):
                area.append(shard.data[chunk["offset"]:chunk["offset"] + chunk["stored"]])
                chunk["offset"] = position
                position += chunk["stored"]
        filler = {"nbytes": self.shift, "itemsize": 1, "float": False, "chunks": [
            {"offset": HEADER_SIZE, "stored": self.shift, "raw": self.shift,
             "xxh3": xxhash.xxh3_64_hexdigest(bytes(self.shift)), "codec": "raw"}]}
        index["storages"].insert(0, filler)
        for t in index["tensors"]:
            if type(t.get("storage")) is int and "rank" not in t:
                t["storage"] += 1
        if self.retype is not None and self.retype < len(index["tensors"]):
            t = index["tensors"][self.retype]
            if type(t.get("storage")) is int:
                t.update(dtype=self.dtype, shape=[self.length], stride=[0], offset=0)
        index["format_version"] = 4
        header = shard.data[:8] + struct.pack("<II", 4, 0)
        data, digest = rewrite_shard(header + b"".join(area), index_bytes(index))
        _write(os.path.join(root, shard.relpath), data)
        _write(os.path.join(root, MANIFEST),
               manifest_bytes(fix_manifest(p.manifest, shard.dir, len(data), digest)))


# --- strategies -------------------------------------------------------------------------------

BLOATS = {  # what a Bloat makes huge, in the manifest or in a shard's index
    "manifest": ["world_size_listed", "world_size", "whitespace", "extra_list", "extra_string",
                 "dropped"],
    "index": ["value_list", "value_nested", "value_string", "value_dict", "whitespace",
              "tensor_records", "empty_storages", "one_zstd_chunk", "stride0"],
}
BLOAT_SIZES = [2**10, 2**14, 2**17, 2**20, 2**21, 2**26]  # counts, bytes, elements
_COUNT, _BYTES = 2**21, 2**26  # beyond these, building the case costs the campaign, not the reader


@dataclass(frozen=True, repr=False)
class Bloat(Mutation):
    """A count or a value made huge (issue 40): ``n`` shard records, ranks, list elements,
    characters, spaces, tensor records or storages; ``one_zstd_chunk``: a storage of ``n`` zero
    bytes stored as one zstd chunk (a few KiB on disk); ``stride0``: a tensor expanded by a stride
    of 0 to ``n`` elements. Checksums and the manifest fixed up. Sizes over what the library
    refuses unread are capped where writing them would only cost the campaign time."""

    target: str  # MANIFEST or a shard alias
    what: str
    n: int

    def __repr__(self):
        return f"Bloat({self.target}: {self.what} x {self.n})"

    @property
    def relaxed(self):  # other, well-formed data with a valid structure
        return self.what in ("value_list", "value_nested", "value_string", "value_dict",
                             "tensor_records", "one_zstd_chunk", "stride0")

    @property
    def manifest_level(self):
        return self.target == MANIFEST

    @property
    def asked_bytes(self) -> int:
        """The bytes a read of this snapshot may rightly take: a storage of that many zeros, a
        tensor that many bytes large once expanded (what an export writes). At most 64 MiB."""
        return min(self.n, 2**26) if self.what in ("one_zstd_chunk", "stride0") else 0

    def apply(self, p, root, ctx):
        if self.target == MANIFEST:
            doc = copy.deepcopy(p.manifest)
            last = doc["snapshots"][-1]
            n = min(self.n, _COUNT)
            if self.what == "world_size_listed":
                last["world_size"] = n
                last["shards"] = [dict(last["shards"][0], rank=r, file=f"rank-{r:05d}.ackpt")
                                  for r in range(n)]
            elif self.what == "world_size":
                last["world_size"] = self.n
            elif self.what == "extra_list":
                doc["extra"] = {"x": [0] * min(self.n, _COUNT)}
            elif self.what == "extra_string":
                doc["extra"] = {"x": "y" * min(self.n, _BYTES)}
            elif self.what == "dropped":
                doc["dropped"] = [{"step": 0, "dir": last["dir"]}] * n
            text = manifest_bytes(doc)
            if self.what == "whitespace":
                text = text[:1] + b" " * min(self.n, _BYTES) + text[1:]
            _write(os.path.join(root, MANIFEST), text)
            return
        shard = p.shard_by_alias(self.target)
        index, prefix = copy.deepcopy(shard.index), shard.prefix
        entries = index["tree"]["entries"]
        value_key = "extra" if "extra" in entries else next(iter(entries))
        n = min(self.n, _COUNT)
        if self.what == "value_list":
            entries[value_key] = {"kind": "value", "state": [0] * n}
        elif self.what == "value_nested":
            entries[value_key] = {"kind": "value", "state": [[]] * n}
        elif self.what == "value_string":
            entries[value_key] = {"kind": "value", "state": "y" * min(self.n, _BYTES)}
        elif self.what == "value_dict":
            entries[value_key] = {"kind": "value", "state": {f"k{i}": 0 for i in range(n)}}
        elif self.what == "tensor_records":
            index["tensors"] = index["tensors"] + [index["tensors"][0]] * n
        elif self.what == "empty_storages":
            index["storages"] = index["storages"] + [{"nbytes": 0, "itemsize": 1, "float": False,
                                                      "chunks": []}] * n
        elif self.what == "one_zstd_chunk":
            prefix = _one_zstd_storage(index, prefix, self.asked_bytes)
        elif self.what == "stride0":
            t = index["tensors"][0]
            t["shape"], t["stride"] = [self.asked_bytes // _ITEMSIZE.get(t["dtype"], 8)], [0]
        blob = index_bytes(index)
        if self.what == "whitespace":
            blob = blob[:1] + b" " * min(self.n, _BYTES) + blob[1:]
        data, digest = rewrite_shard(prefix, blob)
        _write(os.path.join(root, shard.relpath), data)
        _write(os.path.join(root, MANIFEST),
               manifest_bytes(fix_manifest(p.manifest, shard.dir, len(data), digest)))


_ZEROS: dict = {}
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def _one_zstd_storage(index: dict, prefix: bytes, size: int) -> bytes:
    """The data area with the first stored storage replaced by one zstd chunk of ``size`` zero
    bytes (its tensors keep their views, now of zeros), the later chunks moved."""
    i = next(i for i, s in enumerate(index["storages"]) if s.get("chunks"))
    storage = index["storages"][i]
    first, last = storage["chunks"][0], storage["chunks"][-1]
    start, end = first["offset"], last["offset"] + last["stored"]
    size -= size % storage["itemsize"]
    if size not in _ZEROS:
        _ZEROS[size] = zstandard.ZstdCompressor(level=3).compress(bytes(size))
    stored = _ZEROS[size]
    storage["nbytes"] = size
    storage["chunks"] = [{"offset": start, "stored": len(stored), "raw": size, "codec": "zstd",
                          "xxh3": xxhash.xxh3_64_hexdigest(stored)}]
    shift = len(stored) - (end - start)
    for other in index["storages"][i + 1:]:
        for c in other.get("chunks", ()):
            c["offset"] += shift
    return prefix[:start] + stored + prefix[end:]


def _bloats(p):
    targets = [(MANIFEST, w) for w in BLOATS["manifest"]] + [
        (alias, w) for alias in sorted(p.shards) for w in BLOATS["index"]]
    long_run = "ASYNC_CKPT_FUZZ_CASES" in os.environ  # the suite's cases stay cheap to build;
    sizes = BLOAT_SIZES if long_run else BLOAT_SIZES[:2]  # tests/test_memory.py has large ones
    return st.builds(lambda tw, n: Bloat(tw[0], tw[1], n), st.sampled_from(targets),
                     st.sampled_from(sizes))


MUTATION_KINDS = ["byte_flip", "truncate", "index_json", "manifest_json", "replace_file",
                  "chunk_data", "misaligned_view", "huge_counts"]
RESTORE_ONLY_KINDS = ["rng_state", "hyper_parameter"]  # only restore() loads generator states,
# and checks hyper-parameters against live objects
_FLIP_FILES = [MANIFEST, "step1-shard", "step2-shard"]


def _regions(p: Pristine, alias: str) -> dict[str, tuple[int, int]]:
    """Byte ranges [lo, hi) of a file worth aiming at."""
    n = len(p.files[p.path_of(alias)])
    if alias == MANIFEST:
        return {"any": (0, n)}
    shard = p.shard_by_alias(alias)
    return {"any": (0, n), "header": (0, HEADER_SIZE), "chunks": (HEADER_SIZE, shard.index_offset),
            "index": (shard.index_offset, n - TRAILER.size), "trailer": (n - TRAILER.size, n)}


def _offsets(p: Pristine, alias: str) -> st.SearchStrategy:
    return st.one_of(*(st.integers(lo, hi - 1) for lo, hi in _regions(p, alias).values()))


def _byte_flips(p):
    def flips(alias):
        return st.lists(st.tuples(_offsets(p, alias), st.integers(1, 255)), min_size=1,
                        max_size=8, unique_by=lambda f: f[0]).map(
            lambda fl: ByteFlip(alias, tuple(fl)))
    return st.one_of(*(flips(alias) for alias in _FLIP_FILES))


def _truncations(p):
    return st.one_of(*(_offsets(p, alias).map(lambda n, a=alias: Truncate(a, n))
                       for alias in _FLIP_FILES))


def _index_edits(p):
    def edits(alias):
        shard = p.shard_by_alias(alias)
        hotspots = INDEX_HOTSPOTS + tuple(("storages", i, "ref") for i in referring_storages(shard))
        return st.tuples(json_edit_strategy(shard.index, hotspots),
                         st.booleans()).map(
            lambda e, a=alias: IndexEdit(a, e[0][0], e[0][1], e[0][2], e[0][3], e[1]))
    return st.one_of(*(edits(alias) for alias in sorted(p.shards)))


def _manifest_edits(p):
    count = len(p.manifest["snapshots"])
    path_like = [v if isinstance(v, Hostile) else _py(v) for v in PATH_LIKE]
    names = st.builds(  # the fields that name files and directories
        lambda path, value: ManifestEdit(path, "replace", value),
        st.sampled_from([("snapshots", i, "dir") for i in range(count)]
                        + [("snapshots", i, "shards", 0, "file") for i in range(count)]),
        st.one_of(st.sampled_from(path_like), st.sampled_from(path_like), _text.map(_py)))
    orders = st.lists(st.integers(0, count - 1), max_size=5).map(
        lambda o: ManifestEdit(order=tuple(o)))
    refers = tuple(("snapshots", i, "refers") for i, s in enumerate(p.manifest["snapshots"])
                   if "refers" in s)
    anything = st.tuples(json_edit_strategy(p.manifest, MANIFEST_HOTSPOTS + refers, stop_weight=6),
                         st.booleans()).map(
        lambda e: ManifestEdit(e[0][0], e[0][1], e[0][2], e[0][3], e[1]))
    return st.one_of(anything, names, orders, names)


def _replacements(p):
    return st.one_of(*(st.sampled_from(DIR_KINDS if t.endswith("-dir") else FILE_KINDS).map(
        lambda kind, t=t: ReplaceFile(t, kind))
        for t in ["step1-shard", "step2-shard", MANIFEST, "step1-dir", "step2-dir"]))


_BYTE_VALUES = [0, 1, 0x7F, 0x80, 0xFF, 623, 624, 625, 626, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1,
                2**63 - 1, 2**63, 2**64 - 1, 0x7FF8000000000001, 0xFFF0000000000000, 0x7FC00001]


def _rng_storages(shard: Shard) -> list[int]:
    """The storages that hold torch generator states (a registered Generator, the global one)."""
    found = []
    for path in (("tree", "entries", "gen", "state", "torch_generator", "$tensor"),
                 _RNG + ("torch", "$tensor")):
        if _has(shard.index, path):
            found.append(shard.index["tensors"][_node(shard.index, path)]["storage"])
    stored = stored_storages(shard)
    return [i for i in found if i in stored] or stored[:1]


def _chunk_data(p):
    payloads = st.builds(lambda where, payload: ChunkPayload(*where, payload),
                         st.sampled_from(sorted(p.decoded)), st.sampled_from(PAYLOADS))

    def tensor_bytes(alias):
        shard = p.shard_by_alias(alias)
        storages = st.one_of(st.sampled_from(_rng_storages(shard)),
                             st.sampled_from(stored_storages(shard)))
        return st.builds(lambda si, off, width, value, a=alias: TensorBytes(a, si, off, width, value),
                         storages, st.one_of(st.integers(0, 40), st.integers(0, 2**16)),
                         st.sampled_from([1, 2, 4, 8]),
                         st.one_of(st.sampled_from(_BYTE_VALUES), st.integers(0, 2**64 - 1)))

    return st.one_of(payloads, *(tensor_bytes(alias) for alias in sorted(p.shards)))


def _rng_states(p):
    """Crafted generator states of the newest snapshot (what restore() loads): JSON edits of the
    saved states, out-of-range values of the fields C code uses as positions, and the bytes of
    the torch generator states (their Mersenne Twister header first)."""
    alias = f"step{STEPS[-1]}-shard"
    index = p.shard_by_alias(alias).index
    edits = st.tuples(json_edit_strategy(index, only=RNG_PATHS), st.booleans()).map(
        lambda e: IndexEdit(alias, e[0][0], e[0][1], e[0][2], e[0][3], e[1]))
    positions = st.sampled_from([q for q in RNG_POSITIONS if _has(index, q)]).flatmap(
        lambda q: st.sampled_from(near_values(_node(index, q))).map(
            lambda v: IndexEdit(alias, q, "replace", _py(v))))
    tensor_bytes = st.builds(
        lambda si, off, width, value: TensorBytes(alias, si, off, width, value),
        st.sampled_from(_rng_storages(p.shard_by_alias(alias))),
        st.one_of(st.integers(0, 24), st.integers(0, 6000)), st.sampled_from([1, 4, 8]),
        st.one_of(st.sampled_from(_BYTE_VALUES), st.integers(0, 2**64 - 1)))
    return st.one_of(edits, positions, positions, tensor_bytes)


WIDE_DTYPES = ["complex128", "complex64", "float64", "int64", "float32", "int32", "bfloat16",
               "complex32"]


def _misaligned_views(p):
    return st.builds(
        MisalignedViews, st.sampled_from(sorted(p.shards)), st.integers(1, 63),
        st.one_of(st.none(), st.integers(0, 12)), st.sampled_from(WIDE_DTYPES),
        st.one_of(st.just(1000346), st.integers(1, 64), st.just(2**40), st.just(2**61)))
# (lengths: issue 40's view, small ones, more than memory once copied whole, more than a tensor
# can hold once copied whole; not a few GB, which an export with that much memory copies, slowly)


_OPTIMIZER = ("tree", "entries", "optimizer", "state")
_SCHEDULER = ("tree", "entries", "scheduler", "state")
_KERNEL_OPTIONS = ["differentiable", "fused", "foreach", "capturable"]
WRONG_TYPED = [_py("0.01"), _py(None), _py(True), _py(False), _py([0.9, 0.999, 0.5]), _py([]),
               _py({"$tuple": ["0.9", 0.999]}), _py({"a": 1}), _py(-1), _py(10**30),
               _py({"$int": "0x" + "f" * 40}), _py({"$bytes": "AA=="}), _py(1e308),
               _py({"$float": "nan"}), _py({"$tensor": 0})]


def _hyper_parameters(p):
    """Hyper-parameters of another type (or a key too many or too few) in the newest snapshot's
    optimizer groups, per-parameter state (``step``, the moments) and scheduler state, and the
    optimizer's kernel options turned on."""
    alias = f"step{STEPS[-1]}-shard"
    index = p.shard_by_alias(alias).index
    group = _OPTIMIZER + ("param_groups", 0)
    group_keys = sorted(k for k in _node(index, group) if k != "params")
    scheduler_keys = sorted(_node(index, _SCHEDULER))
    per_parameter = _OPTIMIZER + ("state", "$dict")  # {parameter id: its state}, int keys
    parameter_keys = [per_parameter + (n, 1, k) for n, (_, s) in
                      enumerate(_node(index, per_parameter)) for k in sorted(s)]
    replaced = st.builds(lambda path, value: IndexEdit(alias, path, "replace", value),
                         st.one_of(st.sampled_from([group + (k,) for k in group_keys]),
                                   st.sampled_from(parameter_keys),
                                   st.sampled_from([_SCHEDULER + (k,) for k in scheduler_keys])),
                         st.sampled_from(WRONG_TYPED))
    kernel = st.builds(lambda key, value: IndexEdit(alias, group, "add_key", _py(value), key),
                       st.sampled_from(_KERNEL_OPTIONS + ["bogus"]),
                       st.sampled_from([True, False, None]))
    removed = st.sampled_from([group + (k,) for k in group_keys]
                              + [_SCHEDULER + (k,) for k in scheduler_keys]).map(
        lambda path: IndexEdit(alias, path, "delete"))
    return st.one_of(replaced, replaced, kernel, removed)


def mutation_strategy(p: Pristine, kind: str) -> st.SearchStrategy:
    """The strategy of one kind of mutation of ``p`` (see MUTATION_KINDS), or of all of them."""
    if kind not in p._strategies:
        make = {"byte_flip": _byte_flips, "truncate": _truncations, "index_json": _index_edits,
                "manifest_json": _manifest_edits, "replace_file": _replacements,
                "chunk_data": _chunk_data, "rng_state": _rng_states,
                "misaligned_view": _misaligned_views, "hyper_parameter": _hyper_parameters,
                "huge_counts": _bloats}
        p._strategies[kind] = (st.one_of(*(m(p) for m in make.values())) if kind == "any"
                               else make[kind](p))
    return p._strategies[kind]


# --- the sandbox around a checkpoint directory ------------------------------------------------


class Sandbox:
    """``base/mid/ckpt`` with sentinels where mutated names point: ``../sentinel`` (a directory),
    ``../sentinel.txt``, ``../outside.bin`` (the target of symlinks out of the directory) and
    ``../../outer_sentinel``. Names with at most two ``..`` stay inside ``base``."""

    def __init__(self, parent: str):
        self.base = tempfile.mkdtemp(prefix="case-", dir=parent)
        self.mid = os.path.join(self.base, "mid")
        self.ckpt = os.path.join(self.mid, "ckpt")
        self.out = os.path.join(self.base, "out")
        self.pwned = os.path.join(self.mid, "PWNED-by-pickle")
        for d in (self.mid, self.ckpt, self.out):
            os.makedirs(d, exist_ok=True)
        self.sentinels = {
            os.path.join(self.mid, "sentinel", "keep.txt"): b"sentinel dir\n",
            os.path.join(self.mid, "sentinel.txt"): b"sentinel file\n",
            os.path.join(self.mid, "outside.bin"): b"not a shard, outside the checkpoint\n" * 4,
            os.path.join(self.base, "outer_sentinel", "keep.txt"): b"outer sentinel\n",
        }
        for path, data in self.sentinels.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write(path, data)
        self.ctx = {
            "abs:sentinel": os.path.join(self.mid, "sentinel"),
            "abs:outside_file": os.path.join(self.mid, "outside.bin"),
            "abs:ckpt": self.ckpt, "abs:mid": self.mid,
            "pickle": {"$pickle": base64.b64encode(pickle.dumps(_MkdirOnLoad(self.pwned), protocol=5)).decode()},
        }

    def problems(self) -> list[tuple[str, str]]:
        """(rule, what) for everything that went missing or appeared that must not have."""
        found = []
        for path, data in self.sentinels.items():
            try:
                with open(path, "rb") as f:
                    if f.read() != data:
                        found.append(("stray deletion", f"sentinel {path} was changed"))
            except OSError:
                found.append(("stray deletion", f"sentinel {path}, outside the checkpoint "
                              "directory, was deleted"))
        if not os.path.isdir(self.ckpt) or os.path.islink(self.ckpt):
            found.append(("checkpoint dir deleted", f"the checkpoint directory {self.ckpt} itself was deleted"))
        if os.path.lexists(self.pwned):
            found.append(("code from the file ran", f"a $pickle node was unpickled: it created {self.pwned}"))
        return found

    def repair(self) -> None:
        """Put back sentinels that a case deleted and remove what a pickle created."""
        for path, data in self.sentinels.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write(path, data)
        if os.path.lexists(self.pwned):
            remove(self.pwned)

    def reset_ckpt(self, keep: Callable[[str], bool] = lambda name: False) -> None:
        """Empty the checkpoint directory, but for the names ``keep`` accepts."""
        if not os.path.isdir(self.ckpt) or os.path.islink(self.ckpt):
            remove(self.ckpt)
            os.makedirs(self.ckpt)
        for name in os.listdir(self.ckpt):
            if not keep(name):
                remove(os.path.join(self.ckpt, name))

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


class _MkdirOnLoad:
    """Unpickling this creates a directory: proof that a reader ran code from the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def remove(path: str) -> None:
    """Remove whatever is at ``path`` (never following a symlink)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _short(v: Any) -> str:
    try:
        text = repr(v)
    except ValueError:  # an int of more than 4300 digits
        text = f"<{type(v).__name__} that repr() refuses>"
    return text if len(text) <= 60 else text[:40] + f"...<{len(text)} chars>"


# --- running targets --------------------------------------------------------------------------


class FuzzHang(BaseException):
    """Raised in the main thread when a target runs past its time: a BaseException, so that the
    library's ``except Exception`` cannot swallow it."""


@contextlib.contextmanager
def hang_guard(seconds: float, what: str):
    """Raise FuzzHang in the main thread if the body runs longer than ``seconds`` (a blocking
    open() of a FIFO is interrupted too: the handler raises, so the call is not retried)."""

    def on_alarm(signum, frame):
        raise FuzzHang(f"hang: {what} did not return within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def crash_breadcrumb(path: str, description: str, backstop_s: float):
    """Write what the current case is to ``path`` before running it, and have faulthandler dump
    every thread's stack there and end the process if the case gets stuck in C code for
    ``backstop_s`` (where SIGALRM cannot interrupt it). After a hard crash, ``path`` names the
    mutation that caused it."""
    with open(path, "w") as f:
        f.write(description + "\n")
        f.flush()
        faulthandler.dump_traceback_later(backstop_s, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def safe_str(e: BaseException) -> str:
    """``str(e)``, which itself can raise (an int argument of more than 4300 digits)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001
        return f"<unprintable {type(e).__name__}>"


def where_raised(exc: BaseException) -> str:
    """``file:function`` of the innermost frame in async_ckpt (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if os.sep + "async_ckpt" + os.sep in f.filename]
    f = (ours or frames)[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(os.path.dirname(__file__)))}:{f.name}"


def draw_here(generators: dict[str, Callable[[], Any]]) -> Optional[str]:
    """Call every draw function in this process; None when all returned."""
    for name, draw in generators.items():
        try:
            draw()
        except Exception as e:  # noqa: BLE001 - reported as a failure
            return f"draw from {name} raised {type(e).__name__}: {safe_str(e)}"[:2000]
    return None


def draw_in_child(generators: dict[str, Callable[[], Any]], timeout: float) -> Optional[str]:
    """Call every draw function in a forked child: a crafted generator state may crash the process
    on the next draw. Returns None when every draw returned, else what went wrong."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        code = 0
        try:
            os.close(read_end)
            for name, draw in generators.items():
                try:
                    draw()
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    os.write(write_end, f"draw from {name} raised {type(e).__name__}: {safe_str(e)}"[:2000].encode())
                    code = 1
                    break
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.002)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        return f"drawing from the restored generators hung for {timeout:g} s"
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode(errors="replace")
    if os.WIFSIGNALED(status):
        return (f"drawing from the restored generators crashed the process with signal "
                f"{signal.Signals(os.WTERMSIG(status)).name}")
    if os.WEXITSTATUS(status) != 0:
        return message or f"the draw child exited with {os.WEXITSTATUS(status)}"
    return None


# --- comparing ----------------------------------------------------------------------------------


def diff(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None when ``a`` and ``b`` are bit-identical (types, dtypes, shapes, strides, bytes, float
    bits), else where they first differ."""
    here = path or "<top>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{here}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return f"{here}: {a.dtype}{tuple(a.shape)}/{a.stride()} vs {b.dtype}{tuple(b.shape)}/{b.stride()}"
        if a.numel() and not torch.equal(_bytes_of(a), _bytes_of(b)):
            return f"{here}: tensor bytes differ"
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or isinstance(a, np.generic):
        if type(a) is not type(b):
            return f"{here}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.dtype.str != b.dtype.str or np.shape(a) != np.shape(b):
            return f"{here}: numpy {a.dtype.str}{np.shape(a)} vs {b.dtype.str}{np.shape(b)}"
        return None if np.asarray(a).tobytes() == np.asarray(b).tobytes() else f"{here}: numpy bytes differ"
    if type(a) is not type(b):
        return f"{here}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{here}: keys {_short(list(a))} vs {_short(list(b))}"
        for k in a:
            d = diff(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{here}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float):
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{here}: {a!r} vs {b!r}"
    return None if a == b else f"{here}: {_short(a)} vs {_short(b)}"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)


def live_fingerprint(handles: dict) -> dict:
    """Copies of everything restore() may change in the registered objects and the process-wide
    generators (taken from the objects themselves, not through the state mapping)."""
    return {
        "model": {k: v.detach().clone() for k, v in handles["model"].state_dict().items()},
        "optimizer": copy.deepcopy(handles["optimizer"].state_dict()),
        "scheduler": copy.deepcopy(handles["scheduler"].state_dict()),
        "extra": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                  for k, v in handles["extra"].items()},
        "gen": handles["gen"].get_state().clone(),
        "nprng": copy.deepcopy(handles["nprng"].bit_generator.state),
        "python": random.getstate(),
        "numpy": copy.deepcopy(np.random.get_state()),
        "torch": torch.get_rng_state().clone(),
    }


def rng_draws(handles: dict) -> dict[str, Callable[[], Any]]:
    gen, nprng = handles["gen"], handles["nprng"]
    return {
        "random": lambda: (random.random(), random.getrandbits(64), random.gauss(0, 1)),
        "numpy.random": lambda: (np.random.random(3), np.random.randint(0, 10, 3), np.random.normal(size=2)),
        "torch": lambda: (torch.rand(3), torch.randn(3), torch.randint(0, 10, (3,))),
        "registered torch.Generator": lambda: (torch.rand(3, generator=gen), torch.randn(3, generator=gen)),
        "registered numpy Generator": lambda: (nprng.random(3), nprng.integers(0, 10, 3), nprng.normal(size=2)),
    }


# --- outcomes and failures ----------------------------------------------------------------------


@dataclass
class Failure:
    """One broken rule in one case."""

    rule: str  # "untyped exception", "hang", "wrong data", ...
    target: str  # "load(dir)", "restore()", "cli verify --all", ...
    message: str
    where: str = ""  # file:function where it was raised, for exceptions
    exc: Optional[BaseException] = None

    @property
    def key(self) -> tuple:
        exc_type = type(self.exc).__name__ if self.exc is not None and self.rule != "hang" else ""
        return self.rule, _target_group(self.target), exc_type, self.where

    def __str__(self) -> str:
        where = f" at {self.where}" if self.where else ""
        return f"[{self.rule}] {self.target}{where}: {self.message}"


def _target_group(target: str) -> str:
    """'cli gc --keep-last 1' -> 'cli gc'; 'load(dir, step=1)' stays."""
    parts = target.split()
    return " ".join(parts[:2]) if parts and parts[0] == "cli" else target


class FuzzLog:
    """Counts of outcomes per (test, target) and the distinct failures seen (with the shortest
    mutation that showed each)."""

    def __init__(self):
        self.outcomes: Counter = Counter()
        self.failures: dict[tuple, dict] = {}
        self.cases: Counter = Counter()
        self.costs: dict[str, dict] = {}  # target group -> the largest peak and time, and what

    def outcome(self, test: str, target: str, outcome: str) -> None:
        self.outcomes[test, target, outcome] += 1

    def failure(self, test: str, failure: Failure, mutation: Mutation) -> None:
        entry = self.failures.setdefault(failure.key, {
            "rule": failure.rule, "target": _target_group(failure.target), "where": failure.where,
            "exception": type(failure.exc).__name__ if failure.exc is not None else "",
            "count": 0, "tests": set(), "mutation": None, "message": ""})
        entry["count"] += 1
        entry["tests"].add(test)
        text = repr(mutation)
        if entry["mutation"] is None or len(text) < len(entry["mutation"]):
            entry["mutation"], entry["message"] = text, failure.message[:300]

    def cost(self, target: str, peak: int, seconds: float, mutation: Mutation) -> None:
        """Record what one target took (peak memory added, seconds); keep the largest of each."""
        entry = self.costs.setdefault(_target_group(target), {"calls": 0, "peak": 0,
                                                              "seconds": 0.0})
        entry["calls"] += 1
        if peak > entry["peak"]:
            entry.update(peak=peak, peak_mutation=repr(mutation))
        if seconds > entry["seconds"]:
            entry.update(seconds=seconds, seconds_mutation=repr(mutation))

    def failures_of(self, test: str) -> list[dict]:
        return [f for f in self.failures.values() if test in f["tests"]]

    def summary(self) -> str:
        lines = ["async_ckpt fuzz: cases per test"]
        for test, n in sorted(self.cases.items()):
            lines.append(f"  {test}: {n}")
        lines.append("outcomes (test | target | outcome: count)")
        by_target: dict = {}
        for (test, target, outcome), n in sorted(self.outcomes.items()):
            by_target.setdefault((test, target), []).append(f"{outcome}={n}")
        for (test, target), parts in by_target.items():
            lines.append(f"  {test} | {target} | " + ", ".join(parts))
        totals: Counter = Counter()
        for (_, target, outcome), n in self.outcomes.items():
            totals[outcome.split(":")[0]] += n
        lines.append("totals: " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items())))
        lines.append("largest cost per target (peak memory added, seconds)")
        for target, c in sorted(self.costs.items()):
            lines.append(f"  {target}: {c['calls']} calls, peak {c['peak'] >> 20} MiB "
                         f"({c.get('peak_mutation', '-')}), {c['seconds']:.2f} s "
                         f"({c.get('seconds_mutation', '-')})")
        lines.append(f"distinct failures: {len(self.failures)}")
        for f in sorted(self.failures.values(), key=lambda f: (f["rule"], f["target"], f["where"])):
            lines.append(f"  [{f['rule']}] {f['exception']} {f['target']} at {f['where'] or '-'} "
                         f"x{f['count']}: {f['mutation']} -- {f['message'][:160]}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"cases": dict(self.cases), "costs": self.costs,
                "outcomes": [{"test": t, "target": g, "outcome": o, "count": n}
                             for (t, g, o), n in sorted(self.outcomes.items())],
                "failures": [{**f, "tests": sorted(f["tests"])} for f in self.failures.values()]}
