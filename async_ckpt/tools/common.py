"""What the command line's commands share: exit codes, the two expected failures, and the
helpers that open a checkpoint directory or bucket prefix, pick a committed record and print sizes
and times, so that every command says these things the same way."""

from __future__ import annotations

import argparse
import datetime
import importlib
import io
import math
import sys
import textwrap
import time
from typing import Callable, Iterator, Optional

from .argtypes import duration_text, int_arg
from ..errors import NoSnapshotError
from ..format.manifest import Manifest, SnapshotRecord
from ..format.shard import MAX_EXTENT
from ..storage.names import MANIFEST_NAME, RANK_ROOT, SNAPSHOT_DIR, is_lock_file
from ..storage.base import Storage
from ..storage.open import open_storage
from ..storage.remote import is_remote

PROG = "async-ckpt"
# Every exit code of the command line is decided here (each command returns one of these, and
# ``cli.main`` turns expected failures into them), and explained to users by the help texts below.
EXIT_OK, EXIT_DAMAGE, EXIT_USAGE, EXIT_NOT_REPRODUCIBLE = 0, 1, 2, 3
# ``supervise`` exits with its job's code; these are its own. A job killed by a signal or hung
# after the last restart: 1; a command that cannot be run, or is not found: 126, 127 (as shells
# say); a signal S that stopped the supervisor: 128 + S.
EXIT_JOB_FAILED, EXIT_CANNOT_RUN, EXIT_NOT_FOUND, EXIT_SIGNALLED = 1, 126, 127, 128

EXIT_CODES_HELP = """\
exit codes:
  0  fine: everything named is intact, the logs are identical, gc finished
  1  damage found, or not done: a damaged, truncated or missing snapshot
     file, a damaged manifest, a format version this release cannot read,
     no committed snapshot, loss logs that differ (after the resume, or
     where no resume point is known), gc refused (an engine is writing to
     the directory, or a kept snapshot is damaged), an object store that
     cannot be reached
  2  usage error: bad arguments, a missing directory or file, a directory
     (or s3:// URL) that is not a checkpoint directory, a step that is not
     committed, an unknown entry
  3  compare-loss: the runs are not reproducible (they differ before the
     resume, or the two uninterrupted runs differ): not the resume's fault

Errors are one line on stderr: "async-ckpt: error: <cause>; <what to do>".
"""

SUPERVISE_EXIT_CODES_HELP = """\
exit codes:
  0    CMD finished with exit code 0
  75   CMD exited with the preemption code (--preemption-exit-code)
  N    after the last restart: CMD's exit code, or 1 if it was killed by a
       signal or hung
  128+S  the supervisor received signal S (143: SIGTERM, 130: SIGINT) and
       CMD did not exit with the preemption code
  2    usage error; 126/127: CMD cannot be run / was not found
"""


class UsageError(Exception):
    """The command line asked for something that does not exist or makes no sense: exit 2."""


class NotDone(Exception):
    """An expected outcome that is not damage but is not fine either (gc refused): exit 1."""


def add_command(commands, name: str, run: Callable[[argparse.Namespace], int], help: str,
                description: str, exit_codes: str = EXIT_CODES_HELP) -> argparse.ArgumentParser:
    """A command's sub-parser, which runs ``run(args)`` and shows its ``exit_codes`` in its
    --help; ``description`` is reflowed, so it may be written as a block of text."""
    sub = commands.add_parser(name, help=help,
                              description=textwrap.fill(" ".join(description.split()), 79),
                              epilog=exit_codes,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.set_defaults(run=run)
    return sub


def add_dir_command(commands, name: str, run: Callable[[argparse.Namespace], int], help: str,
                    description: str) -> argparse.ArgumentParser:
    """:func:`add_command` for a command on a checkpoint directory: its first argument is DIR."""
    sub = add_command(commands, name, run, help, description)
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory, or the s3://bucket/prefix "
                     "URL an engine uploads to (settings from the AWS environment)")
    return sub


def add_rank_option(sub: argparse.ArgumentParser, verb: str) -> None:
    """``--rank R``: which rank's shard the command reads (rank 0 unless told)."""
    sub.add_argument("--rank", type=step_arg, default=0, metavar="R",
                     help=f"which rank's shard to {verb} (default 0)")


def fail(message: str, code: int) -> int:
    """Print ``message`` as the one error line on stderr, escaped; returns ``code``."""
    print(escaped(f"{PROG}: error: {' '.join(message.split())}"), file=sys.stderr)
    return code


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0)) if c not in (9, 10)}


def escaped(text: str) -> str:
    """``text`` with its control characters (but tab and newline) written as ``\\xNN``: names
    read from a checkpoint reach the terminal as text, never as escape sequences."""
    return text.translate(_CONTROL)


class EscapedOutput(io.TextIOBase):
    """A text stream that writes everything ``escaped`` to ``stream`` (the commands' stdout)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(escaped(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()


def checkpoint_dir(location: str) -> Storage:
    """The checkpoint root ``location`` names (a directory or an ``s3://bucket/prefix`` URL) if it
    looks like one, else a UsageError saying what to pass.

    A checkpoint root holds a manifest, snapshot directories, or an engine's lock files (an engine
    that has not committed yet; a bucket has none)."""
    storage = open_storage(location)
    names = storage.list_root()
    own_roots = sorted(n for n in names if RANK_ROOT.fullmatch(n))
    if own_roots and MANIFEST_NAME not in names:
        raise UsageError(f"{location} holds the ranks' own roots ({', '.join(own_roots[:4])}"
                         f"{', ...' if len(own_roots) > 4 else ''}) of a job whose ranks shared no "
                         "directory: its snapshots are in the object store given as remote= "
                         f"(pass that s3:// URL), each rank's copy of its shards in "
                         f"{storage.location(own_roots[0])} and the like")
    if (MANIFEST_NAME in names or any(SNAPSHOT_DIR.fullmatch(n) for n in names)
            or any(map(is_lock_file, names))):
        return storage
    if is_remote(location):
        raise UsageError(f"{location} is not an async_ckpt checkpoint prefix (no {MANIFEST_NAME}, "
                         "no step-* snapshot objects); pass the URL given to CheckpointEngine as "
                         "remote= (the prefix that holds manifest.json)")
    raise UsageError(f"{location} is not an async_ckpt checkpoint directory (no {MANIFEST_NAME}, "
                     "no step-* snapshot directories); pass the directory given to "
                     "CheckpointEngine (the one that holds manifest.json)")


def size_text(n: Optional[int]) -> str:
    """``n`` bytes for people: ``4.1 kB``, ``?`` when unknown."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def when_text(ts: float) -> str:
    """A Unix time as local time and age: ``2024-02-29 12:00:00 (3 h ago)``."""
    stamp = datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    age = time.time() - ts
    if age < -60:
        return f"{stamp} (in the future: clock skew?)"
    return f"{stamp} ({duration_text(max(age, 0.0))} ago)"


def _committed_steps(manifest: Manifest) -> str:
    return ", ".join(map(str, manifest.steps())) or "none"


def pick_record(manifest: Manifest, step: Optional[int], root: str, what: str) -> SnapshotRecord:
    """The record for ``step``, or the newest committed one (commit order) when ``step`` is None."""
    if not manifest.snapshots:
        raise NoSnapshotError(f"{root} holds no committed snapshot, nothing to {what}; `{PROG} ls "
                              f"{root}` lists leftovers of snapshots that never committed")
    if step is None:
        return manifest.snapshots[-1]
    record = manifest.find(step)
    if record is None:
        raise UsageError(f"step {step} is not committed in {root}; committed steps: "
                         f"{_committed_steps(manifest)}")
    return record


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def optional_module(name: str, extra: str, what: str):
    """The optional dependency ``name``, which ``what`` needs; a UsageError saying which extra
    installs it when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UsageError(f"{what} needs {name}, which is not installed: pip install "
                         f"'async_ckpt[{extra}]'") from None


def progress(total: int, desc: str):
    """A byte progress bar on stderr; silent when stderr is not a terminal."""
    tqdm = optional_module("tqdm", "cli", "the progress bar").tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                file=sys.stderr, leave=False, disable=not _is_tty(sys.stderr))


step_arg = int_arg(0)  # steps and ranks
positive_arg = int_arg(1)


def iter_tensors(state) -> Iterator:
    """Every tensor in ``state`` (nested dicts, lists and tuples), walked without recursion."""
    import torch
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def count_tensors(state) -> tuple[int, int]:
    """How many tensors ``state`` holds, and their bytes."""
    tensors = list(iter_tensors(state))
    return len(tensors), sum(map(dense_bytes, tensors))


def dense_bytes(t) -> int:
    """The bytes of tensor ``t`` made whole and contiguous, in Python's integers: torch's
    ``nbytes`` wraps around past 2^63 (an expanded, stride-0 tensor of shape [2^31, 2^31] of
    float32 says 0)."""
    return math.prod(t.shape) * t.element_size()


def copy_bytes(t, name: str) -> int:
    """``dense_bytes(t)`` of a tensor an export is about to copy whole (``name`` it in the
    message); UsageError when that is more than any tensor can hold (2^62 bytes: torch's size
    arithmetic would overflow), before anything is allocated."""
    n = dense_bytes(t)
    if n > MAX_EXTENT:
        shape = ", ".join(map(str, t.shape[:8])) + (", ..." if t.dim() > 8 else "")
        raise UsageError(f"{name} would take {n} bytes copied whole (shape [{shape}] of "
                         f"{str(t.dtype).removeprefix('torch.')}, saved as a view of "
                         f"{t.untyped_storage().nbytes()} bytes): more than a tensor can hold "
                         "(2^62 bytes); export to a .pt file, which keeps it as the view it is")
    return n
