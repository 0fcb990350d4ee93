"""The process-wide random number generators, as one stateful object, and the generators a user
registers, with the checks of every saved RNG state.

Without them a resumed run draws different dropout masks and augmentations than the run it
continues, and its loss curve drifts. Captured: Python's ``random``, NumPy's global RNG, torch's CPU
generator, and the CUDA generator of every device once CUDA is in use (checking for CUDA never
initialises it, so a CPU job on a GPU machine creates no CUDA context). Generators the user owns
(``torch.Generator``, ``numpy.random.Generator``) are registered as ordinary state entries, seen
through the adapters below. The side that saves them (``train/``) and the sides that check and
load them (``read/``, the engine, the framework adapters) all take them from here.
"""

from __future__ import annotations

import logging
import random
import struct

import numpy as np
import torch
import xxhash

from .checks import is_int
from .errors import CorruptSnapshotError, StateMismatchError

log = logging.getLogger(__name__)

# Every state is checked before any generator is changed: an RNG state read from a file reaches
# C code that trusts it (torch reads its Mersenne Twister at an index taken from the state, NumPy's
# legacy generator likewise), so a crafted one reads out of bounds, or crashes, at the next draw.
_MT_N = 624  # Mersenne Twister state words
_UINT32, _UINT64, _UINT128 = 2**32, 2**64, 2**128
_TORCH_CPU_STATE_BYTES = torch.Generator().get_state().numel()
_TORCH_MT_HEADER = struct.Struct("<QiiQ")  # initial seed, left, seeded, next; then the MT words
_CUDA_STATE_BYTES = (8, 16)  # a CUDA generator's state: its seed and its Philox offset


def _bad(what: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"the saved {what} is malformed; the snapshot was damaged or crafted")


def _is_array(v, dtype, shape: tuple) -> bool:
    return type(v) is np.ndarray and v.dtype == np.dtype(dtype) and v.shape == shape


def check_python_state(state) -> None:
    """A ``random.getstate()`` value: (3, 624 words and an index in [0, 624], None or a float)."""
    if not (type(state) is tuple and len(state) == 3 and type(state[0]) is int and state[0] == 3
            and type(state[1]) is tuple and len(state[1]) == _MT_N + 1
            and all(is_int(w, 0, _UINT32 - 1) for w in state[1][:_MT_N])
            and is_int(state[1][_MT_N], 0, _MT_N)
            and (state[2] is None or type(state[2]) is float)):
        raise _bad("Python random state")


def check_numpy_legacy_state(state) -> None:
    """A ``RandomState.get_state()`` tuple: ("MT19937", 624 uint32 words, a position in [0, 624],
    has_gauss 0/1, the cached Gaussian)."""
    if not (type(state) is tuple and len(state) == 5 and type(state[0]) is str
            and state[0] == "MT19937"
            and _is_array(state[1], np.uint32, (_MT_N,)) and is_int(state[2], 0, _MT_N)
            and is_int(state[3], 0, 1) and type(state[4]) is float):
        raise _bad("NumPy RandomState state")


def _flags_ok(state: dict) -> bool:
    return is_int(state.get("has_uint32"), 0, 1) and is_int(state.get("uinteger"), 0, _UINT32 - 1)


# The ``bit_generator.state`` dict of each NumPy bit generator, key by key.
_BIT_GENERATOR_STATES = {
    "MT19937": lambda s: set(s) == {"bit_generator", "state"} and type(s["state"]) is dict
    and set(s["state"]) == {"key", "pos"} and _is_array(s["state"]["key"], np.uint32, (_MT_N,))
    and is_int(s["state"]["pos"], 0, _MT_N),
    "PCG64": lambda s: set(s) == {"bit_generator", "state", "has_uint32", "uinteger"}
    and type(s["state"]) is dict and set(s["state"]) == {"state", "inc"}
    and is_int(s["state"]["state"], 0, _UINT128 - 1) and is_int(s["state"]["inc"], 0, _UINT128 - 1)
    and _flags_ok(s),
    "Philox": lambda s: set(s) == {"bit_generator", "state", "buffer", "buffer_pos", "has_uint32",
                                   "uinteger"}
    and type(s["state"]) is dict and set(s["state"]) == {"counter", "key"}
    and _is_array(s["state"]["counter"], np.uint64, (4,))
    and _is_array(s["state"]["key"], np.uint64, (2,)) and _is_array(s["buffer"], np.uint64, (4,))
    and is_int(s["buffer_pos"], 0, 4) and _flags_ok(s),
    "SFC64": lambda s: set(s) == {"bit_generator", "state", "has_uint32", "uinteger"}
    and type(s["state"]) is dict and set(s["state"]) == {"state"}
    and _is_array(s["state"]["state"], np.uint64, (4,)) and _flags_ok(s),
}
_BIT_GENERATOR_STATES["PCG64DXSM"] = _BIT_GENERATOR_STATES["PCG64"]


def check_bit_generator_state(state, expected: str) -> None:
    """A ``bit_generator.state`` dict of the bit generator named ``expected``."""
    if type(state) is not dict or type(state.get("bit_generator")) is not str:
        raise _bad("NumPy bit generator state")
    name = state["bit_generator"]
    if name != expected:
        raise StateMismatchError(f"the snapshot holds a {name[:40]!r} bit generator state, the "
                                 f"registered generator is a {expected}; register the same kind")
    check = _BIT_GENERATOR_STATES.get(name)
    if check is None or not check(state):
        raise _bad(f"NumPy {name} state")


def check_torch_state(state, device: torch.device) -> None:
    """A torch generator state: a uint8 tensor of the size this build uses for ``device``; for
    the CPU one, its Mersenne Twister position must be one a draw can reach (torch does not check
    it and reads its state out of bounds)."""
    if not (type(state) is torch.Tensor and state.dtype == torch.uint8 and state.dim() == 1
            and state.is_contiguous()):
        raise _bad("torch generator state")
    if device.type != "cpu":
        if state.numel() not in _CUDA_STATE_BYTES:
            raise _bad(f"CUDA generator state ({state.numel()} bytes)")
        return
    if state.numel() != _TORCH_CPU_STATE_BYTES:
        raise _bad(f"torch CPU generator state ({state.numel()} bytes, not {_TORCH_CPU_STATE_BYTES})")
    _, left, seeded, next_ = _TORCH_MT_HEADER.unpack(state[:_TORCH_MT_HEADER.size].numpy().tobytes())
    if seeded != 1 or not ((left, next_) == (1, 0) or (1 <= left <= _MT_N and left + next_ == _MT_N + 1)):
        raise _bad("torch CPU generator state (Mersenne Twister position)")


class GlobalRNG:
    """``state_dict``/``load_state_dict`` over the global generators of this process."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():  # (implies is_available(), which costs more)
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def check_state(state) -> None:
        """Raise CorruptSnapshotError unless ``state`` is what ``state_dict`` returns."""
        if type(state) is not dict or not {"python", "numpy", "torch"} <= set(state) <= {
                "python", "numpy", "torch", "cuda"}:
            raise _bad("global RNG entry")
        check_python_state(state["python"])
        check_numpy_legacy_state(state["numpy"])
        check_torch_state(state["torch"], torch.device("cpu"))
        cuda = state.get("cuda")
        if cuda is not None:
            if type(cuda) is not list:
                raise _bad("CUDA RNG states")
            for device_state in cuda:
                check_torch_state(device_state, torch.device("cuda"))

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        saved_cuda = state.get("cuda")
        if saved_cuda is None or not torch.cuda.is_available():
            if saved_cuda is not None:
                log.warning("the snapshot holds CUDA RNG states but CUDA is not available; "
                            "they are not restored")
            return
        devices = torch.cuda.device_count()
        if len(saved_cuda) != devices:
            log.warning("the snapshot holds CUDA RNG states of %d devices, this process sees %d; "
                        "restoring the first %d", len(saved_cuda), devices, min(devices, len(saved_cuda)))
        for device, rng_state in enumerate(saved_cuda[:devices]):
            torch.cuda.set_rng_state(rng_state, device)


    @staticmethod
    def derive(state: dict, salt: int) -> None:
        """Seed every global generator from a digest of a saved ``state`` and ``salt``: a
        stream of its own, the same at every restart, for a rank that has no saved stream (a
        restore on more ranks than saved)."""
        seed = xxhash.xxh3_64_intdigest(state["torch"].numpy().tobytes()
                                        + salt.to_bytes(8, "little"))
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # the CPU generator and every CUDA device's


class TorchGenerator:
    """A ``torch.Generator`` seen as a stateful object (it has get_state/set_state instead)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict:
        return {"torch_generator": self.generator.get_state()}

    def check_state(self, state) -> None:
        if type(state) is not dict or set(state) != {"torch_generator"}:
            raise _bad("torch.Generator entry")
        check_torch_state(state["torch_generator"], self.generator.device)

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.generator.set_state(state["torch_generator"])


class NumpyGenerator:
    """A ``numpy.random.Generator``, ``BitGenerator`` or ``RandomState`` seen as a stateful object."""

    def __init__(self, generator):
        self.bit_generator = generator.bit_generator if isinstance(generator, np.random.Generator) \
            else generator

    def state_dict(self) -> dict:
        if isinstance(self.bit_generator, np.random.RandomState):
            return {"numpy_random_state": self.bit_generator.get_state()}
        return {"numpy_bit_generator": self.bit_generator.state}

    def check_state(self, state) -> None:
        legacy = isinstance(self.bit_generator, np.random.RandomState)
        key = "numpy_random_state" if legacy else "numpy_bit_generator"
        if type(state) is not dict or set(state) != {key}:
            raise StateMismatchError(
                f"the snapshot's generator entry is not a {key} state, as the registered "
                f"{type(self.bit_generator).__name__} needs")
        if legacy:
            check_numpy_legacy_state(state[key])
        else:
            check_bit_generator_state(state[key], type(self.bit_generator).__name__)

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        if isinstance(self.bit_generator, np.random.RandomState):
            self.bit_generator.set_state(state["numpy_random_state"])
        else:
            self.bit_generator.state = state["numpy_bit_generator"]


def generator_adapter(obj):
    """The stateful view of a user-owned generator, or None when ``obj`` is not one."""
    if isinstance(obj, torch.Generator):
        return TorchGenerator(obj)
    if isinstance(obj, (np.random.Generator, np.random.BitGenerator, np.random.RandomState)):
        return NumpyGenerator(obj)
    return None
