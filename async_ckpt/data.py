"""Data position for exact resume: samplers (and a loader) whose position is saved with the
checkpoint.

A ``DataLoader`` draws indices ahead of the training loop, so its sampler cannot tell what
training consumed; here the training loop advances the position (``advance()``, once per batch it
consumed) and the sampler reads it only when an epoch's iteration starts. The order of an epoch is
a pure function of ``(seed, epoch)``; per-sample randomness comes from ``sample_generator``.
How to use them, and why each rule is there: docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import random
import sys
import warnings
from collections.abc import Mapping, Sized
from typing import Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .errors import StateMismatchError, UnsupportedFormatError
from .tensors import registered_objects

__all__ = ["ResumableLoader", "ResumableSampler", "DistributedResumableSampler", "EpochIndex",
           "sample_seed", "sample_generator"]

STATE_VERSION = 1
_CHUNK = 1 << 16  # indices converted to Python ints at a time while iterating


# --- seeds ---------------------------------------------------------------------------------------

def _int_bytes(value: int, what: str) -> bytes:
    value = operator.index(value)
    try:
        return int(value).to_bytes(16, "little", signed=True)
    except OverflowError:
        raise ValueError(f"{what} must fit in 128 signed bits, got {value}") from None


def _digest(person: bytes, size: int, **values: int) -> bytes:
    data = b"".join(_int_bytes(v, k) for k, v in values.items())
    return hashlib.blake2b(data, digest_size=size, person=person).digest()


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed in ``[0, 2**63)`` that depends only on ``(seed, epoch, index)``.

    BLAKE2b of the three integers (16-byte signed little-endian each, personalised
    ``b"async_ckpt.smpl"``), first 8 bytes little-endian, shifted right by one. Stable across
    processes, Python/NumPy/torch versions and platforms; unrelated for nearby inputs.
    """
    return int.from_bytes(_digest(b"async_ckpt.smpl", 8, seed=seed, epoch=epoch, index=index),
                          "little") >> 1


def sample_generator(seed: int, epoch: int, index: int,
                     device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` seeded with :func:`sample_seed` ``(seed, epoch, index)``.

    Use it for a sample's random augmentation inside ``Dataset.__getitem__``: the draws are then
    the same with any ``num_workers`` and after a resume (docs/data.md, "Per-sample randomness").
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(seed, epoch, index))
    return generator


def _epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of one epoch over ``range(length)``: a pure function of its arguments."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    key = np.frombuffer(_digest(b"async_ckpt.perm", 16, seed=seed, epoch=epoch), dtype="<u4")
    return np.random.RandomState(key.astype(np.uint32)).permutation(length).astype(np.int64)


class EpochIndex(int):
    """A dataset index (an ``int``) that also carries the ``epoch`` it was drawn for.

    Yielded by the samplers built with ``with_epoch=True``, so ``Dataset.__getitem__`` can seed
    per-sample randomness with :func:`sample_generator` ``(seed, index.epoch, index)``. It also
    unpacks as ``epoch, index = item``; everywhere else it is the plain index.
    """

    epoch: int

    def __new__(cls, index: int, epoch: int) -> "EpochIndex":
        self = super().__new__(cls, index)
        self.epoch = epoch
        return self

    def __reduce__(self):  # keeps the epoch on its way to a worker process
        return (EpochIndex, (int(self), self.epoch))

    def __iter__(self) -> Iterator[int]:
        """Unpacks as ``epoch, index = item`` for datasets written for ``(epoch, index)`` pairs."""
        return iter((self.epoch, int(self)))

    def __repr__(self) -> str:
        return f"EpochIndex({int(self)}, epoch={self.epoch})"


def _calling_loader_iterator():
    """The ``DataLoader`` iterator that is asking a sampler for its indices (a few frames up:
    ``_next_index``, through a ``BatchSampler``), or None when the sampler is iterated otherwise.
    What it reveals (workers, persistence, the dataset) decides what a sampler can make exact."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            return owner
        frame = frame.f_back
    return None


# --- samplers ------------------------------------------------------------------------------------

def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _length_of(dataset_len) -> int:
    if isinstance(dataset_len, Sized) and not isinstance(dataset_len, (int, np.integer)):
        return len(dataset_len)
    return _check_int(dataset_len, "dataset_len", 0)


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset, in an order fixed by ``(seed, epoch)``, from a saved position.

    Pass it to ``DataLoader(dataset, batch_size=batch_size, drop_last=drop_last, sampler=it)``
    with the same ``batch_size`` and ``drop_last``, register it with the ``CheckpointEngine`` like
    any stateful object, and call :meth:`advance` once per batch the training loop consumed.

    Call order: construct; ``load_state_dict`` (usually through ``engine.restore()``); then per
    epoch ``epochs()``/``set_epoch``, iterate the loader, ``advance()`` after each step, snapshot.

    Args:
        dataset_len: the dataset's length, or the dataset itself.
        shuffle: a new order every epoch (``True``) or ``0, 1, 2, ...`` (``False``).
        seed: the orders are a function of ``(seed, epoch)``; the same on every rank and restart.
        batch_size: the loader's batch size; positions are counted in batches of this size.
        drop_last: the loader's ``drop_last`` (whether an epoch's incomplete last batch is dropped).
        with_epoch: yield :class:`EpochIndex` (int with ``.epoch``) instead of plain ints.

    Attributes ``epoch`` and ``consumed`` give the position; ``batches_per_epoch`` its range.
    """

    _KIND = "ResumableSampler"

    def __init__(self, dataset_len: Union[int, Sized], *, shuffle: bool = True, seed: int = 0,
                 batch_size: int = 1, drop_last: bool = False, with_epoch: bool = False):
        self._setup(_length_of(dataset_len), shuffle, seed, batch_size, drop_last, with_epoch)
        self.drop_last = bool(drop_last)

    def _setup(self, dataset_len: int, shuffle: bool, seed: int, batch_size: int,
               drop_last_batch: bool, with_epoch: bool) -> None:
        self.dataset_len = dataset_len
        self.shuffle = bool(shuffle)
        self.seed = operator.index(seed)
        _int_bytes(self.seed, "seed")
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.with_epoch = bool(with_epoch)
        length = self.epoch_len
        self.batches_per_epoch = (length // self.batch_size if drop_last_batch
                                  else -(-length // self.batch_size))
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"an epoch of {length} samples has no batches of {self.batch_size}"
                f"{' with drop_last' if drop_last_batch else ''}: a sampler needs at least one "
                "batch per epoch (check dataset_len, batch_size and drop_last)")
        self._epoch = 0
        self._consumed = 0
        self._rolled = False  # advance() finished the epoch; no new iteration has started since
        self._cache: Optional[tuple[int, np.ndarray]] = None
        self._restored_rng: Optional[torch.Tensor] = None  # see after_restore
        self._checked_loader = False

    # --- position --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch being trained (after an epoch's last ``advance()``: the next one)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Batches of :attr:`epoch` the training loop has consumed; always < batches_per_epoch."""
        return self._consumed

    @property
    def epoch_len(self) -> int:
        """Samples this sampler yields in a full epoch."""
        return self.dataset_len

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; the current epoch keeps its position (so a restored
        sampler can be driven by ``for e in range(sampler.epoch, n): sampler.set_epoch(e)``)."""
        epoch = _check_int(epoch, "epoch", 0)
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, 0
        self._rolled = False

    def advance(self, batches: int = 1) -> None:
        """Record that the training loop consumed ``batches`` more batches of this epoch.

        Call it after the step that used the batch and before the snapshot that should include it.
        After the epoch's last batch the position moves to the first batch of the next epoch.
        """
        batches = _check_int(batches, "batches", 1)
        if self._rolled:
            raise RuntimeError(
                f"advance() after the last of the {self.batches_per_epoch} batches of epoch "
                f"{self._epoch - 1}: the DataLoader yields more batches per epoch than this "
                f"sampler expects; give both the same batch_size ({self.batch_size}) and drop_last")
        left = self.batches_per_epoch - self._consumed
        if batches > left:
            raise RuntimeError(f"advance({batches}) with only {left} batches of epoch "
                               f"{self._epoch} left")
        self._consumed += batches
        if self._consumed == self.batches_per_epoch:
            self._epoch, self._consumed, self._rolled = self._epoch + 1, 0, True

    def epochs(self, num_epochs: Optional[int] = None) -> Iterator[int]:
        """Yield the epochs to train, from the current (restored) one up to ``num_epochs - 1``
        (forever if None). An epoch whose batches were not all advanced when the loop comes back
        for the next one is ended with a warning (see docs/data.md, "Position")."""
        if num_epochs is not None:
            num_epochs = _check_int(num_epochs, "num_epochs", 0)
        while num_epochs is None or self._epoch < num_epochs:
            epoch = self._epoch
            yield epoch
            if self._epoch == epoch:
                warnings.warn(
                    f"epoch {epoch} ended after {self._consumed} of its {self.batches_per_epoch} "
                    "batches were advanced: call sampler.advance() once per batch, give the "
                    "DataLoader the sampler's batch_size and drop_last, and to end an epoch early "
                    "call sampler.set_epoch(epoch + 1) before that epoch's last snapshot",
                    RuntimeWarning, stacklevel=2)
                self._epoch, self._consumed = epoch + 1, 0

    # --- indices ---------------------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._shard(_epoch_order(self.dataset_len, self.seed, epoch,
                                                           self.shuffle)))
        return self._cache[1]

    def _shard(self, order: np.ndarray) -> np.ndarray:
        return order

    def epoch_indices(self, epoch: Optional[int] = None) -> list[int]:
        """All indices this sampler yields in ``epoch`` (default: the current one), in order."""
        epoch = self._epoch if epoch is None else _check_int(epoch, "epoch", 0)
        return self._order(epoch).tolist()

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._epoch, self._consumed * self.batch_size
        self._rolled = False
        loader_iterator = _calling_loader_iterator()
        if loader_iterator is not None:
            if self._restored_rng is not None:
                self._undo_the_loaders_draw(loader_iterator)
            if not self._checked_loader:
                self._checked_loader = True
                self._warn_about_workers(loader_iterator)
        self._restored_rng = None
        return self._indices(self._order(epoch), start, epoch)

    def after_restore(self) -> None:
        """Called by the engine once ``restore()`` has set the global RNG states (and this
        sampler's position): the torch RNG state an uninterrupted run has at this point, which
        the first iteration after the restore checks (``_undo_the_loaders_draw``)."""
        self._restored_rng = torch.get_rng_state()

    def _undo_the_loaders_draw(self, loader_iterator) -> None:
        """A ``DataLoader`` without ``generator=`` draws its workers' base seed from the global
        torch RNG whenever it starts an iteration (with ``persistent_workers``, only its first).
        An uninterrupted run drew there only at an epoch's start (the run's first, with
        persistent workers); the first iteration after a restore draws wherever the position
        is. Where the uninterrupted run did not draw, that one draw is undone, so that every
        later random draw (dropout) is the same; anything else that moved the RNG in between is
        not touched, and said."""
        persistent = loader_iterator._persistent_workers
        drew_there = self._consumed == 0 and (not persistent or self._epoch == 0)
        now = torch.get_rng_state()
        if drew_there or torch.equal(now, self._restored_rng):  # a generator= draws elsewhere
            return
        after_one_draw = torch.Generator()
        after_one_draw.set_state(self._restored_rng)
        torch.empty((), dtype=torch.int64).random_(generator=after_one_draw)
        if torch.equal(after_one_draw.get_state(), now):
            torch.set_rng_state(self._restored_rng)
        else:
            warnings.warn(
                "the global torch RNG was used between restore() and the first iteration of the "
                f"{self._KIND}'s DataLoader, more than by the loader's own draw: the random "
                "numbers after the resume may differ from an uninterrupted run's. Draw nothing "
                "between restore() and iterating, or give the DataLoader generator=",
                RuntimeWarning, stacklevel=3)

    def _warn_about_workers(self, loader_iterator) -> None:
        """Workers' RNGs are seeded when an iteration starts (``persistent_workers``: when the
        first one does), so after a resume mid-epoch a sample is loaded by another worker at
        another point of its stream: randomness drawn from the global RNGs in ``__getitem__``
        differs. Said once, at the first iteration, unless the samples are seeded one by one."""
        if (loader_iterator._num_workers > 0 and not self.with_epoch
                and not isinstance(loader_iterator._dataset, _SeededPerSample)):
            warnings.warn(
                f"the {self._KIND}'s DataLoader has {loader_iterator._num_workers} workers: random "
                "augmentation drawn in Dataset.__getitem__ from the global RNGs (torch.rand, "
                "random, np.random) differs after a resume, since the workers' RNGs are seeded "
                "when an iteration starts. Draw it from async_ckpt.data.sample_generator(seed, "
                "index.epoch, index) with with_epoch=True (which also silences this), or use "
                "async_ckpt.data.ResumableLoader, which seeds every sample",
                RuntimeWarning, stacklevel=3)

    def _indices(self, order: np.ndarray, start: int, epoch: int) -> Iterator[int]:
        for lo in range(start, len(order), _CHUNK):
            chunk = order[lo:lo + _CHUNK].tolist()
            if self.with_epoch:
                yield from (EpochIndex(i, epoch) for i in chunk)
            else:
                yield from chunk

    def __len__(self) -> int:
        """Samples left in the current epoch (what the next iteration yields)."""
        return max(self.epoch_len - self._consumed * self.batch_size, 0)

    # --- state -----------------------------------------------------------------------------

    def _config(self) -> dict:
        return {"dataset_len": self.dataset_len, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def state_dict(self) -> dict:
        """Plain data: ``version``, ``kind``, the position (``epoch``, ``consumed`` batches) and
        the settings it depends on."""
        return {"version": STATE_VERSION, "kind": self._KIND, "epoch": self._epoch,
                "consumed": self._consumed, **self._config()}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a saved position. Raises StateMismatchError, changing nothing, when the
        state was saved with other settings (the position would then mean other samples)."""
        if not isinstance(state, Mapping):
            raise StateMismatchError(f"a {self._KIND} state is a dict, not a {type(state).__name__}")
        version = state.get("version")
        if type(version) is not int:
            raise StateMismatchError(f"not a {self._KIND} state (no version): keys {sorted(state)}")
        if version != STATE_VERSION:
            raise UnsupportedFormatError(
                f"{self._KIND} state version {version!r}; this async_ckpt reads version "
                f"{STATE_VERSION}: restore with the async_ckpt version that saved it")
        if state.get("kind") != self._KIND:
            raise StateMismatchError(f"the checkpoint holds the state of a {state.get('kind')!r}, "
                                     f"registered here is a {self._KIND}")
        config = self._config()
        missing = [k for k in ("epoch", "consumed", *config) if k not in state]
        if missing:
            raise StateMismatchError(f"{self._KIND} state lacks {', '.join(missing)}")
        differs = [f"{k} saved {state[k]!r}, here {v!r}" for k, v in config.items()
                   if type(state[k]) is not type(v) or state[k] != v]
        if differs:
            raise StateMismatchError(
                f"the saved data position does not fit this {self._KIND}: " + "; ".join(differs)
                + ". Build the sampler with the settings it was saved with (the saved position "
                "counts batches of that dataset, order and batch size)")
        epoch, consumed = state["epoch"], state["consumed"]
        if not (type(epoch) is int and type(consumed) is int and epoch >= 0
                and 0 <= consumed <= self.batches_per_epoch):
            raise StateMismatchError(
                f"{self._KIND} state has epoch {epoch!r}, consumed {consumed!r}: not a position in "
                f"epochs of {self.batches_per_epoch} batches")
        if consumed == self.batches_per_epoch:  # a finished epoch: the next one's start
            epoch, consumed = epoch + 1, 0
        self._epoch, self._consumed, self._rolled = epoch, consumed, False


class DistributedResumableSampler(ResumableSampler):
    """The shard of each epoch that one rank trains, from a saved position.

    Shards like ``torch.utils.data.DistributedSampler`` (docs/data.md, "Distributed": identical
    index assignment for the same epoch order; identical outright with ``shuffle=False``).
    ``consumed`` counts this rank's batches.

    Args:
        dataset_len: the dataset's length, or the dataset itself.
        num_replicas, rank: default to the world size and rank of the default process group.
        shuffle, seed, batch_size, with_epoch: as for :class:`ResumableSampler`.
        drop_last: as ``DistributedSampler``'s: cut the epoch to a multiple of ``num_replicas``
            instead of padding it by repeating its head.
        drop_last_batch: the loader's ``drop_last`` (drop a rank's incomplete last batch).

    The state adds ``num_replicas``, ``rank`` and ``drop_last_batch``. Loading a state of another
    ``num_replicas`` raises StateMismatchError; another ``rank`` is accepted (docs/data.md).
    """

    _KIND = "DistributedResumableSampler"

    def __init__(self, dataset_len: Union[int, Sized], num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, *, shuffle: bool = True, seed: int = 0,
                 batch_size: int = 1, drop_last: bool = False, drop_last_batch: bool = False,
                 with_epoch: bool = False):
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("pass num_replicas and rank, or initialise torch.distributed")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.num_replicas = _check_int(num_replicas, "num_replicas", 1)
        self.rank = _check_int(rank, "rank", 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas - 1}], got {self.rank}")
        self.drop_last = bool(drop_last)
        n = _length_of(dataset_len)
        # DistributedSampler's rule, verbatim.
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.drop_last_batch = bool(drop_last_batch)
        self._setup(n, shuffle, seed, batch_size, drop_last_batch, with_epoch)

    @property
    def epoch_len(self) -> int:
        return self.num_samples

    def _shard(self, order: np.ndarray) -> np.ndarray:
        if self.total_size > len(order):  # pad by repeating the order from its head
            order = np.resize(order, self.total_size)
        return order[:self.total_size][self.rank::self.num_replicas]

    def _config(self) -> dict:
        return {**super()._config(), "num_replicas": self.num_replicas,
                "drop_last_batch": self.drop_last_batch}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rank": self.rank}


# --- the loader ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _global_rngs_seeded(seed: int):
    """Seed Python's, NumPy's and torch's global generators with ``seed`` for the body, and put
    back the states they had (in the training process, they are the training run's streams)."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)  # the CPU one only: CUDA's are the run's
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class _SeededPerSample(Dataset):
    """A map-style dataset whose ``__getitem__`` sees the global RNGs seeded from ``(seed, epoch,
    index)``: random augmentation drawn from them is the same with any ``num_workers``, on any
    worker, and after a resume."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: EpochIndex):
        with _global_rngs_seeded(sample_seed(self.seed, index.epoch, index)):
            return self.dataset[int(index)]


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that resumes exactly: register it with the engine and call
    :meth:`advance` after each batch the training loop consumed.

    It owns what a stock ``DataLoader`` leaves to chance after a restart:

    - the **order and position**: a :class:`ResumableSampler` (``epoch``, batches consumed);
    - the **loader's own draw**: a private ``torch.Generator`` for the worker base seed, so
      starting an iteration never draws from the global torch RNG (which the engine restores:
      one extra draw would change every later dropout mask);
    - **per-sample randomness**: ``dataset[i]`` runs with Python's, NumPy's and torch's global
      RNGs seeded from ``(seed, epoch, i)`` (and put back afterwards), so augmentation written
      the natural way (``torch.rand`` in ``__getitem__``) gives the same draws with any
      ``num_workers`` and after a resume.

    Args: ``dataset`` (map-style), ``batch_size``, ``shuffle``, ``seed``, ``drop_last``; any other
    ``DataLoader`` keyword (``num_workers``, ``collate_fn``, ``pin_memory``,
    ``persistent_workers``, ...) except ``sampler``, ``batch_sampler`` and ``generator``, which it
    owns. ``epoch``, ``consumed``, :meth:`epochs`, :meth:`set_epoch` and :meth:`advance` are the
    sampler's.
    """

    def __init__(self, dataset, batch_size: int = 1, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, **loader_kwargs):
        owned = {"sampler", "batch_sampler", "generator"} & loader_kwargs.keys()
        if owned:
            raise ValueError(f"ResumableLoader owns {sorted(owned)}; pass shuffle= and seed= "
                             "instead")
        sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed, batch_size=batch_size,
                                   drop_last=drop_last, with_epoch=True)
        super().__init__(_SeededPerSample(dataset, sampler.seed), batch_size=batch_size,
                         sampler=sampler, drop_last=drop_last,
                         generator=torch.Generator().manual_seed(sample_seed(seed, -1, -1)),
                         **loader_kwargs)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def consumed(self) -> int:
        return self.sampler.consumed

    def epochs(self, num_epochs: Optional[int] = None) -> Iterator[int]:
        return self.sampler.epochs(num_epochs)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def advance(self, batches: int = 1) -> None:
        self.sampler.advance(batches)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping) -> None:
        self.sampler.load_state_dict(state)


_POSITION_WORDS = ("data", "loader", "sampler", "epoch", "position", "dataset")


def after_restore(state: Mapping) -> Optional[str]:
    """Once ``restore()`` has loaded ``state`` and set the global RNG states: tell the registered
    samplers (``ResumableSampler.after_restore``), and say why the data order after the resume is
    the user's to get right when nothing registered carries a data position (no sampler or
    loader, in dicts or attributes, and no entry named for one: ``data``, ``loader``, ...)."""
    positions = registered_objects(state, (Sampler, DataLoader))
    for sampler in positions:
        if isinstance(sampler, ResumableSampler):
            sampler.after_restore()
    if positions or any(word in key.lower() for key in state for word in _POSITION_WORDS):
        return None
    return ("the snapshot holds no data position (no registered sampler or loader): the data "
            "order after the resume is up to your loop, and a DataLoader(shuffle=True) reshuffles "
            "from the global RNG at whatever point it is created or iterated. Register an "
            "async_ckpt.data.ResumableLoader (or a ResumableSampler and call advance() per batch) "
            "for the order to continue exactly")


def inexact_loader_warnings(state: Mapping) -> list[str]:
    """Why a registered loader cannot resume exactly: one message per problem, naming the fix."""
    messages = []
    for name, obj in state.items():
        if isinstance(obj, Mapping) and not hasattr(obj, "state_dict"):
            messages += inexact_loader_warnings(obj)
        elif (isinstance(obj, DataLoader) and hasattr(obj, "state_dict")  # a stock one is refused
              and not isinstance(obj, ResumableLoader)):
            kind = type(obj).__name__
            if obj.generator is None:
                messages.append(
                    f"{name!r}: a {kind} without generator= draws its worker seed from the global "
                    "torch RNG each time an iteration starts; after a resume that draw lands "
                    "elsewhere and every later random draw (dropout) differs. Pass "
                    "generator=torch.Generator(), or use async_ckpt.data.ResumableLoader")
            if obj.num_workers > 0:
                messages.append(
                    f"{name!r}: the workers of a {kind} are seeded afresh at a resume, so random "
                    "augmentation drawn from a worker's RNG differs afterwards. Use "
                    "async_ckpt.data.ResumableLoader, or draw it from "
                    "async_ckpt.data.sample_generator(seed, epoch, index)")
    return messages
