"""rng.py alone: the global and user-owned generators round-trip, and every saved state is checked
before a generator gets it (NumPy and torch trust positions inside their states and read out of
bounds with crafted ones).

Whatever a test loads into a generator is drawn from in a forked child (``fuzzing.draw_in_child``):
a state that gets past the checks and crashes the C code it reaches fails that test, with the
signal named, instead of killing the test run. The fuzz tests hold every position field to one
rule: refused with the generator unchanged, or accepted and safe to draw from.
"""

import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_ckpt.errors import CorruptSnapshotError, StateMismatchError
from async_ckpt.rng import GlobalRNG, NumpyGenerator, TorchGenerator, generator_adapter
from fuzzing import draw_in_child

BIT_GENERATORS = ["MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"]
MT_N = 624  # Mersenne Twister state words: positions run from 0 to 624
HANG_GUARD_S = 60  # a draw that hangs fails after this long (a guard, not a bound on the test)


def test_global_rng_round_trips_every_generator():
    rng = GlobalRNG()
    saved = rng.state_dict()
    expected = (random.random(), np.random.random(), torch.rand(1))
    random.random(), np.random.random(), torch.rand(3)
    rng.load_state_dict(saved)
    assert (random.random(), np.random.random()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


@pytest.mark.parametrize("name", BIT_GENERATORS)
def test_numpy_bit_generators_round_trip_and_refuse_another_kind(name):
    generator = np.random.Generator(getattr(np.random, name)(5))
    adapter = generator_adapter(generator)
    saved = adapter.state_dict()
    expected = generator.random(3)
    generator.random(7)
    adapter.load_state_dict(saved)
    assert np.array_equal(generator.random(3), expected)
    other = "PCG64" if name != "PCG64" else "SFC64"
    with pytest.raises(StateMismatchError):
        generator_adapter(np.random.Generator(getattr(np.random, other)())).load_state_dict(saved)


def _plain(state):
    """A generator state with tensors and arrays as bytes, comparable with ==."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    if isinstance(state, torch.Tensor):
        return ("tensor", state.numpy().tobytes())
    if isinstance(state, np.ndarray):
        return ("array", state.dtype.str, state.tobytes())
    return state


def _torch_state(left, next_, seeded=1):
    """A torch CPU generator state with its Mersenne Twister header (seed, left, seeded, next)
    set as given."""
    state = bytearray(torch.Generator().manual_seed(3).get_state().numpy().tobytes())
    struct.pack_into("<iiQ", state, 8, left, seeded, next_)
    return torch.frombuffer(state, dtype=torch.uint8).clone()


def _python_state(index):
    version, words, gauss = random.getstate()
    return version, words[:624] + (index,), gauss


def _numpy_legacy(pos):
    name, key, _, has_gauss, cached = np.random.RandomState(1).get_state()
    return name, key, pos, has_gauss, cached


def _philox(buffer_pos):
    state = np.random.Philox(1).state
    state["buffer_pos"] = buffer_pos
    return state


CRAFTED = {
    # torch reads its state at index `next` without checking it against `left`
    "torch-next-past-the-end": (lambda: TorchGenerator(torch.Generator()),
                                lambda: {"torch_generator": _torch_state(624, 624)}),
    "torch-wrong-size": (lambda: TorchGenerator(torch.Generator()),
                         lambda: {"torch_generator": torch.zeros(16, dtype=torch.uint8)}),
    "torch-not-uint8": (lambda: TorchGenerator(torch.Generator()),
                        lambda: {"torch_generator": torch.zeros(5056, dtype=torch.int8)}),
    "numpy-legacy-position": (lambda: NumpyGenerator(np.random.RandomState(0)),
                              lambda: {"numpy_random_state": _numpy_legacy(10**6)}),
    "numpy-legacy-short-key": (lambda: NumpyGenerator(np.random.RandomState(0)),
                               lambda: {"numpy_random_state": ("MT19937", np.zeros(3, np.uint32),
                                                               0, 0, 0.0)}),
    "mt19937-position": (lambda: NumpyGenerator(np.random.MT19937(0)),
                         lambda: {"numpy_bit_generator": {"bit_generator": "MT19937", "state": {
                             "key": np.zeros(624, np.uint32), "pos": 625}}}),
    "philox-buffer-position": (lambda: NumpyGenerator(np.random.Philox(0)),
                               lambda: {"numpy_bit_generator": _philox(5)}),
    "pcg64-state-too-large": (lambda: NumpyGenerator(np.random.PCG64(0)),
                              lambda: {"numpy_bit_generator": {
                                  "bit_generator": "PCG64", "state": {"state": 2**128, "inc": 1},
                                  "has_uint32": 0, "uinteger": 0}}),
    "not-a-dict": (lambda: NumpyGenerator(np.random.PCG64(0)), lambda: {"numpy_bit_generator": [1]}),
    "legacy-name-an-array": (lambda: NumpyGenerator(np.random.RandomState(0)),
                             lambda: {"numpy_random_state": (np.zeros(2),) + _numpy_legacy(0)[1:]}),
    "torch-not-contiguous": (lambda: TorchGenerator(torch.Generator()), lambda: {
        "torch_generator": torch.Generator().get_state().repeat(2)[::2]}),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_generator_states_are_refused_before_the_generator_changes(case):
    make_adapter, make_state = CRAFTED[case]
    adapter = make_adapter()
    before = adapter.state_dict()
    with pytest.raises(CorruptSnapshotError):
        adapter.load_state_dict(make_state())
    assert _plain(adapter.state_dict()) == _plain(before)


def assert_draws_survive(draw) -> None:
    """Call ``draw`` in a forked child: fails, naming the signal, if it crashes the process."""
    problem = draw_in_child({"the loaded generator": draw}, HANG_GUARD_S)
    assert problem is None, problem


def refused_or_safe(adapter, state, draw) -> None:
    """The rule for a state read from a file: refused with the generator unchanged, or loaded
    and safe to ``draw`` from."""
    before = _plain(adapter.state_dict())
    try:
        adapter.load_state_dict(state)
    except (CorruptSnapshotError, StateMismatchError):
        assert _plain(adapter.state_dict()) == before
    else:
        assert_draws_survive(draw)


@pytest.mark.parametrize("left, next_", [(1, 0), (624, 1), (1, 624), (300, 325)])
def test_every_reachable_torch_position_is_accepted(left, next_):
    adapter = TorchGenerator(torch.Generator())
    adapter.load_state_dict({"torch_generator": _torch_state(left, next_)})
    assert_draws_survive(lambda: torch.rand(2000, generator=adapter.generator))


# Integers a crafted file may put where a position goes: near the valid range, and anywhere.
def near_and_anywhere(low: int, high: int) -> st.SearchStrategy[int]:
    """Integers in ``[low, high]``: often near the positions a Mersenne Twister uses, else any."""
    return st.integers(max(low, -2), min(high, MT_N + 2)) | st.integers(low, high)


INT32 = near_and_anywhere(-2**31, 2**31 - 1)
UINT64 = near_and_anywhere(0, 2**64 - 1)
ANY_INT = near_and_anywhere(-2**64, 2**64)
FLAG = st.sampled_from([0, 1]) | ANY_INT  # has_gauss, has_uint32: 0 or 1 when valid
# torch's (left, next): reachable ones (left + next = 625, or the fresh (1, 0)) and any others.
TORCH_POSITIONS = (st.integers(1, MT_N).map(lambda left: (left, MT_N + 1 - left))
                   | st.just((1, 0)) | st.tuples(INT32, UINT64))


@settings(max_examples=60, deadline=None)
@given(position=TORCH_POSITIONS, seeded=st.sampled_from([1, 0]) | INT32)
def test_fuzz_torch_generator_states_are_refused_or_safe(position, seeded):
    adapter = TorchGenerator(torch.Generator())
    refused_or_safe(adapter, {"torch_generator": _torch_state(*position, seeded)},
                    lambda: torch.rand(2000, generator=adapter.generator))


@settings(max_examples=60, deadline=None)
@given(position=ANY_INT, has_gauss=FLAG)
def test_fuzz_numpy_legacy_states_are_refused_or_safe(position, has_gauss):
    legacy = np.random.RandomState(0)
    name, key, _, _, cached = np.random.RandomState(1).get_state()
    refused_or_safe(NumpyGenerator(legacy),
                    {"numpy_random_state": (name, key, position, has_gauss, cached)},
                    lambda: (legacy.random_sample(2000), legacy.standard_normal(3)))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(BIT_GENERATORS), position=ANY_INT, has_uint32=FLAG,
       uinteger=st.integers(0, 2**32 - 1) | ANY_INT)
def test_fuzz_numpy_bit_generator_states_are_refused_or_safe(name, position, has_uint32,
                                                             uinteger):
    generator = np.random.Generator(getattr(np.random, name)(1))
    state = generator.bit_generator.state
    if name == "MT19937":
        state["state"]["pos"] = position
    elif name == "Philox":
        state["buffer_pos"] = position
    if "has_uint32" in state:
        state["has_uint32"], state["uinteger"] = has_uint32, uinteger
    refused_or_safe(generator_adapter(generator), {"numpy_bit_generator": state},
                    lambda: (generator.random(2000), generator.integers(0, 10, 5, np.uint32)))


@settings(max_examples=40, deadline=None)
@given(python_index=ANY_INT, numpy_position=ANY_INT)
def test_fuzz_global_rng_states_are_refused_or_safe(python_index, numpy_position):
    rng = GlobalRNG()
    saved = rng.state_dict()
    crafted = dict(saved, python=_python_state(python_index), numpy=_numpy_legacy(numpy_position))
    try:
        refused_or_safe(rng, crafted,
                        lambda: (random.random(), np.random.random(2000), torch.rand(2000)))
    finally:
        rng.load_state_dict(saved)


@pytest.mark.parametrize("python, numpy_pos", [(_python_state(625), 0), (_python_state(0), -1),
                                               (_python_state(0), True)])
def test_global_rng_refuses_crafted_states_and_changes_nothing(python, numpy_pos):
    rng = GlobalRNG()
    saved = rng.state_dict()
    crafted = dict(saved, python=python, numpy=_numpy_legacy(numpy_pos))
    with pytest.raises(CorruptSnapshotError):
        rng.load_state_dict(crafted)
    assert random.getstate() == saved["python"]
    assert torch.equal(torch.get_rng_state(), saved["torch"])
