"""``async-ckpt import-dcp``: a PyTorch DCP checkpoint as a snapshot of a new checkpoint directory
(the reading itself, and why it never runs code from the checkpoint, is ``dcp.py``'s)."""

from __future__ import annotations

import argparse

from .argtypes import int_arg
from .common import (EXIT_DAMAGE, EXIT_OK, UsageError, add_command, count_tensors, fail,
                     size_text)
from ..errors import CorruptSnapshotError, EncodingError, StateMismatchError
from ..storage.names import MAX_STEP

HELP = "write a PyTorch DCP checkpoint as an async_ckpt snapshot"
DESCRIPTION = """\
Read the DCP checkpoint SRC (what torch.distributed.checkpoint.save or async_save wrote, on any
number of ranks) and write it as the one snapshot, step N, of the new checkpoint directory DIR.
Sharded tensors are assembled whole (the machine needs memory for the whole state); restore() then
loads them into the registered objects on any world size and layout, each rank taking its part.
Each top-level dict of the DCP state (an AppState's, a model's or optimizer's state_dict) is given
to the object registered under the same name (or, with --as-dict NAME, loaded into a dict
registered under NAME). The checkpoint is read without running code from
it: values that need more than torch.load(weights_only=True) are refused unless --allow-pickle.
"""


def add(commands) -> None:
    sub = add_command(commands, "import-dcp", cmd_import_dcp, HELP, DESCRIPTION)
    sub.add_argument("source", metavar="SRC", help="the DCP checkpoint directory")
    sub.add_argument("dir", metavar="DIR", help="the new checkpoint directory (empty or absent)")
    sub.add_argument("--step", type=int_arg(0, MAX_STEP - 1), required=True, metavar="N",
                     help="the training step the checkpoint was taken at (restore() returns it)")
    sub.add_argument("--as-dict", action="append", default=[], metavar="NAME",
                     help="write the top-level entry NAME as a plain dict, restored into a dict "
                          "registered under NAME (default: an object's state_dict); repeatable")
    sub.add_argument("--allow-pickle", action="store_true",
                     help="load pickled values (runs code from the checkpoint: only for "
                          "checkpoints you trust)")


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from .dcp import import_dcp

    try:
        state = import_dcp(args.source, args.dir, args.step, args.allow_pickle, args.as_dict)
    except EncodingError as e:
        raise UsageError(f"{e}; pass --allow-pickle only if you trust where this checkpoint "
                         "came from") from e
    except StateMismatchError as e:
        raise UsageError(str(e)) from e
    except CorruptSnapshotError as e:  # the DCP checkpoint's damage: `verify` cannot help
        return fail(f"{e}; nothing was written", EXIT_DAMAGE)
    count, nbytes = count_tensors(state)
    print(f"imported {args.source} into {args.dir} as step {args.step}: {count} tensors, "
          f"{size_text(nbytes)} of tensor data, entries {', '.join(state) or 'none'}")
    return EXIT_OK

