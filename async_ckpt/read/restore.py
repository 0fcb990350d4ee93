"""Loading a snapshot that was read (``snapshot.py``) into the registered objects.

Everything is checked before anything loads: the snapshot against the registered state (missing,
unexpected and mismatched keys are listed together), and only then is anything written into the
user's objects. An object that still refuses its state puts every object back; the copies into
modules and tensors that follow are not undone (``_load`` says what a failure there leaves).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping, MutableMapping, Optional

import torch

from ..errors import CheckpointError, StateMismatchError
from ..format.tree import NodeKind
from ..format.values import child_path
from ..rng import NumpyGenerator, TorchGenerator
from ..tensors import as_stateful, is_dtensor
from .snapshot import Entry

log = logging.getLogger(__name__)


# --- loading into the registered objects -------------------------------------------------------

class _Mismatch:
    def __init__(self):
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []
        self.skipped: list[str] = []  # strict=False: objects left as they are, and why
        self.skip_ids: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def error(self, step: int) -> StateMismatchError:
        parts = [f"{name}: {', '.join(keys)}" for name, keys in
                 (("missing from the checkpoint", self.missing), ("unexpected in the checkpoint",
                  self.unexpected), ("mismatched", self.mismatched)) if keys]
        return StateMismatchError(
            f"snapshot of step {step} does not fit the registered state; nothing was loaded. "
            + "; ".join(parts) + ". Register the same objects as when saving, or pass strict=False "
            "to load only what matches")


def check_generator_states(state: Mapping[str, Any], loaded: Entry) -> None:
    """Raise CorruptSnapshotError (damage: restore falls back) for a saved generator state that
    the registered generator must not be given, before anything is loaded: such states reach C
    code that trusts them (see ``rng.py``)."""
    if loaded.kind == NodeKind.DICT and isinstance(state, Mapping) and as_stateful(state) is None:
        for key in loaded.value.keys() & state.keys():
            check_generator_states(state[key], loaded.value[key])
    elif loaded.kind == NodeKind.OBJECT:
        adapter = as_stateful(state)
        if isinstance(adapter, (TorchGenerator, NumpyGenerator)):
            adapter.check_state(loaded.value)


def mismatch_error(state: MutableMapping[str, Any], loaded: Entry, step: int,
                   strict: bool = True) -> Optional[StateMismatchError]:
    """What keeps ``loaded`` from fitting ``state``, or None when it fits."""
    mismatch = _Mismatch()
    _check("", state, loaded, mismatch, strict)
    return mismatch.error(step) if mismatch else None


def apply(state: MutableMapping[str, Any], loaded: Entry, step: int, strict: bool = True,
          kept_by_state: tuple[type, ...] = ()) -> None:
    """Load ``loaded`` into ``state``'s objects; checks everything before changing anything.

    With ``strict=False`` an optimizer whose saved state does not match its parameters is left as
    it is (loading part of it would leave moments shaped for other parameters), and logged.
    ``kept_by_state``: classes whose objects keep their state in other objects (a loader's
    position is its sampler's), so that only their own ``state_dict`` puts them back when a
    later object refuses its state; the caller knows them (the engine: ``data.py``'s loaders)."""
    mismatch = _Mismatch()
    _check("", state, loaded, mismatch, strict)
    if mismatch:
        raise mismatch.error(step)
    if mismatch.skipped:
        log.warning("restore(strict=False) of step %d left these as they were: %s", step,
                    "; ".join(mismatch.skipped))
    _load(state, loaded, strict, mismatch.skip_ids, loaded.borrowed, kept_by_state)


def _tensor_mismatch(current: torch.Tensor, saved: Any) -> Optional[str]:
    if not isinstance(saved, torch.Tensor):
        return f"saved value is a {type(saved).__name__}, not a tensor"
    if current.shape != saved.shape or current.dtype != saved.dtype:
        return (f"saved {saved.dtype} {tuple(saved.shape)} vs current "
                f"{current.dtype} {tuple(current.shape)}")
    return None


def _check(path: str, current: Any, saved: Entry, mismatch: _Mismatch, strict: bool) -> None:
    where = path or "<state>"
    if saved.kind == NodeKind.DICT:
        if not isinstance(current, MutableMapping) or as_stateful(current) is not None:
            mismatch.mismatched.append(f"{where} (saved a dict, registered a {type(current).__name__})")
            return
        for key in saved.value.keys() - current.keys():
            if strict and saved.value[key].kind != NodeKind.VALUE:  # plain values: assigned
                mismatch.unexpected.append(child_path(path, key))
        for key in current.keys() - saved.value.keys():
            if strict:
                mismatch.missing.append(child_path(path, key))
        for key in saved.value.keys() & current.keys():
            _check(child_path(path, key), current[key], saved.value[key], mismatch, strict)
    elif saved.kind == NodeKind.OBJECT:
        if as_stateful(current) is None:
            mismatch.mismatched.append(f"{where} (saved a state_dict, registered a {type(current).__name__})")
        elif isinstance(current, torch.nn.Module):
            _check_module(path, current, saved.value, mismatch, strict)
        elif isinstance(current, torch.optim.Optimizer):
            problem = _optimizer_mismatch(current, saved.value)
            if problem and strict:
                mismatch.mismatched.append(f"{where} ({problem})")
            elif problem:
                mismatch.skipped.append(f"{where} ({problem})")
                mismatch.skip_ids.add(id(current))
        elif isinstance(current, torch.optim.lr_scheduler.LRScheduler):
            problem = _scheduler_mismatch(current, saved.value)
            if problem:
                mismatch.mismatched.append(f"{where} ({problem})")
    elif saved.kind == NodeKind.TENSOR:
        problem = (_tensor_mismatch(current, saved.value) if isinstance(current, torch.Tensor)
                   else f"registered a {type(current).__name__}, not a tensor")
        if problem:
            mismatch.mismatched.append(f"{where} ({problem})")
    elif isinstance(current, (torch.Tensor, Mapping)) or as_stateful(current) is not None:
        # a plain value would be assigned over the object, tensor or dict registered here
        mismatch.mismatched.append(f"{where} (saved a plain value, registered a "
                                   f"{type(current).__name__})")


def _check_module(path: str, module: torch.nn.Module, saved: Any, mismatch: _Mismatch,
                  strict: bool) -> None:
    if not isinstance(saved, Mapping):
        mismatch.mismatched.append(f"{path} (saved state is not a dict)")
        return
    current = module.state_dict()
    if strict:
        mismatch.missing += [child_path(path, k) for k in current if k not in saved]
        mismatch.unexpected += [child_path(path, k) for k in saved if k not in current]
    for key in current.keys() & saved.keys():
        if isinstance(current[key], torch.Tensor):
            problem = _tensor_mismatch(current[key], saved[key])
            if problem and strict:
                mismatch.mismatched.append(f"{child_path(path, key)} ({problem})")


# Per-parameter state of torch's optimizers that has the parameter's shape.
_PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                       "grad_avg", "acc_delta", "sum", "ax", "prev", "exp_inf")


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, saved: Any) -> Optional[str]:
    """Why ``saved`` cannot be loaded into ``optimizer``, or None: it must have the structure
    ``load_state_dict`` relies on (else torch fails half-way through loading), as many parameter
    groups and parameters per group, and per-parameter state shaped like those parameters."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and isinstance(state, dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        return "the saved state is not an optimizer state dict"
    saved_sizes = [len(g["params"]) for g in groups]
    current_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != current_sizes:
        return f"saved parameter groups of sizes {saved_sizes[:8]}, the optimizer has {current_sizes[:8]}"
    ids = [i for g in groups for i in g["params"]]
    if not all(type(i) is int for i in ids) or len(set(ids)) != len(ids) or not set(state) <= set(ids) or not all(
            isinstance(s, dict) for s in state.values()):
        return "the saved per-parameter state does not match its parameter groups"
    own = type(optimizer).__module__.startswith("torch.optim.")
    n = 0
    for live in optimizer.param_groups:
        kernel_steps = own and any(live.get(k) for k in ("fused", "capturable"))
        for param in live["params"]:
            for key, value in state.get(ids[n], {}).items():
                problem = _state_value_mismatch(key, value, param, own, kernel_steps)
                if problem:
                    return f"saved {key} of parameter {n} {problem}"
            n += 1
    filled = _filled_in(optimizer)
    for n, (live, group) in enumerate(zip(optimizer.param_groups, groups)):
        # what a scheduler adds may be on one side only (an optimizer restored without the
        # scheduler it was saved with, or with one it was not), always a number; what the
        # optimizer's class fills in may be missing (saved by an older torch)
        added = {k for k in _SCHEDULER_KEYS if (k in live) != (k in group)}
        for key in added & group.keys():
            if not _is_number(group[key]):
                return f"saved param_groups[{n}].{key} is {_shown(group[key])}, not a number"
        live = {k: v for k, v in live.items() if k != "params" and k not in added
                and (k in group or k not in filled)}
        group = {k: v for k, v in group.items() if k != "params" and k not in added}
        for key in _KERNEL_OPTIONS:
            if key in live and key in group and not _same_option(live[key], group[key]):
                return (f"saved param_groups[{n}].{key} is {_shown(group[key])}, the optimizer's "
                        f"{_shown(live[key])}: it picks the kernels step() runs; build the "
                        "optimizer with the saved setting")
        problem = _value_mismatch(f"param_groups[{n}]", live, group, missing_ok=False)
        if problem:
            return problem
    return None


def _state_value_mismatch(key: str, value: Any, param: torch.Tensor, own: bool,
                          kernel_steps: bool) -> Optional[str]:
    """Why ``value`` cannot be the per-parameter state ``key`` of ``param``, or None. What has
    the parameter's shape has it. torch's ``load_state_dict`` takes any value and the next
    ``step()`` fails on a wrong one, so of torch's own optimizers (``own``) every value must be
    what they keep: a tensor, a number (a step count saved by an older torch), None or a list of
    these (LBFGS's history); ``step`` a number or a one-value tensor, a tensor where the group
    runs fused or capturable kernels (``kernel_steps``); what has the parameter's shape a tensor
    (a momentum buffer may be None)."""
    if key in _PARAM_SHAPED_STATE and isinstance(value, torch.Tensor):
        return None if value.shape == param.shape else (
            f"has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
    if not own:
        return None
    if key == "step" and kernel_steps:
        ok, wanted = isinstance(value, torch.Tensor), "the tensor fused and capturable kernels keep"
    elif key == "step":
        ok, wanted = _is_number(value), "a number"
    elif key in _PARAM_SHAPED_STATE:
        ok, wanted = value is None and key == "momentum_buffer", "a tensor of the parameter's shape"
    else:
        ok = _plain_state(value) or (isinstance(value, (list, tuple))
                                     and all(map(_plain_state, value)))
        wanted = "a tensor, a number, None or a list of them"
    return None if ok else f"is {_shown(value)}, not {wanted}"


def _plain_state(value: Any) -> bool:
    return value is None or isinstance(value, torch.Tensor) or _is_number(value)


def _filled_in(optimizer: torch.optim.Optimizer) -> frozenset:
    """The keys of a parameter group that ``optimizer``'s class sets to a default when a loaded
    group lacks them (its ``__setstate__``: options added by later torch releases), found on a
    scratch instance; none when that cannot be told."""
    cls = type(optimizer)
    group: dict = {"params": []}
    try:
        cls.__setstate__(cls.__new__(cls), {"defaults": dict(optimizer.defaults), "state": {},
                                            "param_groups": [group]})
    except Exception:  # noqa: BLE001 - a class of the user's that needs more: fill in nothing
        return frozenset()
    return frozenset(group) - {"params"}


_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")
"""What torch's LR schedulers add to their optimizer's parameter groups (``initial_lr``; the
cyclic ones the rest), which the optimizer itself never reads."""

_KERNEL_OPTIONS = ("differentiable", "fused", "foreach", "capturable")
"""Options of torch's optimizers that pick the kernels ``step()`` runs rather than what it
computes: a snapshot saved with others is refused, not loaded over the optimizer's (some
combinations fail only at the next step: ``fused`` with ``differentiable``, ``fused`` on a device
without fused kernels)."""


def _same_option(live: Any, saved: Any) -> bool:
    return type(live) is type(saved) and live == saved


def _shown(value: Any) -> str:
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    return f"a {type(value).__name__}"


def _is_number(value: Any) -> bool:
    """A hyper-parameter torch takes as a number: an int or float (not a bool), or a tensor of one
    real value (torch accepts ``lr`` as either)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    return type(value) in (int, float)


def _value_mismatch(path: str, live: Any, saved: Any, missing_ok: bool) -> Optional[str]:
    """Why the ``saved`` hyper-parameters (an optimizer's parameter group, a scheduler's state)
    cannot stand in for the ``live`` object's, or None: the same keys (a key the live one lacks
    would be set as a new attribute or option; with ``missing_ok``, one it has that the snapshot
    lacks keeps its value), and values of the live ones' types, recursively: numbers for numbers
    (int and float alike, or a one-value tensor), None only for None, a list or tuple of as many
    values, a tensor of the same shape and dtype, else the same type. Names the first key that
    differs, by its path."""
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return f"saved {path} is a {type(saved).__name__}, not a dict"
        unexpected = sorted(map(str, saved.keys() - live.keys()))
        missing = [] if missing_ok else sorted(map(str, live.keys() - saved.keys()))
        if unexpected or missing:
            keys, what = (unexpected, "has") if unexpected else (missing, "lacks")
            return (f"saved {path or 'state'} {what} {', '.join(k[:40] for k in keys[:5])}, "
                    f"which the registered object's {'does not' if unexpected else 'has'}")
        for key in live.keys() & saved.keys():
            problem = _value_mismatch(child_path(path, str(key)), live[key], saved[key], missing_ok)
            if problem:
                return problem
        return None
    if isinstance(live, (list, tuple)):
        if not (isinstance(saved, (list, tuple)) and len(saved) == len(live)):
            return f"saved {path} is not a list of {len(live)} values, as the registered object's is"
        for i, (a, b) in enumerate(zip(live, saved)):
            problem = _value_mismatch(f"{path}[{i}]", a, b, missing_ok)
            if problem:
                return problem
        return None
    if _is_number(live):
        ok = _is_number(saved)
    elif isinstance(live, torch.Tensor):
        ok = (isinstance(saved, torch.Tensor) and saved.shape == live.shape
              and saved.dtype == live.dtype)
    elif live is None:
        ok = saved is None
    else:
        ok = type(saved) is type(live)
    return None if ok else (f"saved {path} is {_shown(saved)}, the registered object's "
                            f"{_shown(live)}")


def _scheduler_mismatch(scheduler: Any, saved: Any) -> Optional[str]:
    """Why ``saved`` is not a state of ``scheduler``'s class, or None. torch's schedulers load a
    state by updating their attributes with it, whatever it holds: a key its own state does not
    have would give it an attribute it never had, or replace one it needs (its ``optimizer``), and
    a value of another type fails at the next ``step()``. Keys it has that the saved state lacks
    (saved by an older torch) keep their values."""
    if not isinstance(saved, dict):
        return "the saved state is not a scheduler state dict"
    return _value_mismatch("", scheduler.state_dict(), saved, missing_ok=True)


def _load(current: Any, saved: Entry, strict: bool, skip_ids: set[int], borrowed: frozenset,
          kept_by_state: tuple[type, ...]) -> None:
    """Load into the registered objects, once every check passed.

    Objects whose own ``load_state_dict`` may still refuse a value no check foresees (optimizers,
    schedulers, your classes; torch's optimizers half-apply a state they then refuse) go first,
    each one's attributes kept, so that a refusal puts every one of them back. Then modules and
    tensors, whose shapes and dtypes were checked, are copied in place; plain values last. Last,
    optimizers move their loaded state into the tensors they held before (``_rehome``).

    Tensors in ``borrowed`` storages (``Entry.borrowed``) are only ever copied from: what an
    object or a plain value would keep is first copied into memory of its own."""
    objects, in_place, values = [], [], []
    _collect(current, saved, strict, skip_ids, borrowed, objects, in_place, values)
    kept, optimizers = [], []
    try:
        for obj, state in objects:
            target = as_stateful(obj)
            kept.append((target, _keep(target, kept_by_state)))
            if isinstance(target, torch.optim.Optimizer):
                optimizers.append((target, {p: dict(s) for p, s in target.state.items()}))
                target.load_state_dict(state)
            else:
                target.load_state_dict(_own_memory(state, borrowed))
    except Exception as e:  # an object's load_state_dict refused a value no check could foresee
        for target, attributes in reversed(kept):
            _put_back(target, attributes)
        if isinstance(e, CheckpointError):
            raise
        raise StateMismatchError(
            f"a registered {type(obj).__name__} refused the snapshot's state ({type(e).__name__}: "
            f"{str(e)[:200]}); nothing was loaded") from e
    try:
        for load in in_place:
            load()
    except Exception as e:
        for target, attributes in reversed(kept):
            _put_back(target, attributes)
        raise StateMismatchError(
            f"loading the snapshot into a module or tensor failed ({type(e).__name__}: "
            f"{str(e)[:200]}); the objects were put back, but modules and tensors loaded before "
            "it keep the snapshot's values: restore again before training") from e
    for parent, key, value in values:
        parent[key] = _own_memory(value, borrowed)
    for optimizer, before in optimizers:
        _rehome(optimizer, before, borrowed)


def _rehome(optimizer: torch.optim.Optimizer, before: dict, borrowed: frozenset) -> None:
    """Put ``optimizer``'s loaded state into the tensors it held ``before`` loading, where they
    have the same layout: torch's ``load_state_dict`` adopts the tensors it is given, so without
    this every restore would replace two thirds of a model's training state with new memory.
    State without such a tensor (a fresh optimizer), and tensors inside other values (LBFGS's
    history lists), get memory of their own if it is borrowed."""
    for param, entries in optimizer.state.items():
        held = before.get(param, {})
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                entries[key] = _own_memory(value, borrowed)
                continue
            home = held.get(key)
            if (isinstance(home, torch.Tensor) and home is not value and _same_layout(home, value)
                    and _storage_address(home) not in borrowed):
                with torch.no_grad():
                    home.copy_(value)
                entries[key] = home
            else:
                entries[key] = _own_memory(value, borrowed)


def _storage_address(t: torch.Tensor) -> int:
    """Where the memory of ``t`` (of its local shard, for a DTensor) starts."""
    return (t.to_local() if is_dtensor(t) else t).untyped_storage().data_ptr()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device and a.requires_grad == b.requires_grad)


def _own_memory(value: Any, borrowed: frozenset, copies: Optional[dict] = None) -> Any:
    """``value`` with every tensor of a ``borrowed`` storage replaced by one over a copy of that
    storage (one copy per storage, so tensors that shared memory still share it)."""
    if not borrowed:
        return value
    copies = {} if copies is None else copies
    if is_dtensor(value):  # read from pieces into memory of its own (reshard.py)
        return value
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() not in borrowed:
            return value
        if storage.data_ptr() not in copies:
            copies[storage.data_ptr()] = storage.clone()
        return torch.empty(0, dtype=value.dtype).set_(
            copies[storage.data_ptr()], value.storage_offset(), value.shape, value.stride())
    if isinstance(value, dict):
        rebuilt = copy.copy(value)  # the same class and attributes (a state dict's _metadata)
        for key, item in value.items():
            rebuilt[key] = _own_memory(item, borrowed, copies)
        return rebuilt
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_own_memory(v, borrowed, copies) for v in value)
    return value


def _collect(current: Any, saved: Entry, strict: bool, skip_ids: set[int], borrowed: frozenset,
             objects: list, in_place: list, values: list) -> None:
    """Sort the loads ``_load`` will do into objects, in-place copies and plain assignments."""
    if saved.kind == NodeKind.DICT:
        for key, entry in saved.value.items():
            if entry.kind == NodeKind.VALUE:
                values.append((current, key, entry.value))
            elif key in current:
                _collect(current[key], entry, strict, skip_ids, borrowed, objects, in_place,
                         values)
    elif id(current) in skip_ids:
        return
    elif saved.kind == NodeKind.OBJECT and isinstance(current, torch.nn.Module):
        state = _own_extra_states(_matching(current, saved.value) if not strict else saved.value,
                                  borrowed)
        in_place.append(lambda: current.load_state_dict(state, strict=strict))
    elif saved.kind == NodeKind.OBJECT:
        objects.append((current, saved.value))
    elif saved.kind == NodeKind.TENSOR:
        in_place.append(lambda: _copy_into(current, saved.value))


def _own_extra_states(state: Mapping, borrowed: frozenset) -> Mapping:
    """A module's state dict whose extra states (what ``set_extra_state`` is given and keeps, not
    copied as parameters are) have memory of their own where it is borrowed."""
    extra = [k for k in state if k.endswith("_extra_state")]  # torch's suffix for them
    if not (extra and borrowed):
        return state
    owned = copy.copy(state)  # the same class and attributes (a state dict's _metadata)
    for key in extra:
        owned[key] = _own_memory(state[key], borrowed)
    return owned


def _copy_into(tensor: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.copy_(value)


def _keep(target: Any, kept_by_state: tuple[type, ...]) -> tuple[str, Any]:
    """What puts ``target`` back as it is now: the state of a generator or of an object of
    ``kept_by_state`` (whose state lives in other objects), else its attributes."""
    if isinstance(target, (TorchGenerator, NumpyGenerator, *kept_by_state)):
        return "state", target.state_dict()
    try:
        return "attributes", dict(vars(target))
    except TypeError:  # no __dict__ (slots): it cannot be put back
        return "nothing", None


def _put_back(target: Any, kept: tuple[str, Any]) -> None:
    how, value = kept
    if how == "state":
        target.load_state_dict(value)
    elif how == "attributes":
        vars(target).clear()
        vars(target).update(value)


def _matching(module: torch.nn.Module, saved: Mapping) -> dict:
    """The part of ``saved`` that fits ``module`` (for strict=False)."""
    current = module.state_dict()
    return {k: v for k, v in saved.items()
            if k not in current or not isinstance(current[k], torch.Tensor)
            or _tensor_mismatch(current[k], v) is None}
