"""torchtitan's checkpointing through async_ckpt: :class:`AsyncCkptCheckpointManager`.

torchtitan (0.3) builds its checkpointer from the job config, ``Trainer.Config.checkpoint``, a
``BaseCheckpointManager.Config``: the trainer calls ``config.checkpoint.build(dataloader=...,
model_parts=..., optimizers=..., lr_schedulers=..., states={"train_state": trainer},
sd_adapter=..., base_folder=dump_folder)``, then ``load(step)`` once, ``save(step, last_step)``
after every step and ``maybe_wait_for_staging()`` before every optimizer step. Configure this
manager there as torchtitan's own::

    checkpoint=AsyncCkptCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

It keeps the policy of torchtitan's ``CheckpointManager`` (save at ``interval``, at the first
step with ``enable_first_step_checkpoint``, at the last step, model only there in
``export_dtype`` unless ``last_save_model_only=False``; ``keep_latest_k``; ``load_step``;
``exclude_from_loading``; ``initial_load_path`` when the folder holds nothing; step 0 loads the
model only; ``load_only``), implemented on its ``BaseCheckpointManager`` hooks, not on
``CheckpointManager``'s ``dcp_save``/``dcp_load``: those write one DCP directory per step, which
its own purge and load then list and delete by name, where the engine keeps one directory of
committed snapshots with retention of its own.

A save is a snapshot of the engine: every rank copies its own pieces of the FSDP2/TP state
(``DTensor``s), the optimizers' and schedulers' state, its data loader's position and the train
state into reused staging memory and returns; a writer process per rank makes them durable and
rank 0 commits the step once every rank's part is. ``async_mode`` picks when a save returns:
``"disabled"`` once committed (DCP's blocking save), ``"async"`` once staged, and
``"async_with_pinned_mem"`` at once, the copy (into pinned memory from a GPU, by a thread on a
CPU) finishing by ``maybe_wait_for_staging()``, which the trainer calls before the optimizer
step, or the first optimizer step, which the engine fences.

torchtitan's own DCP checkpoints load through it (a ``step-N`` DCP directory in the folder, or
``initial_load_path``), read without running code from them; :func:`export_dcp` writes a
snapshot as the DCP checkpoint torchtitan's ``CheckpointManager`` reads. Both go through the
library's DCP interop (``async_ckpt.tools.dcp``).

This module is the only one that imports torchtitan; importing it checks the version and the
hooks it implements (``IntegrationError``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Collection, Literal, Optional

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import (DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER,
                                                BaseCheckpointManager)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from .. import MAX_STEP
from ..engine import CheckpointEngine
from ..errors import (CheckpointDirError, CheckpointError, IntegrationError, InternalError,
                      InvalidArgumentError, NoSnapshotError, StateMismatchError,
                      UnsupportedOptionError, WorldSizeMismatchError)
from ..options import EngineOptions
from ..tools.dcp import (METADATA_NAME, ObjectState, read_all_ranks, read_dcp, write_dcp,
                         write_snapshot)

__all__ = ["AsyncCkptCheckpointManager", "SUPPORTED", "export_dcp"]

log = logging.getLogger(__name__)

SUPPORTED = ((0, 3), (0, 4))  # torchtitan >= 0.3, < 0.4 (tested with 0.3.0)
_HOOKS = frozenset({"_save", "_load", "_wait_for_saving", "_maybe_wait_for_staging", "_close"})
_CONFIG_FIELDS = frozenset({
    "enable", "folder", "interval", "initial_load_path", "initial_load_model_only",
    "initial_load_in_hf", "initial_load_in_hf_quantized", "last_save_model_only",
    "last_save_in_hf", "export_dtype", "keep_latest_k", "load_step", "exclude_from_loading",
    "enable_first_step_checkpoint", "create_seed_checkpoint", "load_only"})
_OWNED_OPTIONS = frozenset({"mode", "staging", "every", "keep_last", "rank", "world_size"})
_MODES = {"disabled": ("sync", "eager"), "async": ("async", "eager"),
          "async_with_pinned_mem": ("async", "lazy")}
_DCP_STEP = re.compile(r"step-([0-9]{1,19})")  # a DCP checkpoint torchtitan's manager wrote
_MANIFEST = "manifest.json"  # what marks an async_ckpt directory (its commit record)


def _check_torchtitan() -> None:
    """Refuse a torchtitan this adapter was not tested with, or one whose manager contract
    changed (a new hook to implement, a config field gone)."""
    version = metadata.version("torchtitan")
    found = tuple(int(n) for n in re.findall(r"[0-9]+", version)[:2])
    first, before = SUPPORTED
    if not first <= found < before:
        raise IntegrationError(
            f"async_ckpt.integrations.torchtitan supports torchtitan>={first[0]}.{first[1]},"
            f"<{before[0]}.{before[1]}; {version} is installed (pip install "
            "'async_ckpt[torchtitan]')")
    hooks = BaseCheckpointManager.__abstractmethods__
    fields = {f for cls in BaseCheckpointManager.Config.__mro__
              for f in getattr(cls, "__dataclass_fields__", {})}
    if hooks != _HOOKS or not _CONFIG_FIELDS <= fields:
        raise IntegrationError(
            f"torchtitan {version}'s BaseCheckpointManager is not the one async_ckpt implements "
            f"(hooks {sorted(hooks)}, config fields missing: {sorted(_CONFIG_FIELDS - fields)}); "
            f"install torchtitan>={first[0]}.{first[1]},<{before[0]}.{before[1]}")


_check_torchtitan()


class AsyncCkptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager on a ``CheckpointEngine`` in ``base_folder/folder``.

    Saved per rank: the model parts' state dict (the flattened one of torchtitan's
    ``ModelWrapper``), the ``OptimizersContainer``'s (torchtitan's flat, FQN-keyed one), the
    ``LRSchedulersContainer``'s, the data loader's (this data-parallel rank's position), every
    entry of ``states`` (the trainer's ``train_state``) and the global RNG states. ``engine`` is
    the engine (for ``stats()``); ``save_future``, while a save is in flight, waits for its
    commit from the training thread.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """When a save returns: committed ("disabled"), staged ("async"), or at once, the copy
        finishing by ``maybe_wait_for_staging()`` ("async_with_pinned_mem": lazy staging)."""

        engine_options: dict[str, Any] = field(default_factory=dict)
        """Further ``CheckpointEngine`` options (``slots``, ``compression``, ``remote``,
        ``preemption``, ``rng``, ...); ``async_mode`` and ``keep_latest_k`` set the others."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in _MODES:
                raise InvalidArgumentError(f"checkpoint.async_mode must be one of "
                                           f"{', '.join(_MODES)}, not {self.async_mode!r}")
            hf = [name for name in ("initial_load_in_hf", "initial_load_in_hf_quantized",
                                    "last_save_in_hf") if getattr(self, name)]
            if hf:
                raise UnsupportedOptionError(
                    f"checkpoint.{hf[0]}: AsyncCkptCheckpointManager reads and writes no Hugging "
                    "Face safetensors; convert with torchtitan's CheckpointManager, or write a "
                    "snapshot's model with `async-ckpt export DIR --only model --to "
                    "model.safetensors`")
            if filesystem.is_remote(self.folder):
                raise UnsupportedOptionError(_REMOTE_FOLDER.format(self.folder))
            owned = sorted(_OWNED_OPTIONS & self.engine_options.keys())
            if owned:
                raise UnsupportedOptionError(
                    f"checkpoint.engine_options sets {', '.join(owned)}, which the manager sets "
                    "(async_mode, keep_latest_k, the interval and the ranks): leave them out")
            try:
                EngineOptions(**self.engine_options)  # each value checked now, not at the build
            except TypeError as e:
                raise InvalidArgumentError(f"checkpoint.engine_options: {e}") from None

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Optional[Future] = None
        self.folder = filesystem.join(base_folder, config.folder)
        if filesystem.is_remote(self.folder):
            raise UnsupportedOptionError(_REMOTE_FOLDER.format(self.folder))
        self.config = config
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.states = states  # the trainer's dict, completed as torchtitan's manager does
        states.update({MODEL: _ModelParts(model_parts), OPTIMIZER: _Container(optimizers),
                       DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        unknown = sorted(set(config.exclude_from_loading) - states.keys())
        if unknown:
            raise InvalidArgumentError(f"checkpoint.exclude_from_loading names {', '.join(unknown)}"
                                       f", which the checkpoint does not hold; its entries: "
                                       f"{', '.join(states)}")
        # objects whose load_state_dict can be undone (their attributes) load before the
        # optimizers, whose state lives in torch's optimizers; the model is copied in place last
        order = sorted(states, key=lambda name: (name == OPTIMIZER, name == MODEL))
        self.registered = {name: states[name] for name in order if states[name] is not None}
        mode, staging = _MODES[config.async_mode]
        self.engine = CheckpointEngine(
            self.folder, self.registered, mode=mode, staging=staging,
            keep_last=config.keep_latest_k or MAX_STEP, **config.engine_options)

    def __del__(self) -> None:
        self.close()

    # --- saving --------------------------------------------------------------------------------

    def _should_save(self, step: int, last_step: bool) -> bool:
        """torchtitan's rule: never with ``load_only``; at step 1 with
        ``enable_first_step_checkpoint``, at the last step, and every ``interval`` steps."""
        config = self.config
        return not config.load_only and (
            (step == 1 and config.enable_first_step_checkpoint) or last_step
            or step % config.interval == 0)

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if last_step:  # durable when it returns, as torchtitan's blocking last save
            state = None
            if self.config.last_save_model_only:
                state = {MODEL: ObjectState({
                    key: value.to(self.export_dtype) if isinstance(value, torch.Tensor)
                    and value.is_floating_point() else value
                    for key, value in self.registered[MODEL].state_dict().items()})}
            self.engine.snapshot(curr_step, force=True, state=state)
            self.engine.wait()
            self.save_future = None
            return True
        self.engine.snapshot(curr_step, force=True)
        if self.engine.options.mode == "async":
            self.save_future = _Commit(self.engine)
        return True

    def _maybe_wait_for_staging(self) -> None:
        self.engine.fence()

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        if hasattr(self, "engine"):  # (__del__ of a manager whose __init__ raised)
            self.engine.close()

    # --- loading -------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest) from the folder: a committed snapshot, or a DCP
        checkpoint torchtitan's manager wrote there (``step-N``), imported; with nothing there,
        ``initial_load_path`` (a DCP checkpoint or an async_ckpt directory). Step 0 and
        ``initial_load_model_only`` load the model only."""
        committed, dcp = set(self.engine.committed_steps()), _dcp_checkpoints(self.folder)
        newest = step == -1
        if newest:
            step = max(committed | dcp.keys(), default=-1)
        elif step not in committed and step not in dcp:
            raise NoSnapshotError(
                f"checkpoint.load_step={step}: {self.folder} holds no committed snapshot nor DCP "
                f"checkpoint of step {step}; it holds {sorted(committed | dcp.keys()) or 'none'}")
        if step == -1:
            path = self.config.initial_load_path
            if not path:
                log.info("no checkpoint in %s and no initial_load_path: a fresh start",
                         self.folder)
                return False
            self._load_initial(path, self.config.initial_load_model_only)
        elif step in committed:  # the newest: the newest that verifies, as restore() picks
            self._restore(self.engine, None if newest else step, model_only=step == 0)
        else:
            self._import(dcp[step], step, model_only=step == 0)
        return True

    def _skipped(self, model_only: bool) -> frozenset:
        return frozenset(self.config.exclude_from_loading) | (
            frozenset(self.registered) - {MODEL} if model_only else frozenset())

    def _restore(self, engine: CheckpointEngine, step: Optional[int], model_only: bool) -> int:
        try:
            restored = engine.restore(step, skip=self._skipped(model_only))
        except WorldSizeMismatchError as e:
            raise WorldSizeMismatchError(
                f"{engine.directory} was saved on another number of ranks, and entries that hold "
                "per-rank state cannot follow (a data loader's position is one): list them in "
                "checkpoint.exclude_from_loading (e.g. [\"dataloader\"]) to keep their current "
                f"state. The engine's refusal: {str(e)[:600]}") from e
        if restored is None:
            raise NoSnapshotError(f"{engine.directory} holds no committed snapshot to load")
        log.info("loaded step %d from %s%s", restored, engine.directory,
                 " (model only)" if model_only else "")
        return restored

    def _load_initial(self, path: str, model_only: bool) -> None:
        """``initial_load_path``: a DCP checkpoint (imported) or an async_ckpt directory (its
        newest committed snapshot)."""
        if os.path.isfile(os.path.join(path, METADATA_NAME)):
            self._import(path, 0, model_only)
        elif os.path.isfile(os.path.join(path, _MANIFEST)):
            with _reader(path, self.registered) as engine:
                self._restore(engine, None, model_only)
        else:
            raise CheckpointDirError(
                f"checkpoint.initial_load_path {path} is neither a DCP checkpoint (no "
                f"{METADATA_NAME}) nor an async_ckpt checkpoint directory (no {_MANIFEST})")

    def _import(self, source: str, step: int, model_only: bool) -> None:
        """Load the DCP checkpoint ``source`` on every rank: rank 0 reads it whole (running no
        code from it) and writes it as a one-rank snapshot beside the folder, from which every
        rank then takes its own part, on any world size; the snapshot is removed after."""
        scratch = os.path.join(os.path.dirname(os.path.abspath(self.folder)),
                               f".{os.path.basename(self.folder)}.import")
        skipped = self._skipped(model_only)

        def write() -> None:
            shutil.rmtree(scratch, ignore_errors=True)  # what a killed import left
            state = _from_dcp_layout(read_dcp(source), set(self.states) - {MODEL}, source)
            loader = self.registered.get(DATALOADER)
            saved = state.get(DATALOADER)
            saved_size = saved.state.get("world_size") if isinstance(saved, ObjectState) else None
            own_size = getattr(loader, "dp_world_size", None)
            if DATALOADER not in skipped and saved_size != own_size and own_size is not None:
                raise WorldSizeMismatchError(
                    f"{source} holds the data loader positions of {saved_size} data-parallel "
                    f"ranks, this job has {own_size}: list dataloader in "
                    "checkpoint.exclude_from_loading to start the loaders afresh")
            write_snapshot(state, scratch, step)

        _on_rank_0(write)
        try:
            with _reader(scratch, self.registered) as engine:
                self._restore(engine, None, model_only)
            log.info("imported the DCP checkpoint %s", source)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # every rank's reader has closed
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(scratch, ignore_errors=True)


_REMOTE_FOLDER = ("checkpoint.folder {} is remote: the engine writes a local (or shared) "
                  "directory; give a local folder and checkpoint.engine_options={{'remote': "
                  "'s3://bucket/prefix'}} to upload each committed snapshot")


class _ModelParts(torch.nn.Module):
    """The model parts (one, or a pipeline rank's several) as one module whose state dict is
    theirs merged, keyed by their own names (torchtitan's ``ModelWrapper``'s): the engine checks
    its keys and shapes as any module's at a restore, and finds the parts' buffers, which lazy
    staging copies before the save returns."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {key: value for part in self.parts for key, value in part.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        for part in self.parts:
            own = part.state_dict().keys()
            part.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict)


class _Container:
    """torchtitan's ``OptimizersContainer`` as a plain stateful object: it is a torch
    ``Optimizer`` whose state dict is torchtitan's flat, FQN-keyed one, which the engine's checks
    of a torch optimizer's state would refuse; its own ``load_state_dict`` checks it."""

    def __init__(self, container: Any) -> None:
        self.container = container

    def state_dict(self) -> dict[str, Any]:
        return self.container.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.container.load_state_dict(state_dict)


class _Commit(Future):
    """``save_future`` of an asynchronous save: ``result()`` waits, on the training thread (the
    engine is not thread-safe), until every snapshot taken is committed."""

    def __init__(self, engine: CheckpointEngine) -> None:
        super().__init__()
        self._engine = engine

    def result(self, timeout: Optional[float] = None) -> None:
        if not self.done():
            try:
                self._engine.wait()
            except BaseException as e:
                self.set_exception(e)
                raise
            self.set_result(None)
        return super().result(timeout)


def _reader(directory: str, registered: dict) -> CheckpointEngine:
    """An engine that only restores from ``directory`` (an import's, ``initial_load_path``):
    nothing of its own is saved, dropped or set (no RNG states: a DCP checkpoint has none, and an
    initial checkpoint starts another run)."""
    return CheckpointEngine(directory, registered, rng=False, mode="sync", keep_last=MAX_STEP,
                            heartbeat_interval=None)


def _on_rank_0(work: Callable[[], None]) -> None:
    """``work()`` on rank 0; its typed error raised on every rank (the others would otherwise
    wait for a scratch snapshot that never comes)."""
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    problem: Optional[CheckpointError] = None
    error: Optional[BaseException] = None
    if not several or dist.get_rank() == 0:
        try:
            work()
        except CheckpointError as e:
            problem = error = e
        except Exception as e:  # noqa: BLE001 - sent to the other ranks as what it is, raised here
            problem, error = InternalError(f"importing on rank 0 failed ({type(e).__name__}: "
                                           f"{str(e)[:200]})"), e
    if several:
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if error is not None:
        raise error
    if problem is not None:
        raise problem


def _dcp_checkpoints(folder: str) -> dict[int, str]:
    """step -> path of the DCP checkpoints torchtitan's manager wrote in ``folder``
    (``step-N`` directories holding a ``.metadata`` file; links are not followed)."""
    found = {}
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return found
    for entry in entries:
        match = _DCP_STEP.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            try:
                metadata_stat = os.lstat(os.path.join(entry.path, METADATA_NAME))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(metadata_stat.st_mode):
                found[int(match.group(1))] = entry.path
    return found


def _from_dcp_layout(state: dict, names: Collection[str], source: str) -> dict:
    """A torchtitan DCP checkpoint's state (the model's keys at the top level, beside
    ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``, ...) as the manager
    registers it: the model's keys under ``model``; each dict an object's state."""
    if MODEL in state:
        raise StateMismatchError(f"{source} has a top-level {MODEL!r} entry: not a checkpoint "
                                 "of torchtitan's CheckpointManager (it keeps the model's keys at "
                                 "the top level)")
    ours: dict[str, Any] = {MODEL: ObjectState({k: v for k, v in state.items()
                                                if k not in names})}
    for name in names & state.keys():
        value = state[name]
        ours[name] = ObjectState(value) if isinstance(value, dict) else value
    return ours


def export_dcp(directory: str | os.PathLike, target: str | os.PathLike,
               step: Optional[int] = None) -> int:
    """Write a committed snapshot of an ``AsyncCkptCheckpointManager``'s folder (``step``, or
    the newest) as the DCP checkpoint torchtitan's ``CheckpointManager`` reads, in the new
    directory ``target`` (e.g. ``.../checkpoint/step-N``, which it finds as step N): the model's
    keys at the top level, every saved rank's data loader position merged as DCP merges them.
    Returns the step. Sharded tensors are written whole, which DCP loads on any world size; the
    process holds one rank's full view at a time."""
    step, state = read_all_ranks(directory, step)
    model = state.pop(MODEL, None)
    if not isinstance(model, dict):
        raise StateMismatchError(f"step {step} of {os.fspath(directory)} has no {MODEL!r} entry: "
                                 "not a snapshot of AsyncCkptCheckpointManager")
    clash = sorted(model.keys() & state.keys())
    if clash:
        raise StateMismatchError(f"step {step}: the model's keys {', '.join(clash[:5])} are also "
                                 "names of other entries; DCP keeps one value per key")
    write_dcp({**state, **model}, os.fspath(target))
    return step
