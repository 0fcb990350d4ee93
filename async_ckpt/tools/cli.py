"""The operator's command line: ``async-ckpt COMMAND ...`` (also ``python -m async_ckpt``).

Answers, without writing Python, which snapshots exist, which are intact, what is in them, and moves
weights out: ``ls``, ``inspect``, ``verify``, ``export``, ``import-dcp``, ``gc``, plus
``compare-loss`` for training logs. Everything is read through the library (``manifest``, ``format.shard.ShardReader``,
``read.snapshot.load``), so the command line and ``restore()`` never disagree about what a snapshot is.

This module is the entry point: the parser, and the one place where expected failures become exit
codes. Each command lives in a module of its own (``ls``, ``inspect``, ``verify``, ``export``,
``import_dcp``, ``gc``, ``compare_loss``; ``advise``, ``supervisor`` and ``dcp`` are libraries too) whose ``add(commands)``
declares its arguments and whose ``cmd_<command>(args)`` runs it and returns the exit code; a new
command is one more module and one more entry in ``_COMMANDS``. What commands share is in
``common``. Expected failures are exceptions caught once, in :func:`main`, and printed as one line
on stderr. The exit codes, and what each means, are declared once, in ``common`` (``EXIT_*``, and
the ``EXIT_CODES_HELP`` every command's --help shows): 0 fine, 1 damage found or not done, 2 usage
error, 3 (``compare-loss``) runs that are not reproducible; ``supervise`` exits with its job's.

A command on a checkpoint directory takes an ``s3://bucket/prefix`` URL as well: ``common.
checkpoint_dir`` opens either as a ``Storage``, and the commands read only through it.

Torch is imported only by the commands that need it (``inspect``, ``export``, ``import-dcp``;
``verify`` and ``gc`` once they check a state tree as restore does), so ``ls``,
``compare-loss`` and ``--help`` start fast (tests/test_cli.py checks it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
import warnings
from typing import Optional, Sequence

from . import advise, compare_loss, export, gc, import_dcp, inspect, ls, supervisor, verify
from .common import (EXIT_CODES_HELP, EXIT_DAMAGE, EXIT_OK, EXIT_SIGNALLED, EXIT_USAGE, PROG,
                     SUPERVISE_EXIT_CODES_HELP, EscapedOutput, NotDone, UsageError, add_command,
                     escaped, fail)
from .. import __version__
from ..errors import CheckpointDirError, CheckpointError, CorruptSnapshotError, DirectoryInUseError

__all__ = ["main", "build_parser"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script passes it to sys.exit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    notes = _Notes(args.command not in _LIVE_COMMANDS)
    try:
        with notes, contextlib.redirect_stdout(EscapedOutput(sys.stdout)):
            code = args.run(args)
    except UsageError as e:
        return fail(str(e), EXIT_USAGE)
    except (NotDone, DirectoryInUseError) as e:
        return fail(str(e), EXIT_DAMAGE)
    except CheckpointDirError as e:
        return fail(str(e), EXIT_USAGE)
    except CorruptSnapshotError as e:
        return fail(f"{e}; run `{PROG} verify` on the directory to list every damaged snapshot",
                    EXIT_DAMAGE)
    except CheckpointError as e:  # ManifestError, UnsupportedFormatError, NoSnapshotError, ...
        return fail(str(e), EXIT_DAMAGE)
    except BrokenPipeError:  # `async-ckpt ls DIR | head`: the reader left; not an error worth a line
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_DAMAGE
    except OSError as e:
        return fail(_os_error_message(e), EXIT_USAGE if e.errno in _USAGE_ERRNOS else EXIT_DAMAGE)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_SIGNALLED + signal.SIGINT)
    notes.report()
    return code


_LIVE_COMMANDS = ("supervise",)  # its log lines are news while the job runs: shown as they come


class _Notes(logging.Handler):
    """What the library logs and warns while a command runs, held back: a failed command prints
    its one error line only, a command that succeeds at most one line of warning."""

    def __init__(self, active: bool):
        super().__init__(logging.WARNING)
        self.active, self.messages = active, []
        self._logger = logging.getLogger("async_ckpt")
        self._warnings = warnings.catch_warnings(record=True)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_Notes":
        if self.active:
            self._propagate, self._logger.propagate = self._logger.propagate, False
            self._logger.addHandler(self)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self._logger.removeHandler(self)
            self._logger.propagate = self._propagate
            self._warnings.__exit__(*exc)
            self.messages += [str(w.message) for w in self._caught]

    def report(self) -> None:
        if self.messages:
            more = f" ({len(self.messages) - 1} more)" if len(self.messages) > 1 else ""
            print(escaped(f"{PROG}: warning: {' '.join(self.messages[0].split())}{more}"),
                  file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, verify, export and clean up async_ckpt checkpoint directories.",
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(commands)
    return parser


_USAGE_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST}


def _os_error_message(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM):
        todo = "run as a user that may access it, or fix its permissions"
    elif e.errno in (errno.ENOENT, errno.ENOTDIR):
        todo = "check the path"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "free space or write somewhere else"
    elif e.errno == errno.EIO:
        todo = f"the device reported an I/O error; check the disk, then run `{PROG} verify`"
    else:
        todo = "check the file system, then run the command again"
    return f"{where}{what}; {todo}"


# --- advise and supervise: libraries of their own, glued here ---------------------------------


def _add_advise(commands) -> None:
    sub = add_command(commands, "advise", cmd_advise, help=advise.CLI_HELP,
                      description=advise.CLI_DESCRIPTION)
    advise.add_arguments(sub)


def cmd_advise(args: argparse.Namespace) -> int:
    try:
        result = advise.advise_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    print(advise.render(args, result))
    return EXIT_OK


def _add_supervise(commands) -> None:
    sub = add_command(commands, "supervise", supervisor.run_from_args,
                      help="run a training command, restarting it when it crashes or hangs",
                      description=supervisor.DESCRIPTION,
                      exit_codes=SUPERVISE_EXIT_CODES_HELP)  # the job's codes, not 0/1/2
    supervisor.add_arguments(sub)


_COMMANDS = (ls.add, inspect.add, verify.add, export.add, import_dcp.add, gc.add, compare_loss.add,
             _add_advise, _add_supervise)
