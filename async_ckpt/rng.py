"""The process-wide random number generators, as one stateful object.

Without them a resumed run draws different dropout masks and augmentations than the run it
continues, and its loss curve drifts. Captured: Python's ``random``, NumPy's global RNG, torch's CPU
generator, and the CUDA generator of every device once CUDA is in use (checking for CUDA never
initialises it, so a CPU job on a GPU machine creates no CUDA context). Generators the user owns
(``torch.Generator``, ``numpy.random.Generator``) are registered as ordinary state entries.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

log = logging.getLogger(__name__)


class GlobalRNG:
    """``state_dict``/``load_state_dict`` over the global generators of this process."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
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


class TorchGenerator:
    """A ``torch.Generator`` seen as a stateful object (it has get_state/set_state instead)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict:
        return {"torch_generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
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

    def load_state_dict(self, state: dict) -> None:
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
