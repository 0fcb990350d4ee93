"""The torch side of the training state, known alike to the side that saves it (``train/``) and
the sides that read it back or put it back (``read/``, ``data.py``, ``tools/``): which dtypes a
tensor may have, the piece of a sharded tensor (``DTensor``)
a rank holds, and which registered values are stateful objects. It sits below all of them, so
that what capture writes and what restore checks is defined once.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from .errors import LayoutError
from .rng import generator_adapter

ALL_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
              if isinstance(d, torch.dtype)}
"""Every torch dtype by name: what a ``$dtype`` value (a dtype kept as a setting) may name."""
DTYPES = {name: d for name, d in ALL_DTYPES.items() if not re.fullmatch(r"q\w+|u?int[1-7]", name)}
"""The dtypes a saved tensor may have: all but the quantized ones and the sub-byte integers
(uint1-7, int1-7), which torch can create but not copy or clone: a tensor of them could be
neither staged nor used once loaded."""


def as_stateful(obj: Any) -> Any:
    """``obj`` itself if it has ``state_dict``/``load_state_dict``, an adapter for a torch or NumPy
    generator, else None."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    return generator_adapter(obj)


def registered_objects(state: Any, kinds: tuple[type, ...]) -> list:
    """The objects of ``kinds`` in the registered ``state``: registered directly, in (nested)
    dicts, or as attributes of a registered object (an ``AppState`` holding the model and the
    optimizer); each once."""
    found: dict[int, Any] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, kinds):
            found.setdefault(id(value), value)
        elif isinstance(value, Mapping) and depth < 8:
            for item in value.values():
                visit(item, depth + 1)
        elif depth < 8 and hasattr(value, "state_dict") and hasattr(value, "__dict__"):
            for item in vars(value).values():
                if isinstance(item, kinds):
                    found.setdefault(id(item), item)

    visit(state, 0)
    return list(found.values())


def is_dtensor(value: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (without importing torch.distributed where it is
    not built)."""
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor" and hasattr(
        value, "placements")


def dtensor_box(t: Any) -> tuple[tuple, tuple]:
    """The shape and global offset of the piece of DTensor ``t`` this rank holds. LayoutError
    where torch lacks the public ``torch.distributed.tensor`` (before 2.5)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:
        raise LayoutError(f"sharded tensors (DTensor) need torch 2.5 or later, this is "
                          f"{torch.__version__}: upgrade torch") from e
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
