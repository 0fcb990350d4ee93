"""Safe encoding of the non-tensor values of a training state into strict JSON data.

Optimizer ``param_groups``, scheduler state, counters and RNG states are turned into a tree of
``dict`` / ``list`` / ``str`` / ``int`` / finite ``float`` / ``bool`` / ``None`` that
``json.dumps(..., allow_nan=False)`` accepts and that encodes to strict UTF-8. :func:`decode`
rebuilds the exact values (same types, same bits) without running code from the file: pickle is
used only where the caller passes ``allow_pickle=True`` on both sides. Tensors are not handled
here; the caller's ``leaf`` callback replaces them by placeholders such as ``{"$tensor": 3}``.
This module never imports torch.

Tag scheme
----------
JSON-native values are stored as themselves:

- ``None``, ``bool``, ``str`` (valid Unicode), ``list``;
- ``int`` in the signed 64-bit range;
- finite ``float`` (Python writes it with a ``.`` or an exponent, so it reads back as a float;
  ``-0.0`` keeps its sign);
- ``dict`` whose keys are all ``str``: a JSON object in the same key order. A key that starts with
  ``$`` is written with one more ``$`` in front (``"$x"`` -> ``"$$x"``, ``"$"`` -> ``"$$"``), so
  a user's key can never look like a tag.

Every other value is a *tagged node*: a JSON object with exactly one key, the tag, which starts
with a single ``$`` (never ``$$``)::

    {"$int": "-0x1f"}                      int outside [-2**63, 2**63-1]; Python hex() form
    {"$float": "nan" | "inf" | "-inf"}     non-finite float (the sign and payload of NaN are not kept)
    {"$str": "<base64>"}                   str with lone surrogates (not valid UTF-8); the base64
                                           holds str.encode("utf-8", "surrogatepass")
    {"$bytes": "<base64>"}                 bytes
    {"$bytearray": "<base64>"}             bytearray
    {"$tuple": [v, ...]}                   tuple
    {"$set": [v, ...]}                     set; elements sorted by their canonical JSON text
    {"$frozenset": [v, ...]}               frozenset; same order rule
    {"$dict": [[k, v], ...]}               dict with any non-str key (int, float, bool, None,
                                           tuple, bytes, ...), pairs in key order
    {"$ndarray": {"dtype": "<f4", "shape": [2, 3], "data": "<base64>"}}
                                           numpy array of a bool/int/uint/float/complex dtype;
                                           dtype is numpy's dtype.str (byte order kept), data the
                                           raw bytes in C order
    {"$npscalar": {"dtype": "<f4", "data": "<base64>"}}
                                           numpy scalar (np.float32, np.int64, np.bool_, ...)
    {"$pickle": "<base64>"}                pickle (protocol 5) of any other value; only written
                                           and read with allow_pickle (True, or the classes
                                           whose instances may be pickled: see below)

Base64 is the standard alphabet with padding (RFC 4648 section 4). Values inside tagged nodes
are encoded recursively by the same rules. Any other ``$name`` tag belongs to the caller (its
``leaf`` callbacks write and read it); a tag neither side knows is an error.

Types that come back as a different type: ``OrderedDict`` and ``defaultdict`` come back as a plain
``dict`` (the default factory, and attributes such as a state dict's ``_metadata``, are dropped);
``np.longlong``/``np.ulonglong`` scalars come back as the numpy type of the same width
(``np.int64``/``np.uint64``). Namedtuples and subclasses of the supported builtins are refused
(pickled with ``allow_pickle=True``), as are numpy arrays and scalars of object, string, void and
datetime dtypes. Containers that contain themselves and nesting deeper than 100 containers are
refused.
"""

from __future__ import annotations

import base64
import binascii
import collections
import enum
import functools
import io
import json
import math
import pickle
import re
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Collection, Iterator, Optional, Union

import numpy as np

from ..checks import short_repr
from ..errors import CorruptSnapshotError, EncodingError, InvalidArgumentError

__all__ = ["encode", "decode", "Kind", "CONTAINER_KINDS", "kind_of", "tag_of", "children", "walk",
           "unescape_key", "payload_nbytes"]

MAX_DEPTH = 100  # containers nested deeper than this are refused (keeps clear of RecursionError)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PICKLE_PROTOCOL = 5
_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex
_DTYPE_RE = re.compile(r"[<>|][biufc][0-9]{1,2}")
_HEX_INT_RE = re.compile(r"-?0x[0-9a-f]+")
_SPECIAL_FLOATS = ("nan", "inf", "-inf")
_CONTAINERS = (list, tuple, set, frozenset, dict, OrderedDict, defaultdict)
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})

AllowPickle = Union[bool, Collection[Any]]
"""What ``allow_pickle`` may be: False, True, or the classes (and torch dtypes) a pickle may
name."""


class Kind(enum.StrEnum):
    """What an encoded node is (``kind_of``): a JSON list, str-keyed dict or scalar, or one of
    the tags this module owns (the caller's tags, such as ``format/tree.py``'s, are not here)."""

    LIST = "list"
    DICT = "dict"  # a str-keyed dict
    VALUE = "value"  # None, bool, int, float or str
    INT = "$int"
    FLOAT = "$float"
    STR = "$str"
    BYTES = "$bytes"
    BYTEARRAY = "$bytearray"
    TUPLE = "$tuple"
    SET = "$set"
    FROZENSET = "$frozenset"
    KEYED_DICT = "$dict"  # a dict with a key that is not a str
    NDARRAY = "$ndarray"
    NPSCALAR = "$npscalar"
    PICKLE = "$pickle"


def encode(
    value: Any,
    *,
    allow_pickle: AllowPickle = False,
    leaf: Optional[Callable[[Any, str], Any]] = None,
    path: str = "",
) -> Any:
    """Encode ``value`` into a JSON-safe tree; the inverse of :func:`decode`.

    ``leaf(value, path)`` is tried first on every node but the keys of all-``str`` dicts, the
    plain scalars (``None`` and values whose exact type is ``bool``, ``int``, ``float`` or
    ``str``) and the containers of the tag scheme (exact types; their items are tried): whatever
    it returns other than ``NotImplemented`` is stored verbatim and must be JSON-safe, normally
    a one-key dict tagged ``$name`` with a tag this module does not own. ``path`` is
    the key path of ``value`` itself, used as the prefix of every path in callbacks and errors.

    Raises :class:`EncodingError`, naming the key path, for a value with no safe encoding (unless
    ``allow_pickle`` allows pickling it, in which case it is pickled), a reference cycle, or too
    deep nesting.
    """
    return _Encoder(allow_pickle, leaf)(value, path, 0)


def decode(
    tree: Any,
    *,
    allow_pickle: AllowPickle = False,
    leaf: Optional[Callable[[dict], Any]] = None,
    unpickle: Optional[Callable[[bytes], Any]] = None,
) -> Any:
    """Rebuild the value that :func:`encode` turned into ``tree``.

    ``leaf(node)`` is tried on tagged nodes whose tag this module does not own; it returns the
    value or ``NotImplemented``. Exceptions it raises propagate unchanged. ``unpickle`` makes a
    ``$pickle`` node's value of its bytes (when ``allow_pickle`` allows pickles at all): by
    default ``pickle.loads`` (True) or the restricted unpickler of the classes given, or a
    stand-in for code that passes the pickle on unread.

    Raises :class:`CorruptSnapshotError` for any malformed tree, and :class:`EncodingError` for a
    pickle node when ``allow_pickle`` is false (unpickling runs code stored in the file) or
    names a global that is not among the classes given.
    """
    return _Decoder(allow_pickle, leaf, unpickle)(tree, "", 0)


READ_ALLOWANCE = 64 << 20
"""The memory any read may take beyond 1.2x the bytes it returns or checks (docs/SECURITY.md):
what parsing the manifest and a shard's index may cost when the snapshot holds few bytes."""
JSON_BYTES_PER_BYTE = 5  # the text and the str it decodes to (4 bytes a character at worst)
JSON_BYTES_PER_TOKEN = 80  # at most one object per ',' ':' '[' '{', built twice (parsed, decoded)


class JSONTooCostly(ValueError):
    """A JSON document whose parse would cost more memory than its caller allows."""


def json_cost(text: Union[str, bytes]) -> int:
    """An upper bound of the memory parsing ``text`` and decoding its values take, counted in one
    pass of C code before a Python object is made: a document that is mostly whitespace, or a
    list of ten million empty lists, costs in proportion to what it would build."""
    marks = (",", ":", "[", "{") if isinstance(text, str) else (b",", b":", b"[", b"{")
    return (JSON_BYTES_PER_BYTE * len(text)
            + JSON_BYTES_PER_TOKEN * sum(text.count(m) for m in marks))


def parse_json(text: Union[str, bytes], budget: int = READ_ALLOWANCE) -> Any:
    """A manifest's or an index's JSON text as FORMAT.md allows it: strict, so ``NaN``,
    ``Infinity`` and ``-Infinity`` (which Python's json reads but never writes with
    ``allow_nan=False``) are a ``ValueError`` like any other invalid JSON; ``JSONTooCostly``
    (a ValueError) before anything is parsed when its ``json_cost`` exceeds ``budget``."""
    cost = json_cost(text)
    if cost > budget:
        raise JSONTooCostly(f"parsing its {len(text)} bytes of JSON would take about "
                            f"{cost >> 20} MiB, more than the {budget >> 20} MiB a read allows "
                            "for it (a document of that many values or that much whitespace is "
                            "not one async_ckpt writes)")
    return json.loads(text, parse_constant=_non_finite)


def _non_finite(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")


# ------------------------------------------------------------------------------------- pickles


class Picklable:
    """What an ``allow_pickle`` other than False allows: any pickle (``allowed`` None), or only
    those whose globals are all in ``allowed`` ((module, name) -> the class or dtype itself),
    read by an unpickler that resolves those names to those objects and imports nothing."""

    def __init__(self, allowed: Optional[dict[tuple[str, str], Any]]) -> None:
        self.allowed = allowed

    @classmethod
    def of(cls, allow_pickle: AllowPickle) -> Optional["Picklable"]:
        """None for False (no pickle at all)."""
        if allow_pickle is False:
            return None
        if allow_pickle is True:
            return cls(None)
        return cls({global_name(obj): obj for obj in allow_pickle})

    @property
    def restricted(self) -> bool:
        return self.allowed is not None

    def loads(self, data: bytes) -> Any:
        """The value pickled in ``data``; EncodingError (starting "names") for a global that is
        not allowed."""
        if self.allowed is None:
            return pickle.loads(data)
        return _RestrictedUnpickler(io.BytesIO(data), self.allowed).load()

    def check(self, data: bytes, where: str) -> None:
        """EncodingError unless ``data`` loads back here (every global it names is allowed)."""
        try:
            self.loads(data)
        except EncodingError as e:
            raise EncodingError(f"the value at {where} cannot be pickled: its pickle {e}") from e


def global_name(obj: Any) -> tuple[str, str]:
    """How a pickle names ``obj``, a class or a torch dtype (``torch.float16``)."""
    if isinstance(obj, type):
        return obj.__module__, obj.__qualname__
    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return "torch", str(obj).removeprefix("torch.")
    raise InvalidArgumentError(f"allow_pickle is True, False or a collection of classes (and "
                               f"torch dtypes), not one holding {short_repr(obj)}")


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise EncodingError(
                f"names {module}.{name}, which is not among the classes allow_pickle allows: add "
                "it to them, or pass allow_pickle=True if you trust where this checkpoint came from "
                "(unpickling runs code stored in it)")
        return found


# --------------------------------------------------------------------------------------- encoder


class _Encoder:
    def __init__(self, allow_pickle: AllowPickle, leaf: Optional[Callable[[Any, str], Any]]) -> None:
        self.picklable = Picklable.of(allow_pickle)
        self.leaf = leaf
        self.open: set = set()  # ids of the containers being encoded, to detect cycles

    def __call__(self, v: Any, path: str, depth: int) -> Any:
        t = type(v)
        if t in _SCALAR_TYPES:
            return _scalar(v, t)
        if t in _CONTAINERS:
            return self._container(v, t, path, depth)
        if self.leaf is not None:
            out = self.leaf(v, path)
            if out is not NotImplemented:
                return out
        if t is bytes:
            return {Kind.BYTES.value: _b64(v)}
        if t is bytearray:
            return {Kind.BYTEARRAY.value: _b64(v)}
        if t is np.ndarray and v.dtype.kind in _NUMERIC_KINDS:
            data = _b64(v.tobytes(order="C"))
            return {Kind.NDARRAY.value: {"dtype": v.dtype.str, "shape": list(v.shape),
                                         "data": data}}
        if isinstance(v, np.generic) and v.dtype.kind in _NUMERIC_KINDS:
            return {Kind.NPSCALAR.value: {"dtype": v.dtype.str, "data": _b64(v.tobytes())}}
        return self._fallback(v, path)

    def _container(self, v: Any, t: type, path: str, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise EncodingError(
                f"cannot encode the value at {_where(path)}: containers are nested deeper than {MAX_DEPTH} "
                "levels; flatten the structure"
            )
        if id(v) in self.open:
            raise EncodingError(
                f"cannot encode the value at {_where(path)}: the {t.__name__} contains itself (a reference "
                "cycle); break the cycle before checkpointing"
            )
        self.open.add(id(v))
        try:
            d = depth + 1
            if t is list:
                return self._items(v, path, d)
            if t is tuple:
                return {Kind.TUPLE.value: self._items(v, path, d)}
            if t is set or t is frozenset:
                items = [self(x, f"{path}{{{short_repr(x)}}}", d) for x in v]
                items.sort(key=_canonical)
                return {Kind.SET.value if t is set else Kind.FROZENSET.value: items}
            if all(type(k) is str and _is_utf8(k) for k in v):
                return {_escape_key(k): self._item(x, path, k, d) for k, x in v.items()}
            return {Kind.KEYED_DICT.value: [[self._item(k, path, k, d, " (dict key)"),
                                             self._item(x, path, k, d)] for k, x in v.items()]}
        finally:
            self.open.discard(id(v))

    def _items(self, v: Any, path: str, depth: int) -> list:
        """A list's or tuple's items; ints alone (a Python RNG state is 625) in a few scans."""
        if all(type(x) is int for x in v) and _INT64_MIN <= min(v, default=0) and max(
                v, default=0) <= _INT64_MAX:
            return list(v)
        return [self._item(x, path, i, depth) for i, x in enumerate(v)]

    def _item(self, x: Any, path: str, key: Any, depth: int, suffix: str = "") -> Any:
        """``x``, found under ``key`` of the container at ``path``; its path is made only when
        it is not a scalar (``snapshot()``'s blocking time pays for every string made)."""
        t = type(x)
        if t in _SCALAR_TYPES:
            return _scalar(x, t)
        return self(x, child_path(path, key) + suffix, depth)

    def _fallback(self, v: Any, path: str) -> Any:
        name = _type_name(v)
        if self.picklable is None:
            raise EncodingError(f"cannot safely encode a value of type {name!r} at {_where(path)}; {_hint(v)}")
        try:
            data = pickle.dumps(v, protocol=_PICKLE_PROTOCOL)
        except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError, ...
            raise EncodingError(
                f"cannot pickle a value of type {name!r} at {_where(path)}: {type(e).__name__}: {e}"
            ) from e
        if self.picklable.restricted:  # refused now what could not be loaded back
            self.picklable.check(data, _where(path))
        return {Kind.PICKLE.value: _b64(data)}


def _scalar(v: Any, t: type) -> Any:
    """A ``None``, ``bool``, ``int``, ``float`` or ``str`` (``t``, its exact type) encoded."""
    if t is int:
        return v if _INT64_MIN <= v <= _INT64_MAX else {Kind.INT.value: hex(v)}
    if t is float:
        if math.isfinite(v):
            return v
        return {Kind.FLOAT.value: "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if t is str:
        return v if _is_utf8(v) else {Kind.STR.value: _b64(v.encode("utf-8", "surrogatepass"))}
    return v


def _hint(v: Any) -> str:
    """What the user can do about a value with no safe encoding."""
    if isinstance(v, (np.ndarray, np.generic)):
        return (
            f"numpy dtype {v.dtype.str!r} is not bool or numeric (or the array is a subclass); "
            "convert it or pass allow_pickle=True"
        )
    if isinstance(v, tuple) and hasattr(type(v), "_fields"):
        return "a namedtuple would come back as a plain tuple; convert it with tuple(x) or x._asdict(), or pass allow_pickle=True"
    for base in (int, float, str, bytes, bytearray, list, tuple, set, frozenset, dict):
        if isinstance(v, base):
            return (
                f"it is a subclass of {base.__name__!r} and would come back as a plain "
                f"{base.__name__!r}; convert it with {base.__name__}(x) or pass allow_pickle=True"
            )
    return "register it as state with state_dict()/load_state_dict() or pass allow_pickle=True"


# --------------------------------------------------------------------------------------- decoder

_Path = Any  # in the decoder: "" for the root, else (parent path, key); rendered by _where()



class _Decoder:
    def __init__(self, allow_pickle: AllowPickle, leaf: Optional[Callable[[dict], Any]],
                 unpickle: Optional[Callable[[bytes], Any]]) -> None:
        picklable = Picklable.of(allow_pickle)
        self.allow_pickle = picklable is not None
        self.leaf = leaf
        self.unpickle = unpickle or (picklable.loads if picklable is not None else pickle.loads)

    def __call__(self, node: Any, path: _Path, depth: int) -> Any:
        t = type(node)
        if node is None or t is bool or t is int or t is str:
            return node
        if t is float:
            if math.isfinite(node):
                return node
            raise _corrupt(path, "a bare non-finite float (these are written as $float nodes)")
        # One level of slack over the encoder: a scalar tagged node may sit below the deepest container.
        if depth > MAX_DEPTH:
            raise _corrupt(path, f"containers are nested deeper than {MAX_DEPTH} levels")
        if t is list:
            return [self(x, (path, i), depth + 1) for i, x in enumerate(node)]
        if t is not dict:
            raise _corrupt(path, f"a value of type {t.__name__!r}, which JSON cannot hold")
        tag = _tag_of(node, path)
        if tag is None:  # a plain str-keyed dict; "$$x" keys are escaped "$x"
            out = {}
            for k, x in node.items():
                key = unescape_key(k)
                out[key] = self(x, (path, key), depth + 1)
            return out
        decode_tag = _TAGS.get(tag)
        if decode_tag is not None:
            return decode_tag(self, node[tag], path, depth + 1)
        if self.leaf is not None:
            out = self.leaf(node)
            if out is not NotImplemented:
                return out
        raise _corrupt(path, f"unknown tag {_show(tag)}")


def _tag_of(node: dict, path: _Path) -> Optional[str]:
    """The tag of a tagged node, or None for a plain dict; rejects non-str keys and mixed nodes."""
    tag = None
    for k in node:
        if type(k) is not str:
            raise _corrupt(path, f"a dict key of type {type(k).__name__!r} (JSON keys are strings)")
        if _is_tag(k):
            tag = k
    if tag is not None and len(node) != 1:
        raise _corrupt(path, f"tagged node {_show(tag)} has other keys beside its tag")
    return tag


def _dec_int(dec: _Decoder, p: Any, path: _Path, depth: int) -> int:
    if type(p) is str and _HEX_INT_RE.fullmatch(p):
        return int(p, 16)  # no digit limit for base 16
    raise _corrupt(path, f"$int payload must be a hex string like '-0x1f', got {_show(p)}")


def _dec_float(dec: _Decoder, p: Any, path: _Path, depth: int) -> float:
    if type(p) is str and p in _SPECIAL_FLOATS:
        return float(p)  # a fresh object: two NaN keys of one dict must stay distinct
    raise _corrupt(path, f"$float payload must be 'nan', 'inf' or '-inf', got {_show(p)}")


def _dec_str(dec: _Decoder, p: Any, path: _Path, depth: int) -> str:
    raw = _unb64(p, path, Kind.STR)
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"$str payload is not UTF-8: {e}") from e


def _dec_bytes(kind: type, tag: str, dec: _Decoder, p: Any, path: _Path, depth: int) -> Any:
    return kind(_unb64(p, path, tag))


def _dec_tuple(dec: _Decoder, p: Any, path: _Path, depth: int) -> tuple:
    return tuple(_dec_items(dec, p, path, depth, Kind.TUPLE))


def _dec_set(kind: type, tag: str, dec: _Decoder, p: Any, path: _Path, depth: int) -> Any:
    items = _dec_items(dec, p, path, depth, tag)
    _check_hashes(items, path, tag, "element")
    out = kind(items)
    if len(out) != len(items):
        raise _corrupt(path, f"{tag} holds duplicate elements")
    return out


def _dec_items(dec: _Decoder, p: Any, path: _Path, depth: int, tag: str) -> list:
    return [dec(x, (path, i), depth) for i, x in enumerate(_items(p, path, tag))]


def _items(p: Any, path: _Path, tag: str) -> list:
    """The elements of a $tuple, $set or $frozenset payload."""
    if type(p) is not list:
        raise _corrupt(path, f"{tag} payload must be a list, got {_show(p)}")
    return p


def _pairs(p: Any, path: _Path) -> list:
    """The [key, value] pairs of a $dict payload."""
    if type(p) is not list:
        raise _corrupt(path, f"$dict payload must be a list of [key, value] pairs, got {_show(p)}")
    for n, pair in enumerate(p):
        if type(pair) is not list or len(pair) != 2:
            raise _corrupt(path, f"$dict entry #{n} is not a [key, value] pair")
    return p


def _dec_dict(dec: _Decoder, p: Any, path: _Path, depth: int) -> dict:
    pairs = _pairs(p, path)
    keys = [dec(pair[0], (path, _KeyNumber(n)), depth) for n, pair in enumerate(pairs)]
    _check_hashes(keys, path, Kind.KEYED_DICT, "key")
    out: dict = {}
    for n, (key, pair) in enumerate(zip(keys, pairs)):
        if key in out:
            raise _corrupt(path, f"$dict entry #{n} repeats an earlier key")
        out[key] = dec(pair[1], (path, key), depth)
    return out


MAX_SAME_HASH = 64
"""The most keys of one $dict, $set or $frozenset that may share a hash. Python's hash of an int
is public arithmetic (``k mod 2**61 - 1``), so a file can hold keys that all hash alike, and
inserting n of them costs n**2; honest keys almost never share one. With this cap decoding stays
linear."""


def _check_hashes(keys: list, path: _Path, tag: str, what: str) -> None:
    """CorruptSnapshotError for an unhashable key, or for more than ``MAX_SAME_HASH`` keys that
    share a hash (checked before any is inserted: counting hashes is linear whatever they are)."""
    try:
        hashes = collections.Counter(map(hash, keys))
    except TypeError as e:
        raise _corrupt(path, f"{tag} holds an unhashable {what}: {e}") from e
    if hashes and max(hashes.values()) > MAX_SAME_HASH:
        raise _corrupt(path, f"{tag} holds more than {MAX_SAME_HASH} {what}s that share a hash "
                             "(keys made to collide: decoding them would take quadratic time)")


def _dec_ndarray(dec: _Decoder, p: Any, path: _Path, depth: int) -> np.ndarray:
    dtype, raw = _numpy_payload(p, path, Kind.NDARRAY, {"dtype", "shape", "data"})
    shape = p["shape"]
    if type(shape) is not list or len(shape) > 64 or any(type(n) is not int or n < 0 for n in shape):
        raise _corrupt(path, "$ndarray shape must be a list of at most 64 non-negative ints")
    need = math.prod(shape) * dtype.itemsize
    if need != len(raw):
        raise _corrupt(path, f"$ndarray of shape {shape} and dtype {dtype.str} needs {need} bytes, data has {len(raw)}")
    try:
        return np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)  # writable, owns a copy
    except (ValueError, OverflowError) as e:
        raise _corrupt(path, f"$ndarray shape {shape} is not a valid numpy shape: {e}") from e


def _dec_npscalar(dec: _Decoder, p: Any, path: _Path, depth: int) -> np.generic:
    dtype, raw = _numpy_payload(p, path, Kind.NPSCALAR, {"dtype", "data"})
    if len(raw) != dtype.itemsize:
        raise _corrupt(path, f"$npscalar of dtype {dtype.str} needs {dtype.itemsize} bytes, data has {len(raw)}")
    return np.frombuffer(raw, dtype=dtype)[0]


def _numpy_payload(p: Any, path: _Path, tag: str, keys: set) -> tuple:
    """Validate the common part of $ndarray / $npscalar payloads: (dtype, raw bytes)."""
    if type(p) is not dict or set(p) != keys:
        raise _corrupt(path, f"{tag} payload must be an object with exactly the keys {sorted(keys)}")
    s = p["dtype"]
    dtype = None
    if type(s) is str and _DTYPE_RE.fullmatch(s):
        try:
            dtype = np.dtype(s)
        except (TypeError, ValueError):
            pass
    if dtype is None or dtype.str != s or dtype.kind not in _NUMERIC_KINDS:
        raise _corrupt(path, f"{tag} dtype must be a bool or numeric numpy dtype string like '<f4', got {_show(s)}")
    raw = _unb64(p["data"], path, tag)
    if dtype.kind == "b" and raw.translate(None, b"\x00\x01"):
        raise _corrupt(path, f"{tag} of dtype bool holds bytes other than 0 and 1")
    return dtype, raw


def _dec_pickle(dec: _Decoder, p: Any, path: _Path, depth: int) -> Any:
    if not dec.allow_pickle:
        raise EncodingError(
            f"the checkpoint holds a pickled object at {_where(path)}; unpickling runs code stored "
            "in the file, so it is refused by default. Load with allow_pickle=True only if you "
            "trust where this checkpoint came from"
        )
    raw = _unb64(p, path, Kind.PICKLE)
    try:
        return dec.unpickle(raw)
    except EncodingError as e:  # a global not among the classes allowed
        raise EncodingError(f"the checkpoint holds a pickled object at {_where(path)} that {e}") from e
    except Exception as e:  # anything the unpickled code may raise
        raise _corrupt(path, f"the pickled object cannot be loaded: {type(e).__name__}: {e}") from e


# The tags this module owns and how each is decoded: decoder(dec, payload, path, depth).
_TAGS: dict = {
    Kind.INT: _dec_int,
    Kind.FLOAT: _dec_float,
    Kind.STR: _dec_str,
    Kind.BYTES: functools.partial(_dec_bytes, bytes, Kind.BYTES),
    Kind.BYTEARRAY: functools.partial(_dec_bytes, bytearray, Kind.BYTEARRAY),
    Kind.TUPLE: _dec_tuple,
    Kind.SET: functools.partial(_dec_set, set, Kind.SET),
    Kind.FROZENSET: functools.partial(_dec_set, frozenset, Kind.FROZENSET),
    Kind.KEYED_DICT: _dec_dict,
    Kind.NDARRAY: _dec_ndarray,
    Kind.NPSCALAR: _dec_npscalar,
    Kind.PICKLE: _dec_pickle,
}


# ---------------------------------------------------------------------------------------- walker
# Reading an encoded tree without decoding it, for tools that show what a snapshot holds: nothing
# here builds a value from a payload, so nothing can run code from the file.

# The kinds of node that hold other nodes (see kind_of).
CONTAINER_KINDS = frozenset({Kind.LIST, Kind.DICT, Kind.TUPLE, Kind.SET, Kind.FROZENSET,
                             Kind.KEYED_DICT})
_BASE64_TAGS = (Kind.STR, Kind.BYTES, Kind.BYTEARRAY, Kind.PICKLE)


def tag_of(node: Any) -> Optional[str]:
    """The tag of a tagged node ``{tag: payload}`` (one of ours, or a caller's such as
    ``$tensor``), or None for any other node. Raises CorruptSnapshotError for an object that mixes
    a tag with other keys."""
    return _tag_of(node, "") if type(node) is dict else None


def kind_of(node: Any) -> str:
    """What an encoded node is, as a plain string: a ``Kind``'s (``"list"``, ``"dict"`` for a
    str-keyed dict, ``"value"`` for None, bool, int, float, str, or one of this module's tags), or
    a caller's tag (``"$tensor"``). Raises CorruptSnapshotError for anything JSON cannot hold and
    for mixed objects."""
    return _kind_of(node, "")


def children(node: Any) -> list[tuple[Any, Any]]:
    """The ``(key, child)`` pairs of a node, in stored order; none for a leaf (a kind outside
    :data:`CONTAINER_KINDS`, including every caller-owned tag). Keys are list positions for
    ``list``, ``$tuple``, ``$set`` and ``$frozenset``; the user's key (unescaped) for ``dict``; and
    for ``$dict`` the key as an *encoded* node, since a key may be any value."""
    return _children(node, _kind_of(node, ""), "")


def walk(tree: Any) -> Iterator[tuple[tuple, str, Any]]:
    """Every node of an encoded tree, each parent before its children: ``(path, kind, node)``,
    where ``path`` is the tuple of :func:`children` keys from ``tree`` down to ``node`` and
    ``kind`` is :func:`kind_of`'s. Lazy, so a search can stop early; raises CorruptSnapshotError
    for a malformed node when it gets there, and for nesting deeper than the decoder accepts."""
    todo = [((), "", tree)]  # (path, the same path as messages want it, node)
    while todo:
        path, where, node = todo.pop()
        kind = _kind_of(node, where)
        if kind != "value" and len(path) > MAX_DEPTH:
            raise _corrupt(where, f"containers are nested deeper than {MAX_DEPTH} levels")
        yield path, kind, node
        todo.extend((path + (key,), (where, key), child)
                    for key, child in reversed(_children(node, kind, where)))


def _kind_of(node: Any, path: _Path) -> str:
    t = type(node)
    if t is list:
        return Kind.LIST.value
    if t is dict:
        return _tag_of(node, path) or Kind.DICT.value
    if t is float and not math.isfinite(node):
        raise _corrupt(path, "a bare non-finite float (these are written as $float nodes)")
    if node is None or t is bool or t is int or t is float or t is str:
        return Kind.VALUE.value
    raise _corrupt(path, f"a value of type {t.__name__!r}, which JSON cannot hold")


def _children(node: Any, kind: str, path: _Path) -> list[tuple[Any, Any]]:
    if kind == Kind.LIST:
        return list(enumerate(node))
    if kind == Kind.DICT:
        return [(unescape_key(k), x) for k, x in node.items()]
    if kind == Kind.KEYED_DICT:
        return [(k, x) for k, x in _pairs(node[kind], path)]
    if kind in CONTAINER_KINDS:
        return list(enumerate(_items(node[kind], path, kind)))
    return []


def unescape_key(key: str) -> str:
    """The user's key for a key as written in a str-keyed dict: ``"$$x"`` -> ``"$x"``."""
    return key[1:] if key[:2] == "$$" else key


def payload_nbytes(node: Any) -> Optional[int]:
    """How many bytes the base64 payload of a ``$str``, ``$bytes``, ``$bytearray`` or ``$pickle``
    node holds, from its length alone (nothing is decoded); None for any other node."""
    tag = tag_of(node)
    if tag not in _BASE64_TAGS:
        return None
    p = node[tag]
    if type(p) is not str:
        raise _corrupt("", f"{tag} data must be a base64 string, got {_show(p)}")
    return len(p) * 3 // 4 - p.count("=")


def numpy_spec(node: Any) -> tuple[Any, Any]:
    """The dtype and shape (None for a scalar) that a ``$ndarray`` or ``$npscalar`` node's
    payload states, as written (nothing is checked or decoded): what a listing shows of it."""
    tag = tag_of(node)
    if tag not in (Kind.NDARRAY, Kind.NPSCALAR) or type(node[tag]) is not dict:
        raise _corrupt("", f"not a numpy node with an object payload: {_show(node)}")
    return node[tag].get("dtype"), node[tag].get("shape")


def _escape_key(key: str) -> str:
    """How a key of a str-keyed dict is written: a key starting with ``$`` gets one more, so that
    no user key looks like a tag."""
    return "$" + key if key[:1] == "$" else key


def _is_tag(key: str) -> bool:
    return key[:1] == "$" and key[1:2] != "$"


# --------------------------------------------------------------------------------------- helpers


def _is_utf8(s: str) -> bool:
    """True unless ``s`` holds lone surrogates, which strict UTF-8 (and JSON readers) reject."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(p: Any, path: str, tag: str) -> bytes:
    if type(p) is str:
        try:
            return base64.b64decode(p, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _corrupt(path, f"{tag} data is not valid base64: {e}") from e
    raise _corrupt(path, f"{tag} data must be a base64 string, got {_show(p)}")


def _canonical(encoded: Any) -> str:
    """Sort key that makes the order of encoded set elements independent of hash seeds."""
    return json.dumps(encoded, sort_keys=True, separators=(",", ":"))


def child_path(path: str, key: Any) -> str:
    """Key path of ``key`` under ``path``: ``a.b``, ``a["weird key"]``, ``a[0]``, ``a[(1, 2)]``."""
    if type(key) is str:
        if key.isidentifier():
            return f"{path}.{key}" if path else key
        return f"{path}[{json.dumps(key)}]"
    return f"{path}[{short_repr(key)}]"


def _show(p: Any) -> str:
    """Short description of a payload for messages (no repr of deep or huge structures)."""
    if type(p) is str:
        return short_repr(p, 45)
    return f"a {type(p).__name__}"


class _KeyNumber(int):
    """In a decoder path: the key (not the value) of the n-th pair of a ``$dict``."""


def _where(path) -> str:
    """A key path for messages. The decoder passes paths as (parent, key) pairs and renders them
    only here, when an error is raised: building a string per element would make decoding cost
    grow with nesting depth times key length."""
    keys = []
    while type(path) is tuple:
        path, key = path
        keys.append(key)
    for key in reversed(keys):
        if type(key) is _KeyNumber:
            path = f"{path}[<key #{int(key)}>]"
        else:
            path = child_path(path, key[:57] + "..." if type(key) is str and len(key) > 60 else key)
    return path or "<root>"


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _corrupt(path: str, msg: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"malformed value tree at {_where(path)}: {msg}")
