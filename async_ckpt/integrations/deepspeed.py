"""Asynchronous checkpoints for DeepSpeed (ZeRO stages 1 to 3), through its own extension point.

``engine.save_checkpoint(save_dir)`` writes every rank's files (the model states, each rank's
ZeRO optimizer partition, the client state inside the model states) with ``torch.save`` before it
returns, then the ``latest`` file that names the tag. Every file goes through the DeepSpeed
engine's ``checkpoint_engine`` (``create``, ``save`` per file, ``commit``). ``install(engine,
directory)`` puts an :class:`AsyncCheckpointEngine` there: the files of one ``save_checkpoint``
become one snapshot per rank, staged when DeepSpeed commits and written by the rank's writer
process while training goes on. Once every rank's part is durable and committed, each rank's
writer links its files into the tag directory (each is the rank's data file of the snapshot, in
torch's format: ``torch.load``, ``zero_to_fp32.py`` and ``ds_to_universal.py`` read it as they read
DeepSpeed's own), and rank 0's writes ``latest`` last, once every rank's files are in place: a
killed job never leaves a ``latest`` that names a partial checkpoint, nor a file of a save that was
not committed.

``load_checkpoint`` reads through the same engine: a file it wrote is read from its snapshot,
verified against its checksums, DeepSpeed's own objects (its loss scaler, the ZeRO stage) unpickled
by name from a short list and nothing else; loading a rank's own file also sets the global RNG
states saved with it, so a resumed run draws the same random numbers (DeepSpeed saves none).

This module is the only one that imports DeepSpeed; importing it checks the installed version
(``SUPPORTED``) and that the pieces of DeepSpeed it relies on are there.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import stat
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Optional, Union

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (CheckpointCommitInfo,
                                                                   CheckpointEngine as _DSEngine)
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from packaging.version import Version

from .. import MAX_STEP, Derived, Marker, load as read_snapshot
from ..engine import CheckpointEngine
from ..errors import (CorruptSnapshotError, EncodingError, IntegrationError, InvalidArgumentError,
                      PointerFileError)
from ..rng import GlobalRNG
from .pointer import checked_fields

__all__ = ["AsyncCheckpointEngine", "DEEPSPEED_PICKLED", "Record", "SUPPORTED", "install",
           "read_record"]

log = logging.getLogger(__name__)

SUPPORTED = ("0.19", "0.20")  # tested with 0.19.8; [first, before)

DEEPSPEED_PICKLED = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address,
                     torch.float16, torch.bfloat16, torch.float32)
"""What DeepSpeed's checkpoints hold pickled (its ZeRO optimizers' state): the only objects a
snapshot of this adapter is allowed to pickle, and that loading unpickles, by name."""

RECORD_FORMAT = "async_ckpt.deepspeed"
RECORD_VERSION = 1
_MAX_ENTRY_CHARS = 1024
_RNG_ENTRY = "async_ckpt.rng"  # beside the files' entries (names of files, relative paths)
_LATEST = "latest"  # DeepSpeed's name for the file that names the newest tag
_FIXED_OPTIONS = {"every", "rng", "allow_pickle"}  # the adapter's to set


def _check_deepspeed() -> None:
    """Refuse a DeepSpeed this adapter was not tested with, or one without what it relies on."""
    version, (first, before) = Version(deepspeed.__version__), map(Version, SUPPORTED)
    if version < first:
        raise IntegrationError(
            f"async_ckpt.integrations.deepspeed supports deepspeed>={first},<{before}; {version} "
            "is installed: upgrade it (pip install 'async_ckpt[deepspeed]')")
    if version >= before:
        warnings.warn(f"async_ckpt.integrations.deepspeed was tested with deepspeed>={first},"
                      f"<{before}; {version} is installed: check that resumes stay exact",
                      RuntimeWarning, stacklevel=3)
    missing = [f"DeepSpeedEngine.{name}({', '.join(params)}, ...)"
               for name, params in (("save_checkpoint", ("save_dir", "tag", "client_state",
                                                         "save_latest")),
                                    ("load_checkpoint", ("load_dir", "tag")))
               if tuple(inspect.signature(getattr(DeepSpeedEngine, name, lambda: None))
                        .parameters)[1:1 + len(params)] != params]
    missing += [f"CheckpointEngine.{name}" for name in ("create", "save", "load", "commit",
                                                        "makedirs", "preserves_storage_sharing")
                if not callable(getattr(_DSEngine, name, None))]
    if {"tag", "save_dir", "save_latest"} - set(getattr(CheckpointCommitInfo,
                                                         "__dataclass_fields__", ())):
        missing.append("CheckpointCommitInfo(tag, save_dir, save_latest)")
    if missing:
        raise IntegrationError(f"deepspeed {version} lacks what async_ckpt.integrations.deepspeed "
                               f"relies on: {'; '.join(missing)}. Install "
                               f"deepspeed>={first},<{before}")


_check_deepspeed()


def install(engine: DeepSpeedEngine, directory: Union[str, os.PathLike], *,
            allow_pickle: Union[bool, Collection[Any]] = (), rng: bool = True,
            **options: Any) -> "AsyncCheckpointEngine":
    """Make ``engine`` (what ``deepspeed.initialize`` returned) save through async_ckpt, with its
    snapshots in ``directory`` (best on the file system of the checkpoints' ``save_dir``, e.g.
    ``save_dir/async_ckpt``: a file is then a link to its snapshot's bytes, not a second copy).
    Call it on every rank, after ``deepspeed.initialize`` and before the first save or load.

    ``engine.save_checkpoint`` and ``load_checkpoint`` keep their signatures; a save returns
    once the state is staged. ``rng``: save every rank's global RNG states with its files and
    set them when ``load_checkpoint`` loads that rank's own file. ``allow_pickle``: more classes
    (or True: anything) to pickle in saved values beyond ``DEEPSPEED_PICKLED``, as the engine's
    option (a client state holding another object is refused at the save without it).
    ``**options`` are ``CheckpointEngine``'s (``keep_last``: how many snapshots stay verifiable,
    ``compression``, ``staging``, ...; ``every`` is the adapter's: every save is taken).

    Refused (``IntegrationError``): node-local checkpoint storage and NVMe optimizer offload
    (DeepSpeed writes files of its own into the checkpoint then), and a config that selects
    another of DeepSpeed's checkpoint writers.
    """
    refused = _why_refused(engine)
    if refused:
        raise IntegrationError(f"async_ckpt.integrations.deepspeed cannot save this engine: "
                               f"{refused}")
    fixed = _FIXED_OPTIONS & options.keys()
    if fixed:
        raise InvalidArgumentError(f"{sorted(fixed)} are set by async_ckpt.integrations.deepspeed "
                                   "(every save is a snapshot)")
    if allow_pickle is False:
        raise InvalidArgumentError("DeepSpeed's checkpoints hold pickled objects (its loss scaler, "
                                   "the ZeRO stage): allow_pickle is more classes, or True")
    pickled = True if allow_pickle is True else (*DEEPSPEED_PICKLED, *allow_pickle)
    ours = AsyncCheckpointEngine(
        CheckpointEngine(directory, {}, every=1, rng=False, allow_pickle=pickled, **options),
        engine, rng)
    ours.attach()
    return ours


def _why_refused(engine: DeepSpeedEngine) -> Optional[str]:
    if not isinstance(engine, DeepSpeedEngine):
        return f"{type(engine).__name__} is not a DeepSpeedEngine (what deepspeed.initialize returns)"
    if isinstance(engine.checkpoint_engine, AsyncCheckpointEngine):
        return "async_ckpt is installed on it already: close() that one first"
    if engine.use_node_local_storage():
        return ("checkpoint.use_node_local_storage writes each node's files into a directory of "
                "its own, and a snapshot commits in one directory shared by every rank")
    if engine.zero_nvme_offload_optimizer():
        return ("NVMe optimizer offload copies its swap files into the checkpoint itself, outside "
                "the snapshot")
    config = engine._config
    if config.checkpoint_config.get("writer") is not None or config.datastates_config.enabled:
        return ("the config selects another of DeepSpeed's checkpoint writers (checkpoint.writer "
                "or datastates): remove it")
    return None


@dataclass(frozen=True)
class Record:
    """What a file this adapter wrote keeps (its ``.data/async_ckpt`` entry): the snapshot
    (``step`` in the engine ``directory``, relative to the file's own directory) and the rank
    whose shard holds it as ``entry``."""

    step: int
    rank: int
    entry: str
    directory: str

    def to_bytes(self) -> bytes:
        return json.dumps({"format": RECORD_FORMAT, "version": RECORD_VERSION, "step": self.step,
                           "rank": self.rank, "entry": self.entry,
                           "directory": self.directory}).encode()


_RECORD_FIELDS = {  # each field of a record, and what it may hold
    "format": lambda v: v == RECORD_FORMAT, "version": lambda v: v == RECORD_VERSION,
    "step": lambda v: type(v) is int and 0 <= v < MAX_STEP,
    "rank": lambda v: type(v) is int and v >= 0,
    "entry": lambda v: type(v) is str and 0 < len(v) <= _MAX_ENTRY_CHARS,
    "directory": lambda v: type(v) is str and v != ""}


def read_record(path: str) -> Optional[Record]:
    """The record of the file at ``path``; None for a file without one (``torch.save`` wrote
    it: DeepSpeed's own engine). The file is untrusted: only a regular file is opened, only its
    zip directory and record are read (boundedly), every field is checked (PointerFileError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise PointerFileError(f"{path} cannot be opened ({e.strerror})") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PointerFileError(f"{path} is not a regular file")
        data = Marker.record_in(f)
    if data is None or not data.startswith(b'{"format": "' + RECORD_FORMAT.encode()):
        return None
    fields = checked_fields(data, _RECORD_FIELDS, path)
    return Record(fields["step"], fields["rank"], fields["entry"], fields["directory"])


class AsyncCheckpointEngine(_DSEngine):
    """DeepSpeed's ``CheckpointEngine`` over an async_ckpt ``CheckpointEngine``: made and put on
    a DeepSpeed engine by :func:`install`. ``wait()`` returns once every save taken is committed
    and its files (and ``latest``) are written; ``close()`` waits, stops the writer and gives the
    DeepSpeed engine back its own checkpoint engine."""

    def __init__(self, engine: CheckpointEngine, deepspeed_engine: DeepSpeedEngine,
                 rng: bool) -> None:
        super().__init__()
        self.name = "async_ckpt"
        self.engine = engine
        self.directory = engine.directory
        self._deepspeed = deepspeed_engine
        self._rng = rng
        self._replaced: Optional[_DSEngine] = None  # DeepSpeed's own, given back by close()
        self._next_step = max(engine.committed_steps(), default=-1) + 1
        self._save_latest: Optional[bool] = None  # what save_checkpoint's caller asked
        self._saving: Optional[CheckpointCommitInfo] = None
        self._latest = False
        self._files: dict[str, Any] = {}  # absolute path -> state dict, of the save in progress
        self._read: Optional[tuple[tuple[int, int], dict]] = None  # (step, rank) -> its state
        # while load_checkpoint runs: tag directory -> the snapshot its first file loaded named
        self._loading: Optional[dict[str, Optional[int]]] = None

    # --- on the DeepSpeed engine -------------------------------------------------------------

    def attach(self) -> None:
        """Become the DeepSpeed engine's checkpoint engine; its ``save_checkpoint`` and
        ``load_checkpoint`` (instance attributes, removed by ``close``) are the methods of its
        class, but for ``latest``, which only the writer writes, once the save is committed."""
        ds = self._deepspeed
        self._replaced, ds.checkpoint_engine = ds.checkpoint_engine, self
        ds.save_checkpoint, ds.load_checkpoint = self._save_checkpoint, self._load_checkpoint

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        """``DeepSpeedEngine.save_checkpoint``, with DeepSpeed's own write of ``latest`` (before
        the files are durable, not atomic) left to the writer."""
        method = type(self._deepspeed).save_checkpoint
        call = inspect.signature(method).bind(self._deepspeed, *args, **kwargs)
        call.apply_defaults()
        self._save_latest, call.arguments["save_latest"] = bool(call.arguments["save_latest"]), False
        try:
            return method(*call.args, **call.kwargs)
        finally:
            self._save_latest = None

    def _load_checkpoint(self, *args: Any, **kwargs: Any):
        """``DeepSpeedEngine.load_checkpoint`` once the saves in flight are committed (it reads
        ``latest`` first), refusing a tag whose files come from different saves; the shard it
        mapped is let go once it returns (not at the next save, which would pay for it)."""
        self.wait()
        self._loading = {}
        try:
            return type(self._deepspeed).load_checkpoint(self._deepspeed, *args, **kwargs)
        finally:
            self._loading = self._read = None

    # --- DeepSpeed's CheckpointEngine ----------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        if info.save_latest:
            raise IntegrationError(
                "a save asked DeepSpeed to write 'latest' itself, which it does before the files "
                "are durable: save through the engine async_ckpt's install() was given "
                "(engine.save_checkpoint), which leaves 'latest' to the writer")
        self._saving, self._files, self._read = info, {}, None
        self._latest = bool(self._save_latest)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """The tag directory appears when the save is committed (the writer makes it);
        directories outside it now."""
        if self._saving is None or not _within(path, self._tag_directory()):
            os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Taken when DeepSpeed commits the save: the files of one save are one snapshot."""
        if self._saving is None:
            raise IntegrationError(f"DeepSpeed saved {path} outside a save_checkpoint (no create() "
                                   "before it); async_ckpt cannot commit it")
        path = os.path.abspath(path)
        if not _within(path, os.path.abspath(self._saving.save_dir)) or path in self._files:
            raise IntegrationError(f"DeepSpeed saved {path}, outside {self._saving.save_dir} or "
                                   "twice in one save; async_ckpt cannot commit it")
        self._files[path] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Stage this rank's files as a snapshot and return; the writer links them into place
        once every rank's are durable (and, on rank 0, writes ``latest`` after them all). Every
        rank calls it, at the end of the same save."""
        if info != self._saving:
            raise IntegrationError(f"DeepSpeed committed {info}, not the save in progress "
                                   f"({self._saving})")
        files, latest = self._files, self._latest
        self._saving, self._files = None, {}
        step, self._next_step = self._next_step, self._next_step + 1
        save_dir = os.path.abspath(info.save_dir)
        records = {path: Record(step, self.engine.rank, os.path.relpath(path, save_dir),
                                os.path.relpath(self.directory, os.path.dirname(path))).to_bytes()
                   for path in files}
        markers = [Marker(path, Derived("torch", os.path.relpath(path, save_dir), record))
                   for path, record in records.items()]
        everyone = _gather(list(records.items()), self.engine.world_size)
        if latest and self.engine.rank == 0:
            markers.append(Marker(os.path.join(save_dir, _LATEST), str(info.tag).encode(),
                                  after=tuple((path, record) for rank_files in everyone
                                              for path, record in rank_files)))
        state: dict[str, Any] = {os.path.relpath(path, save_dir): sd for path, sd in files.items()}
        if self._rng:
            state[_RNG_ENTRY] = GlobalRNG()
        self.engine.snapshot(step, state=state, markers=markers, force=True)
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state DeepSpeed saved as ``path``: from its snapshot, verified, when this adapter
        wrote it; else (DeepSpeed's own engine wrote it) by ``torch.load``, unpickling only
        ``DEEPSPEED_PICKLED``. CPU tensors, whatever ``map_location`` (DeepSpeed asks for CPU)."""
        _check_cpu(map_location)
        self.wait()
        path = os.path.abspath(path)
        record = read_record(path)
        self._check_one_save(path, record)
        if record is None:
            return self._load_unverified(path, "it is DeepSpeed's own")
        directory = os.path.normpath(os.path.join(os.path.dirname(path), record.directory))
        if os.path.realpath(directory) != os.path.realpath(self.directory):
            raise PointerFileError(f"{path} was saved by async_ckpt into {directory}, not into "
                                   f"{self.directory}: install() with that directory to load it")
        if record.step not in self.engine.committed_steps():
            return self._load_unverified(path, f"its snapshot {record.step} is no longer in "
                                               f"{self.directory} (keep_last)")
        state = self._snapshot_state(record)
        if record.entry not in state or record.entry == _RNG_ENTRY:
            raise CorruptSnapshotError(f"{path} names entry {record.entry!r} of snapshot "
                                       f"{record.step}, which rank {record.rank}'s shard lacks")
        if record.rank == self.engine.rank and self._rng and _RNG_ENTRY in state:
            GlobalRNG().load_state_dict(state[_RNG_ENTRY])
        return state[record.entry]

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed then hands over its tensors as they are, without cloning them (the
        engine stages each storage once, and the file holds it as ``torch.save`` would)."""
        return False

    # --- the rest --------------------------------------------------------------------------

    def wait(self) -> None:
        self.engine.wait()

    def close(self) -> None:
        """Wait for the saves in flight, stop the writer, give the DeepSpeed engine back its
        own checkpoint engine and methods."""
        try:
            self.engine.close()
        finally:
            ds = self._deepspeed
            if ds.checkpoint_engine is self:
                ds.checkpoint_engine = self._replaced
            for name in ("save_checkpoint", "load_checkpoint"):
                vars(ds).pop(name, None)
            self._read = None

    def _check_one_save(self, path: str, record: Optional[Record]) -> None:
        """CorruptSnapshotError when a file of the tag being loaded comes from another save than
        the tag's first file: a save into a tag that ``latest`` already named was killed while
        its files were being replaced (a new tag per save never mixes)."""
        if self._loading is None:
            return
        step = None if record is None else record.step
        first = self._loading.setdefault(os.path.dirname(path), step)
        if first != step:
            raise CorruptSnapshotError(
                f"{os.path.dirname(path)} holds files of different saves ({_save_name(first)} and "
                f"{_save_name(step)}): a save into this tag was stopped while it replaced them. "
                "Load another tag, and give every save a tag of its own")

    def _tag_directory(self) -> str:
        return os.path.abspath(os.path.join(self._saving.save_dir, str(self._saving.tag)))

    def _snapshot_state(self, record: Record) -> dict:
        """Rank ``record.rank``'s shard of snapshot ``record.step``, mapped and verified: the one
        read last is kept, since DeepSpeed loads a rank's files one after the other."""
        key = (record.step, record.rank)
        if self._read is None or self._read[0] != key:
            self._read = None
            _, state = read_snapshot(self.directory, record.step, rank=record.rank,
                                     allow_pickle=self.engine.options.allow_pickle, mmap=True,
                                     verify=True)
            self._read = (key, state)
        return self._read[1]

    def _load_unverified(self, path: str, why: str) -> Any:
        """``torch.load`` of a file that no snapshot verifies, unpickling what the engine may
        (with ``allow_pickle=True``, anything)."""
        log.info("loading %s with torch.load (%s): no checksum to verify it against", path, why)
        allowed = self.engine.options.allow_pickle
        if allowed is True:
            return torch.load(path, map_location="cpu", weights_only=False)
        try:
            with torch.serialization.safe_globals([c for c in allowed if isinstance(c, type)]):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # a global torch was not given
            raise EncodingError(f"{path} cannot be loaded without unpickling what "
                                f"allow_pickle does not allow ({why}): {str(e)[:300]}. Install "
                                "with allow_pickle=True only if you trust where it came from") from e


def _save_name(step: Optional[int]) -> str:
    return "DeepSpeed's own save" if step is None else f"snapshot {step}"


def _within(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _gather(value: Any, world_size: int) -> list:
    """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
    if world_size == 1:
        return [value]
    out = [None] * world_size
    torch.distributed.all_gather_object(out, value)
    return out


def _check_cpu(map_location: Any) -> None:
    if map_location is None or callable(map_location):
        return  # DeepSpeed's own: lambda storage, loc: storage
    if torch.device(map_location).type != "cpu":
        raise InvalidArgumentError(f"async_ckpt.integrations.deepspeed loads to the CPU, not "
                                   f"{map_location!r} (DeepSpeed moves what it loads itself)")
