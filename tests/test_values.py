"""Tests of async_ckpt.format.values: exact round trips, refusals naming the key path, hostile trees."""

import base64
import collections
import dataclasses
import enum
import fractions
import json
import math
import pathlib
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from async_ckpt.errors import CorruptSnapshotError, EncodingError
from async_ckpt.format import values as tree_walk
from async_ckpt.format.values import decode, encode

# ------------------------------------------------------------------------------------- helpers


def same(a, b):
    """Equal in type and value, recursively: -0.0 != 0.0, nan == nan, arrays compared by bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, np.ndarray):
        return a.dtype.str == b.dtype.str and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items())
        )
    if isinstance(a, (set, frozenset)):
        return len(a) == len(b) and all(any(same(x, y) for y in b) for x in a)
    return a == b


def through_json(tree):
    """What a reader gets back from the file: strict JSON, strict UTF-8."""
    text = json.dumps(tree, allow_nan=False, ensure_ascii=False)
    return json.loads(text.encode("utf-8").decode("utf-8"))


def roundtrip(value, **kw):
    return decode(through_json(encode(value, **kw)), **kw)


def assert_roundtrip(value):
    back = roundtrip(value)
    assert same(value, back), (value, back)
    return back


Point = collections.namedtuple("Point", "x y")


class MyInt(int):
    pass


def short_id(v):
    """Test id: a truncated repr (repr of ints over 4300 digits raises) that is the same in every
    process that collects the tests (pytest-xdist's workers): no memory addresses, and sets in
    sorted order rather than their hash order, which differs between processes."""
    if type(v) is int and v.bit_length() > 256:
        return f"int{v.bit_length()}bits"
    r = re.sub(r" at 0x[0-9a-f]+", "", _same_everywhere(v))
    return r if len(r) <= 40 else r[:37] + "..."


def _same_everywhere(v) -> str:
    """``repr(v)``, with the members of (nested) sets in sorted order."""
    if type(v) in (set, frozenset):
        inner = "{" + ", ".join(sorted(map(_same_everywhere, v))) + "}"
        return inner if type(v) is set else f"frozenset({inner})"
    if type(v) in (list, tuple):
        inner = ", ".join(map(_same_everywhere, v)) + ("," if type(v) is tuple and len(v) == 1 else "")
        return f"[{inner}]" if type(v) is list else f"({inner})"
    if type(v) is dict:
        return "{" + ", ".join(f"{_same_everywhere(k)}: {_same_everywhere(x)}"
                               for k, x in v.items()) + "}"
    return repr(v)


def b64(data):
    return base64.b64encode(data).decode("ascii")


# ------------------------------------------------------------------------------------ strategies

TAG_LIKE = ["$int", "$tuple", "$dict", "$pickle", "$tensor", "$", "$$", "$$tuple", "$$$x", "a$", ""]
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3)
texts = st.one_of(st.text(max_size=8), surrogates, st.sampled_from(TAG_LIKE))
ints = st.one_of(st.integers(), st.integers(-(2**200), 2**200), st.sampled_from([2**63, -(2**63) - 1, 2**63 - 1, -(2**63)]))
floats = st.floats(allow_nan=True, allow_infinity=True)

hashable = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), texts, st.binary(max_size=8)),
    lambda inner: st.one_of(st.tuples(inner, inner), st.frozensets(inner, max_size=3)),
    max_leaves=6,
)

DTYPES = ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
          "<c8", "<c16", ">i2", ">u4", ">i8", ">f2", ">f4", ">f8", ">c16"]
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
)
SCALAR_DTYPES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"]
np_scalars = st.sampled_from(SCALAR_DTYPES).flatmap(lambda dt: hnp.from_dtype(np.dtype(dt)))

scalars = st.one_of(
    st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray), arrays, np_scalars,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(texts, inner, max_size=4),
        st.dictionaries(hashable, inner, max_size=4),
        st.sets(hashable, max_size=4),
        st.frozensets(hashable, max_size=4),
    ),
    max_leaves=20,
)


# ------------------------------------------------------------------------------------ round trips


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_roundtrip_property(value):
    assert_roundtrip(value)


@settings(deadline=None)
@given(values)
def test_encoding_is_deterministic_and_strict_json(value):
    tree = encode(value)
    text = json.dumps(tree, allow_nan=False, ensure_ascii=False)
    text.encode("utf-8")  # strict: no lone surrogates leak into the file
    assert json.dumps(encode(value)) == json.dumps(tree)


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, -(2**64),
        3**500, -(7**300), 10**5000, 0.0, -0.0, 1.0, -1.5, 1e308, 5e-324, 1e16, math.inf, -math.inf,
        "", "héllo", "\x00", "\ud800", "a\udcffb", "emoji \U0001F600", b"", b"\x00\xff", bytearray(b"ab"),
        (), (1,), ((1, (2, ())), [3]), [], [[[]]], {}, set(), frozenset(), {1, "a", (2, 3)},
        frozenset({frozenset({1}), None}),
        {float("nan"), float("nan"), 1.0},
    ],
    ids=short_id,
)
def test_roundtrip_explicit(value):
    assert_roundtrip(value)


def test_nan_and_negative_zero():
    back = roundtrip([math.nan, -0.0, 0.0, -math.inf])
    assert math.isnan(back[0])
    assert math.copysign(1.0, back[1]) == -1.0 and math.copysign(1.0, back[2]) == 1.0
    assert back[3] == -math.inf


def test_big_ints_use_int_tag_and_small_ones_stay_plain():
    assert encode(2**63 - 1) == 2**63 - 1
    assert encode(2**63) == {"$int": "0x8000000000000000"}
    assert encode(-(2**63) - 1) == {"$int": "-0x8000000000000001"}
    assert roundtrip(10**5000) == 10**5000  # beyond Python's decimal str() digit limit


@pytest.mark.parametrize(
    "value",
    [
        {1: "a", 2: "b", -3: "c"},
        {(1, "x"): 1, (2, (3, None)): 2},
        {None: 0, True: 1, 2.5: 2, "s": 3, b"k": 4, (): 5, frozenset({1}): 6},
        {0.0: "zero"},
        {float("nan"): 1, float("nan"): 2},
        {-0.0: "negzero"},
        {"$tuple": [1, 2], "$int": "0x1", "$": 1, "$$": 2, "$$x": 3, "plain": 4},
        {"$tensor": 0},
        {"$pickle": "gASVAAAAAAAAAAA="},
        {"a": {"$dict": [[1, 2]]}},
        {"\ud800": 1, "b": 2},
    ],
    ids=short_id,
)
def test_dicts(value):
    assert_roundtrip(value)


def test_dict_key_order_is_kept():
    d = {"b": 1, "a": 2, 3: 3, "c": 4}
    assert list(roundtrip(d)) == ["b", "a", 3, "c"]
    d = {"z": 1, "y": 2, "x": 3}
    assert list(roundtrip(d)) == ["z", "y", "x"]


def test_tag_like_keys_are_escaped():
    assert encode({"$tuple": 1, "$": 2, "$$a": 3, "b": 4}) == {"$$tuple": 1, "$$": 2, "$$$a": 3, "b": 4}
    assert decode({"$$tuple": [1]}) == {"$tuple": [1]}


def test_str_keyed_dicts_are_plain_json_objects():
    tree = encode({"lr": 0.1, "betas": (0.9, 0.999), "n": [1, 2]})
    assert tree == {"lr": 0.1, "betas": {"$tuple": [0.9, 0.999]}, "n": [1, 2]}


def test_ordered_and_default_dicts_come_back_as_dict():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    back = roundtrip(od)
    assert type(back) is dict and list(back.items()) == [("b", 1), ("a", 2)]
    dd = collections.defaultdict(list, {1: [2]})
    back = roundtrip(dd)
    assert type(back) is dict and back == {1: [2]}


def test_lone_surrogates_are_escaped():
    assert encode("ok") == "ok"
    tree = encode("a\ud800")
    assert set(tree) == {"$str"}
    assert roundtrip("a\ud800") == "a\ud800"


@pytest.mark.parametrize("dtype", ["<f2", "<f4", "<f8", "|b1", "<c8", "<c16", "|i1", "|u1", "<i8", "<u8", ">f4", ">i8", ">c8"])
def test_numpy_dtypes(dtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    back = assert_roundtrip(a)
    assert back.dtype.str == dtype and back.flags.writeable


def test_numpy_shapes_and_layouts():
    assert_roundtrip(np.array(3.5, dtype=np.float32))  # 0-d
    assert_roundtrip(np.array(True))  # 0-d bool
    assert_roundtrip(np.zeros((0,), dtype=np.int32))  # empty
    assert_roundtrip(np.zeros((2, 0, 3), dtype=np.float64))
    a = np.arange(24, dtype=np.int16).reshape(4, 6)
    for view in (a[:, ::2], a.T, a[::-1], np.asfortranarray(a)):
        back = roundtrip(view)
        assert np.array_equal(back, view) and back.dtype == view.dtype
    nan = np.array([np.nan, -0.0, np.inf], dtype=np.float16)
    assert roundtrip(nan).tobytes() == nan.tobytes()


def test_numpy_array_encoding_is_documented_form():
    tree = encode(np.array([[1, 2]], dtype=">i2"))
    assert tree == {"$ndarray": {"dtype": ">i2", "shape": [1, 2], "data": b64(b"\x00\x01\x00\x02")}}


@pytest.mark.parametrize(
    "scalar",
    [np.float32(1.5), np.float64(-0.0), np.float16(np.nan), np.int64(-(2**63)), np.uint64(2**64 - 1),
     np.int8(-5), np.uint8(255), np.bool_(True), np.bool_(False), np.complex64(1 + 2j), np.int32(7)],
    ids=short_id,
)
def test_numpy_scalars(scalar):
    back = assert_roundtrip(scalar)
    assert type(back) is type(scalar)


def test_adamw_param_groups():
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p, torch.nn.Parameter(torch.ones(2))], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    groups = opt.state_dict()["param_groups"]
    back = assert_roundtrip(groups)
    assert back == groups and isinstance(back[0]["betas"], tuple)


def test_full_optimizer_state_with_tensor_leaf():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    tensors = []

    def enc_leaf(v, path):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"$tensor": len(tensors) - 1}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        return NotImplemented

    def dec_leaf(node):
        if "$tensor" in node:
            return tensors[node["$tensor"]]
        if "$dtype" in node:
            return getattr(torch, node["$dtype"])
        return NotImplemented

    value = {"optim": sd, "dtype": torch.bfloat16}
    tree = through_json(encode(value, leaf=enc_leaf))
    back = decode(tree, leaf=dec_leaf)
    assert back["dtype"] is torch.bfloat16
    assert back["optim"]["param_groups"] == sd["param_groups"]
    assert list(back["optim"]["state"]) == list(sd["state"])  # int keys, same order
    for k, st_ in sd["state"].items():
        for name, t in st_.items():
            assert torch.equal(back["optim"]["state"][k][name], t)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optim"])


def test_leaf_sees_key_paths_and_neither_scalars_nor_containers():
    """The leaf is asked about what only the caller can encode (a tensor, say), with its key
    path; JSON's own scalars and the scheme's containers are encoded without asking it."""
    seen = {}

    class Opaque:
        pass

    def leaf(v, path):
        assert type(v) not in (type(None), bool, int, float, str, list, tuple, dict), (v, path)
        if isinstance(v, Opaque):
            seen[path] = v
            return {"$opaque": None}
        return NotImplemented

    x = Opaque()
    tree = encode({"optimizer": {"param_groups": [{"lr": 0.1, "betas": (x, 0.99), "w": x}]},
                   "w k": {0: x, 1: [None, True, "s", 2**70]}}, leaf=leaf)
    assert set(seen) == {"optimizer.param_groups[0].betas[0]", "optimizer.param_groups[0].w",
                         '["w k"][0]'}
    assert tree["optimizer"]["param_groups"][0]["betas"] == {"$tuple": [{"$opaque": None}, 0.99]}
    assert tree["w k"]["$dict"][1] == [1, [None, True, "s", {"$int": hex(2**70)}]]


def test_numpy_random_state():
    np.random.seed(1234)
    np.random.random(10)
    state = np.random.get_state()
    back = assert_roundtrip(state)
    expected = np.random.random(5)
    np.random.set_state(back)
    assert np.array_equal(np.random.random(5), expected)


def test_numpy_generator_state():
    rng = np.random.default_rng(42)
    rng.random(3)
    state = rng.bit_generator.state  # 128-bit ints
    back = assert_roundtrip(state)
    expected = rng.random(4)
    rng.bit_generator.state = back
    assert np.array_equal(rng.random(4), expected)


def test_python_random_state():
    r = random.Random(99)
    r.random()
    state = r.getstate()
    back = assert_roundtrip(state)
    expected = r.random()
    r.setstate(back)
    assert r.random() == expected
    assert_roundtrip(random.getstate())


# ------------------------------------------------------------------------------------ refusals


def test_refuses_lambda_in_nested_dict():
    with pytest.raises(EncodingError) as ei:
        encode({"model_cfg": {"act": lambda x: x}})
    msg = str(ei.value)
    assert "'function'" in msg and "at model_cfg.act;" in msg and "allow_pickle=True" in msg


def test_refuses_object_in_list_in_tuple():
    with pytest.raises(EncodingError, match=r"'object' at cfg\.sched\[1\]\[2\];"):
        encode({"sched": (0, [1, 2, object()])}, path="cfg")


def test_refusal_paths_for_weird_and_int_keys():
    with pytest.raises(EncodingError, match=r'at state\["weird key"\]\[0\]\.x;'):
        encode({"state": {"weird key": {0: {"x": object()}}}})
    with pytest.raises(EncodingError, match=r"at <root>;"):
        encode(object())
    with pytest.raises(EncodingError, match=r"\(dict key\)"):
        encode({object(): 1})


@pytest.mark.parametrize(
    "value, hint",
    [
        (Point(1, 2), "namedtuple"),
        (np.array(["a"]), "dtype"),
        (np.array([1], dtype=object), "dtype"),
        (np.zeros(2, dtype=[("a", "<f4")]), "dtype"),
        (np.datetime64("2020-01-01"), "dtype"),
        (np.str_("x"), "dtype"),
        (np.ma.masked_array([1, 2]), "subclass"),
        (fractions.Fraction(1, 3), "state_dict"),
        (collections.Counter({"a": 1}), "subclass of 'dict'"),
        (MyInt(3), "subclass of 'int'"),
        (range(3), "state_dict"),
    ],
)
def test_refusals_have_hints(value, hint):
    with pytest.raises(EncodingError, match=hint):
        encode({"k": value})
    assert roundtrip({"k": value}, allow_pickle=True)["k"] is not None  # picklable ones are stored


def test_refuses_cycles():
    lst = []
    lst.append(lst)
    with pytest.raises(EncodingError, match=r"at \[0\]: the list contains itself"):
        encode(lst)
    d = {"a": {}}
    d["a"]["back"] = d
    with pytest.raises(EncodingError, match=r"at a\.back:.*cycle"):
        encode(d)
    t = ([],)
    t[0].append(t)
    with pytest.raises(EncodingError, match="cycle"):
        encode(t)


def test_shared_references_are_not_cycles():
    shared = [1, 2]
    assert roundtrip({"a": shared, "b": shared, "c": (shared, shared)}) == {"a": [1, 2], "b": [1, 2], "c": ([1, 2], [1, 2])}


def test_refuses_too_deep_nesting():
    deep = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(EncodingError, match="nested deeper"):
        encode(deep)
    tree = []
    for _ in range(10_000):
        tree = {"$tuple": [tree]}
    with pytest.raises(CorruptSnapshotError, match="nested deeper"):
        decode(tree)
    ok = []
    for _ in range(99):
        ok = [ok]
    assert roundtrip(ok) == ok


# ------------------------------------------------------------------------------------ pickle


def test_pickle_opt_in():
    value = {"frac": fractions.Fraction(1, 3), "nt": collections.namedtuple("Q", "a")(1)._asdict()}
    tree = through_json(encode(value, allow_pickle=True))
    assert set(tree["frac"]) == {"$pickle"}
    assert decode(tree, allow_pickle=True) == value
    with pytest.raises(EncodingError, match=r"pickled object at frac;.*allow_pickle=True"):
        decode(tree)


def test_pickle_opt_in_only_for_unsupported_values():
    assert encode({"a": (1, 2.0)}, allow_pickle=True) == {"a": {"$tuple": [1, 2.0]}}


def test_unpicklable_value_names_the_path_even_with_opt_in():
    with pytest.raises(EncodingError, match=r"cannot pickle .* at cfg\.act"):
        encode({"cfg": {"act": lambda x: x}}, allow_pickle=True)


def test_hostile_pickle_never_runs_without_opt_in():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('code ran')",))

    tree = {"x": {"$pickle": b64(pickle.dumps(Boom()))}}
    with pytest.raises(EncodingError, match="allow_pickle"):
        decode(tree)


class _Stage(int, enum.Enum):  # what a framework keeps in its optimizer state (DeepSpeed's)
    two = 2


@dataclasses.dataclass
class _Scaler:
    scale: float
    kind: object = None


def test_pickles_of_the_classes_allowed_only():
    """allow_pickle=[classes]: their instances are pickled and read back, without importing or
    calling anything else; a pickle naming any other global is refused at the save, and in a
    file (crafted) at the load, whatever it would have run."""
    value = {"stage": _Stage.two, "scaler": _Scaler(2.0, np.float64)}
    with pytest.raises(EncodingError, match=r"scaler.*names numpy.float64, which is not among"):
        encode(value, allow_pickle=[_Stage, _Scaler])
    value["scaler"].kind = None
    tree = through_json(encode(value, allow_pickle=[_Stage, _Scaler]))
    assert decode(tree, allow_pickle=(_Scaler, _Stage)) == value
    assert type(decode(tree, allow_pickle=[_Stage, _Scaler])["stage"]) is _Stage
    with pytest.raises(EncodingError, match=r"pickled object at stage that names .*_Stage"):
        decode(tree, allow_pickle=[_Scaler])

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('code ran')",))

    with pytest.raises(EncodingError, match=r"names builtins.exec, which is not among"):
        decode({"x": {"$pickle": b64(pickle.dumps(Boom()))}}, allow_pickle=[_Stage])


def test_a_torch_dtype_may_be_allowed_by_value():
    import torch

    tree = encode({"s": _Scaler(1.0, torch.bfloat16)}, allow_pickle=[_Scaler, torch.bfloat16])
    assert decode(tree, allow_pickle=[_Scaler, torch.bfloat16])["s"].kind is torch.bfloat16
    with pytest.raises(EncodingError, match=r"names torch.bfloat16"):
        decode(tree, allow_pickle=[_Scaler, torch.float16])


# ------------------------------------------------------------------------------------ leaf / tags


def test_unknown_tags_need_a_leaf():
    with pytest.raises(CorruptSnapshotError, match=r"unknown tag '\$tensor'"):
        decode({"w": {"$tensor": 0}})
    assert decode({"w": {"$tensor": 0}}, leaf=lambda node: "T") == {"w": "T"}
    with pytest.raises(CorruptSnapshotError, match="unknown tag"):
        decode({"$tensor": 0}, leaf=lambda node: NotImplemented)


def test_leaf_output_is_stored_verbatim_and_not_called_for_owned_tags():
    calls = []

    def dec_leaf(node):
        calls.append(node)
        return NotImplemented

    assert encode({"a": b"1"}, leaf=lambda v, p: {"$x": p} if v == b"1" else NotImplemented) == {
        "a": {"$x": "a"}}
    decode({"$tuple": [1, {"$int": "0x1"}]}, leaf=dec_leaf)
    assert calls == []


# ------------------------------------------------------------------------------------ malformed


@pytest.mark.parametrize(
    "tree",
    [
        {"$int": 5}, {"$int": "12"}, {"$int": "0x"}, {"$int": " 0x1"}, {"$int": "0x1_0"}, {"$int": "0X1"},
        {"$float": "1.0"}, {"$float": None}, {"$float": ["nan"]},
        {"$bytes": "!!!"}, {"$bytes": "abc"}, {"$bytes": 3}, {"$bytes": "é"}, {"$bytearray": [1]},
        {"$str": b64(b"\xff")}, {"$str": 1},
        {"$tuple": {}}, {"$tuple": "ab"}, {"$set": [[1]]}, {"$set": [1, 1]}, {"$frozenset": [1, True]},
        {"$dict": {}}, {"$dict": [[1]]}, {"$dict": [[1, 2, 3]]}, {"$dict": [[[1], 2]]}, {"$dict": [[1, 2], [1, 3]]},
        {"$dict": [{"k": 1}]}, {"$dict": [[{"$ndarray": {"dtype": "<f4", "shape": [1], "data": b64(b"\0" * 4)}}, 1]]},
        {"$tuple": [], "x": 1}, {"$unknown": 1}, {"a": {"$x": 1, "$y": 2}},
        {"$ndarray": {"dtype": "|O8", "shape": [1], "data": b64(b"\0" * 8)}},
        {"$ndarray": {"dtype": "<U1", "shape": [1], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f3", "shape": [1], "data": b64(b"\0" * 3)}},
        {"$ndarray": {"dtype": "|i4", "shape": [1], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<M8", "shape": [1], "data": b64(b"\0" * 8)}},
        {"$ndarray": {"dtype": "<f4", "shape": [2], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f4", "shape": [-1], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f4", "shape": [True], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f4", "shape": [1.0], "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f4", "shape": 1, "data": b64(b"\0" * 4)}},
        {"$ndarray": {"dtype": "<f4", "shape": [0] + [10**30] * 3, "data": ""}},
        {"$ndarray": {"dtype": "<f4", "shape": [0] * 65, "data": ""}},
        {"$ndarray": {"dtype": "<f4", "shape": [1], "data": b64(b"\0" * 4), "extra": 1}},
        {"$ndarray": {"dtype": "<f4", "shape": [1]}},
        {"$ndarray": {"dtype": "|b1", "shape": [2], "data": b64(b"\x01\x02")}},
        {"$ndarray": [1, 2]},
        {"$npscalar": {"dtype": "<f4", "data": b64(b"\0" * 8)}},
        {"$npscalar": {"dtype": "<f4", "shape": [], "data": b64(b"\0" * 4)}},
        {"$npscalar": {"dtype": 4, "data": b64(b"\0" * 4)}},
        float("nan"), [float("inf")], (1, 2), b"x", {1: 2}, {"a": object()}, {"a": {1, 2}},
    ],
    ids=short_id,
)
def test_malformed_trees(tree):
    with pytest.raises(CorruptSnapshotError):
        decode(tree)


def test_malformed_pickle_with_opt_in_is_corrupt():
    with pytest.raises(CorruptSnapshotError):
        decode({"$pickle": b64(b"not a pickle")}, allow_pickle=True)
    with pytest.raises(CorruptSnapshotError):
        decode({"$pickle": "%%"}, allow_pickle=True)
    with pytest.raises(CorruptSnapshotError):
        decode({"$pickle": 3}, allow_pickle=True)


def test_malformed_messages_name_the_place():
    with pytest.raises(CorruptSnapshotError, match=r'at opt\.groups\[1\]\["a b"\]: \$int payload'):
        decode({"opt": {"groups": [0, {"a b": {"$int": 1}}]}})


def _mentions_pickle(tree):
    if isinstance(tree, dict):
        return "$pickle" in tree or any(_mentions_pickle(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_mentions_pickle(v) for v in tree)
    return False


def _decode_or_corrupt(tree):
    try:
        decode(tree)
    except CorruptSnapshotError:
        pass
    except EncodingError:
        assert _mentions_pickle(tree)  # the only EncodingError decode raises: pickle refused


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
    st.sampled_from(["nan", "inf", "-inf", "0x1f", "-0x1", "<f4", ">i8", "|b1", "|O8", "<f3", "AAAA", "AQ==", "!!", ""]),
    st.binary(max_size=8).map(b64),
)
json_keys = st.one_of(
    st.sampled_from(sorted(["$int", "$float", "$str", "$bytes", "$bytearray", "$tuple", "$set", "$frozenset",
                            "$dict", "$ndarray", "$npscalar", "$pickle", "$x", "$", "$$", "$$int",
                            "dtype", "shape", "data"])),
    st.text(max_size=4),
)
json_trees = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(json_keys, inner, max_size=3),
        st.builds(lambda k, v: {k: v}, json_keys, inner),  # single-key nodes: mostly tagged
    ),
    max_leaves=15,
)


@settings(max_examples=500, deadline=None)
@given(json_trees)
def test_fuzz_random_trees(tree):
    _decode_or_corrupt(tree)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values, json_trees, st.randoms(use_true_random=False))
def test_fuzz_mutated_encodings(value, junk, rnd):
    """Replace one random node of a valid encoding by random JSON: decode fails cleanly or works."""
    tree = through_json(encode(value))
    slots = []

    def collect(node):
        if isinstance(node, dict):
            for k in node:
                slots.append((node, k))
                collect(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                slots.append((node, i))
                collect(node[i])

    collect(tree)
    if not slots:
        return
    parent, key = rnd.choice(slots)
    parent[key] = junk
    _decode_or_corrupt(tree)


# ---------------------------------------------------------------------------------------- walker


def canonical(node):
    return json.dumps(node, sort_keys=True, ensure_ascii=False)


def expected_nodes(v, path=()):
    """What walk(encode(v)) must find, from the spec: containers by kind, leaves by their
    encoding; keys of dicts with a non-str key as their encoding, set elements unordered ("*")."""
    t = type(v)
    if t in (list, tuple):
        yield path, "list" if t is list else "$tuple"
        for i, x in enumerate(v):
            yield from expected_nodes(x, path + (i,))
    elif t in (set, frozenset):
        yield path, "$" + t.__name__
        for x in v:
            yield from expected_nodes(x, path + ("*",))
    elif t is dict and all(type(k) is str and canonical_ok(k) for k in v):
        yield path, "dict"
        for k, x in v.items():
            yield from expected_nodes(x, path + (k,))
    elif t is dict:
        yield path, "$dict"
        for k, x in v.items():
            yield from expected_nodes(x, path + (canonical(through_json(encode(k))),))
    else:
        yield path, "leaf", canonical(through_json(encode(v)))


def canonical_ok(key):
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def walked_nodes(tree):
    kinds = {}  # by repr(path): a $dict key in a path is an encoded node, maybe a dict
    for path, kind, node in tree_walk.walk(tree):
        kinds[repr(path)] = kind
        parents = [kinds[repr(path[:i])] for i in range(len(path))]
        shown = tuple("*" if parent in ("$set", "$frozenset")
                      else canonical(key) if parent == "$dict" else key
                      for parent, key in zip(parents, path))
        yield (shown, kind) if kind in tree_walk.CONTAINER_KINDS else (shown, "leaf", canonical(node))


@settings(deadline=None)
@given(values)
def test_walk_finds_every_container_and_leaf_of_the_value_at_its_path(value):
    tree = through_json(encode(value))
    assert sorted(map(repr, walked_nodes(tree))) == sorted(map(repr, expected_nodes(value)))


def test_walk_goes_parents_first_in_stored_order_and_stops_early():
    tree = encode({"a": [1, (2, 3)], "b": {4: "x"}})
    assert [(path, kind) for path, kind, _ in tree_walk.walk(tree)] == [
        ((), "dict"), (("a",), "list"), (("a", 0), "value"), (("a", 1), "$tuple"),
        (("a", 1, 0), "value"), (("a", 1, 1), "value"), (("b",), "$dict"), (("b", 4), "value")]
    damaged_later = [1, {"$tuple": "not a list"}]
    assert next(tree_walk.walk(damaged_later))[1] == "list"
    with pytest.raises(CorruptSnapshotError, match=r"at \[1\]: \$tuple payload must be a list"):
        list(tree_walk.walk(damaged_later))


def test_walk_unescapes_dollar_keys():
    value = {"$x": 1, "$$y": 2, "$": 3, "$tuple": {"$int": 4}, "a$": 5}
    tree = encode(value)
    assert list(tree) == ["$$x", "$$$y", "$$", "$$tuple", "a$"]
    assert [key for key, _ in tree_walk.children(tree)] == list(value)
    assert tree_walk.kind_of(tree["$$tuple"]) == "dict"  # a user's dict, not an $int node
    assert [tree_walk.unescape_key(k) for k in ("$$x", "$$$y", "$$", "x", "a$$")] == [
        "$x", "$$y", "$", "x", "a$$"]
    assert decode(tree) == value


def test_walk_reports_every_tag_and_passes_caller_tags_through():
    value = {"big": 2**70, "nan": float("nan"), "bad": "\udc80", "b": b"ab", "ba": bytearray(b"c"),
             "t": (1,), "s": {1}, "fs": frozenset({2}), "d": {1: 2}, "arr": np.zeros(2, "<f4"),
             "np": np.float32(1), "pickled": fractions.Fraction(1, 3), "tensor": object()}
    tree = encode(value, allow_pickle=True,
                  leaf=lambda v, path: {"$tensor": 0} if path == "tensor" else NotImplemented)
    kinds = {path: kind for path, kind, _ in tree_walk.walk(tree)}
    assert {kinds[(k,)] for k in value} == {
        "$int", "$float", "$str", "$bytes", "$bytearray", "$tuple", "$set", "$frozenset", "$dict",
        "$ndarray", "$npscalar", "$pickle", "$tensor"}
    assert tree_walk.tag_of(tree["tensor"]) == "$tensor" and tree_walk.children(tree["tensor"]) == []
    assert not any(path[:1] == ("arr",) and len(path) > 1 for path in kinds)  # payloads are leaves
    assert tree_walk.tag_of(tree) is None and tree_walk.tag_of([1]) is None


def test_payload_nbytes_counts_base64_payloads_without_decoding():
    hostile = {"$pickle": b64(b"cos\nsystem\n(S'echo pwned'\ntR.")}  # os.system if unpickled
    assert [kind for _, kind, _ in tree_walk.walk(hostile)] == ["$pickle"]
    assert tree_walk.payload_nbytes(hostile) == len(b"cos\nsystem\n(S'echo pwned'\ntR.")
    for data in (b"", b"a", b"ab", b"abc", b"abcd"):
        assert tree_walk.payload_nbytes(encode(data)) == len(data)
        assert tree_walk.payload_nbytes(encode(bytearray(data))) == len(data)
    assert tree_walk.payload_nbytes(encode("\udc80x")) == 4
    assert tree_walk.payload_nbytes(encode((1,))) is None and tree_walk.payload_nbytes(3) is None
    with pytest.raises(CorruptSnapshotError):
        tree_walk.payload_nbytes({"$bytes": 3})


@pytest.mark.parametrize("tree", [
    {"$tuple": [], "x": 1}, {"a": {"$x": 1, "$y": 2}}, {"$tuple": 5}, {"$set": {}},
    {"$dict": [[1]]}, {"$dict": [{"k": 1}]}, {"$dict": 3}, [(1, 2)], {"a": b"x"}, [float("nan")],
    {1: 2},
], ids=short_id)
def test_walk_rejects_malformed_trees(tree):
    with pytest.raises(CorruptSnapshotError):
        list(tree_walk.walk(tree))


def test_walk_refuses_nesting_deeper_than_the_decoder():
    tree = 1
    for _ in range(102):  # the innermost list is at depth 101
        tree = [tree]
    with pytest.raises(CorruptSnapshotError, match="nested deeper"):
        decode(tree)
    with pytest.raises(CorruptSnapshotError, match="nested deeper"):
        list(tree_walk.walk(tree))
    decode(tree[0])
    assert len(list(tree_walk.walk(tree[0]))) == 102


@settings(max_examples=300, deadline=None)
@given(json_trees)
def test_walk_takes_every_tree_the_decoder_takes(tree):
    """The walker checks the structure (tags, containers, depth), not leaf payloads: every tree
    that decodes (unknown tags left to the caller) walks."""
    try:
        decode(tree, leaf=lambda node: None)
        decoded = True
    except CorruptSnapshotError:
        decoded = False
    except EncodingError:
        return
    try:
        list(tree_walk.walk(tree))
        walked = True
    except CorruptSnapshotError:
        walked = False
    if decoded:
        assert walked


# ------------------------------------------------------------------------------------ isolation


def test_module_does_not_import_torch():
    code = "import sys, async_ckpt.format.values; assert 'torch' not in sys.modules, 'torch imported'"
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


COLLIDING = 2**61 - 1  # hash(k * COLLIDING) == 0 for every int k: Python's int hash is public


@pytest.mark.parametrize("tag", ["$dict", "$set", "$frozenset"])
def test_keys_made_to_collide_are_refused_before_any_is_inserted(tag):
    """Issue 28: 60,000 such keys took 42 s to decode (each insertion walks every earlier key).
    More than MAX_SAME_HASH keys that share a hash are damage; up to it they decode."""
    def node(count):
        keys = [{"$int": hex(k * COLLIDING)} for k in range(1, count + 1)]
        return {tag: [[k, 0] for k in keys] if tag == "$dict" else keys}

    assert len(decode(node(tree_walk.MAX_SAME_HASH))) == tree_walk.MAX_SAME_HASH
    with pytest.raises(CorruptSnapshotError, match="share a hash"):
        decode(node(20_000))


def test_many_honest_keys_decode():
    value = {"d": {k: k for k in range(50_000)}, "s": set(range(50_000)),
             "f": frozenset(float(k) + 0.5 for k in range(50_000))}
    assert decode(json.loads(json.dumps(encode(value)))) == value
