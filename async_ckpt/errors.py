"""Typed errors. Every message says what went wrong and what the user can do about it.

All errors derive from :class:`CheckpointError`, so ``except CheckpointError`` catches anything the
library raises on purpose. Tests assert on these types, not on message text.

An error's only argument is its message, so every error pickles: the writer process sends the
error objects themselves to the training process, which raises them.
"""


class CheckpointError(Exception):
    """Base class of every error raised by async_ckpt."""

    # Damage to a snapshot: restore moves on to the previous one. Set by the class (subclasses
    # inherit it), so that the fallback is decided by type, never by the name of one.
    is_damage = False


class UnsupportedPlatformError(CheckpointError, ImportError):
    """async_ckpt runs on Linux only; raised when the package is imported anywhere else. An
    ImportError too, as it is raised by ``import async_ckpt``."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument is invalid: a setting of ``CheckpointEngine`` (``EngineOptions``, refused
    before the directory is touched), a step. A ValueError too, as Python's own argument checks
    raise."""


class CheckpointDirError(CheckpointError):
    """The checkpoint directory is missing, not a directory, or not writable."""


class DirectoryInUseError(CheckpointDirError):
    """Another engine, or the writer process of one (perhaps of a killed job, still committing),
    holds the directory's lock for this rank."""


class EngineClosedError(CheckpointError):
    """A method was called on an engine after ``close()``."""


class WriterDiedError(CheckpointError):
    """The background writer process exited unexpectedly (killed, crashed, out of memory)."""


class SnapshotWriteError(CheckpointError):
    """Writing a snapshot failed; the snapshot was discarded and committed ones are untouched."""


class InternalError(CheckpointError):
    """A bug in async_ckpt: something other than an I/O error failed inside the library (the
    writer process's log holds the traceback). Not an I/O error, so not a ``SnapshotWriteError``:
    please report it."""


class DiskFullError(SnapshotWriteError):
    """The file system ran out of space (ENOSPC/EDQUOT) while writing a snapshot."""


class StagingMemoryError(CheckpointError):
    """Host memory for the staging pool could not be allocated."""


class LayoutError(CheckpointError):
    """The state cannot be captured: an unsupported tensor kind, or a layout the engine cannot follow."""


class EncodingError(CheckpointError):
    """A non-tensor value has no safe encoding; the message names its key path."""


class CorruptSnapshotError(CheckpointError):
    """A snapshot file is damaged: bad checksum, truncated, or structurally invalid."""

    is_damage = True


class ChecksumMismatchError(CorruptSnapshotError):
    """A chunk's stored bytes do not match the checksum recorded when it was written."""


class InsufficientMemoryError(CheckpointError):
    """Restoring a snapshot, or a staging slot of the memory tier (``memory_every``), needs more
    host memory than is available now. Not damage: restore does not fall back to an older
    snapshot, so that the newest one is not silently skipped."""


class MemoryTierError(CheckpointError):
    """The memory tier's keeper process (``memory_every``) could not be started or reached, is
    another user's, or answered with something malformed (its answers are untrusted input).
    Raised when the engine is created; later, the tier stops with a warning, training goes on,
    and restores read the disk."""


class UnsupportedFormatError(CheckpointError):
    """The file was written in a format version this library does not read."""

    is_damage = True  # for this library: an older snapshot may still be readable


class ManifestError(CheckpointError):
    """The root manifest is missing where required, unreadable, or not an async_ckpt manifest."""


class NoSnapshotError(CheckpointError):
    """No committed snapshot can be restored (none exists, the asked-for step is absent, or all are damaged)."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the registered state: missing, unexpected or mismatched keys."""


class WorldSizeMismatchError(StateMismatchError):
    """The snapshot was written by a different number of ranks than the job restoring it has."""


class StagingRaceError(SnapshotWriteError):
    """With lazy staging, a staged tensor changed before its copy finished, by a write no fence
    saw: that snapshot was not taken (the next one is unaffected)."""


class ReplicaMismatchError(SnapshotWriteError):
    """State declared replicated differs between ranks; the snapshot was not committed."""


class RemoteStorageError(CheckpointError):
    """The object store could not be reached or refused a request (down, no such bucket, bad
    credentials). Not damage: restore does not fall back past it. Uploads retry it on their own;
    local snapshots keep committing meanwhile."""


class RemoteConflictError(RemoteStorageError):
    """Another engine wrote the same remote prefix (its manifest changed under this one's
    conditional write): this engine stops uploading, and nothing of the other's is replaced."""


class DistributedSetupError(CheckpointError):
    """The ranks of a job disagree about the checkpoint set-up (directory, arguments), or
    ``torch.distributed`` is not initialised where several ranks need it."""


class IntegrationError(CheckpointError, ImportError):
    """A framework adapter (``async_ckpt.integrations``) cannot work with the framework installed
    (missing, a version outside the range it supports, a private piece it relies on gone or
    changed) or with how the framework was set up (a strategy whose state it cannot capture, or
    that saves without the framework's checkpoint plugin); the message names what to do. An
    ImportError too, since most are raised when the adapter's module is imported."""


class UnsupportedOptionError(CheckpointError, TypeError):
    """A framework passed an adapter an option it does not support (Lightning's
    ``storage_options``); the message names what to do instead. A TypeError too, as the
    frameworks' own plugins raise for an option they do not take."""


class PointerFileError(CheckpointError):
    """A file that stands for a snapshot in a framework's own layout (a Lightning ``.ckpt`` written
    by ``async_ckpt.integrations``) is malformed, or names a snapshot of another checkpoint
    directory or run. Not damage to a snapshot: nothing else is loaded in its place."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; a supervisor does not restart on it


class Preempted(SystemExit):
    """Raised by ``snapshot()`` after a preemption signal, once the snapshot it took is committed.

    A ``SystemExit``: left uncaught it ends the process with ``PREEMPTED_EXIT_CODE`` (75). Catch it
    to do more work before exiting; ``.step`` is the committed step, ``.signal`` the signal number.
    """

    def __init__(self, step: int, signum: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal = step, signum

    def __reduce__(self):  # its args are the exit code, not what __init__ takes
        return type(self), (self.step, self.signal)
