"""``async-ckpt export``: a committed snapshot, verified while read, as a .pt or .safetensors
file, or as a PyTorch DCP checkpoint (``dcp.py``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from typing import Any, Optional

from .common import (EXIT_OK, UsageError, add_dir_command, add_rank_option, checkpoint_dir,
                     copy_bytes, count_tensors, pick_record, size_text, step_arg)
from ..errors import EncodingError
from ..format.manifest import read_manifest
from ..format.native import SAFETENSORS_DTYPES, SafetensorsEntry, row_major, write_safetensors
from ..storage.local import free_space, umask


HELP = "write a snapshot as .pt, .safetensors or a PyTorch DCP checkpoint"
DESCRIPTION = """\
Write a committed snapshot to a plain torch.save file (FILE.pt: everything, as nested dicts of
tensors and values) or a safetensors file (FILE.safetensors: the tensors only, keyed by their
dotted key paths, e.g. model.0.weight; with --only model the keys are the model's state_dict
keys), or a PyTorch DCP checkpoint directory (--to-dcp OUT: the whole tensors, which
torch.distributed.checkpoint.load reads into a model sharded on any number of ranks). The snapshot
is verified while read, and its uncompressed tensors are mapped rather than copied into memory, so
a snapshot larger than memory can be exported (except a sharded one: its tensors are assembled
whole in memory).
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "export", cmd_export, HELP, DESCRIPTION)
    sub.add_argument("--step", type=step_arg, metavar="N",
                     help="the committed step to export (default: the newest)")
    target = sub.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="FILE",
                        help="output file, ending in .pt (or .pth) or .safetensors")
    target.add_argument("--to-dcp", metavar="OUT",
                        help="output directory (new): a PyTorch DCP checkpoint, which "
                             "torch.distributed.checkpoint.load reads on any world size")
    sub.add_argument("--only", metavar="ENTRY",
                     help="export one top-level entry (model, optimizer, ...) instead of all")
    add_rank_option(sub, "export")
    sub.add_argument("--force", action="store_true", help="overwrite FILE if it exists (never a directory)")
    sub.add_argument("--allow-pickle", action="store_true",
                     help="decode pickled values (runs code from the file: only for files you trust)")


def cmd_export(args: argparse.Namespace) -> int:
    storage = checkpoint_dir(args.dir)
    target = args.to_dcp if args.to is None else args.to
    _check_target(target, args)
    manifest = read_manifest(storage)
    wanted = pick_record(manifest, args.step, storage.location(), "export").step

    from ..read.snapshot import load
    try:
        step, state = load(storage, wanted, rank=args.rank, allow_pickle=args.allow_pickle,
                           mmap=True, verify=True)  # verified, in the page cache, not copied
    except EncodingError as e:  # load() raises it only for a refused pickle
        raise UsageError(f"step {wanted}: {str(e).split(';')[0]}, refused by default; pass "
                         "--allow-pickle only if you trust where this checkpoint came from") from e
    what = "all entries"
    if args.only is not None:
        if args.only not in state:
            raise UsageError(f"step {step} has no entry {args.only!r}; its entries: "
                             f"{', '.join(state) or 'none'}")
        state, what = state[args.only], f"entry {args.only!r}"

    skipped: list[str] = []
    if args.to_dcp is not None:
        if not isinstance(state, dict):
            raise UsageError(f"{what} of step {step} is not a dict; a DCP checkpoint holds a "
                             "dict: export all entries, or one that is a state_dict")
        from .dcp import write_dcp
        write_dcp(state, target)
        count, nbytes = count_tensors(state)
    elif target.lower().endswith(".safetensors"):
        count, nbytes, skipped = _write_safetensors(state, target, step, what, args.only)
    else:
        _write_atomically(target, lambda tmp: _torch_save(state, tmp))
        count, nbytes = count_tensors(state)
    print(f"exported step {step} ({what}) to {target}: {count} tensors, {size_text(nbytes)} of tensor data")
    if skipped:
        shown = ", ".join(skipped[:8]) + (f", ... ({len(skipped)} in all)" if len(skipped) > 8 else "")
        print(f"not in the safetensors file (not tensors): {shown}; export to .pt to keep them")
    return EXIT_OK


def _check_target(target: str, args: argparse.Namespace) -> None:
    """UsageError for an output path that cannot be written, before anything is read."""
    if args.to_dcp is None:
        if os.path.splitext(target)[1].lower() not in (".pt", ".pth", ".safetensors"):
            raise UsageError(f"{target}: the file name must end in .pt or .safetensors (it picks "
                             "the format)")
        if os.path.isdir(target):
            raise UsageError(f"{target} is a directory; pass a file name")
    elif os.path.lexists(target):  # never removed: --force does not reach a directory
        raise UsageError(f"{target} exists; pass a new directory for the DCP checkpoint")
    if os.path.lexists(target) and not args.force:
        raise UsageError(f"{target} exists; pass --force to overwrite it, or choose another name")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise UsageError(f"{parent} does not exist; create it first")


def _write_atomically(target: str, write) -> None:
    """``write(tmp)``, then ``tmp`` renamed to ``target``: a failed export leaves no file. ``tmp``
    is created first, exclusively, under a name nobody can guess: a link planted where it will be
    is never written through."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.tmp-",
                               dir=os.path.dirname(os.path.abspath(target)))
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # as an open() would have made it, not mkstemp's 0600
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _torch_save(state: Any, path: str) -> None:
    import torch
    torch.save(state, path)


def _write_safetensors(state: Any, target: str, step: int, what: str,
                       only: Optional[str]) -> tuple[int, int, list[str]]:
    tensors, skipped = _flat_tensors(state)
    if not tensors:
        raise UsageError(f"{what} of step {step} holds no tensors; export it to a .pt file")
    entries = [_safetensors_entry(key, t) for key, t in tensors.items()]
    nbytes = sum(e.nbytes for e in entries)  # a stride-0 tensor of a few bytes may expand to
    directory = os.path.dirname(os.path.abspath(target))  # more than the disk holds
    free = free_space(directory)
    if nbytes > free:
        raise UsageError(f"the safetensors file would hold {nbytes / 1e9:.2f} GB of tensor data "
                         f"(views made whole), {free / 1e9:.2f} GB is free in {directory}; "
                         "export to a .pt file, which keeps views as they are")
    metadata = {"format": "pt", "async_ckpt.step": str(step), "async_ckpt.entry": only or ""}
    _write_atomically(target, lambda tmp: _save_safetensors(entries, tmp, metadata))
    return len(tensors), nbytes, skipped


def _safetensors_entry(key: str, t) -> SafetensorsEntry:
    """Tensor ``t`` as safetensors holds it, its elements read a piece at a time when the file
    is written: a view (transposed, shared, expanded by a stride of 0) is never made whole."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in SAFETENSORS_DTYPES:
        raise UsageError(f"safetensors cannot hold tensor {key[:80]} of dtype {dtype}; export to "
                         "a .pt file instead")
    return SafetensorsEntry(key, dtype, tuple(t.shape), copy_bytes(t, f"tensor {key[:80]}"),
                            lambda: row_major(_as_numpy(t)))


def _as_numpy(t):
    """``t``'s elements as a numpy view of the same strides, nothing copied: integers of its
    element size, since numpy has no bfloat16 or float8."""
    import torch
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().view(ints[t.element_size()]).numpy()


def _save_safetensors(entries: list[SafetensorsEntry], path: str, metadata: dict) -> None:
    with open(path, "wb") as out:
        write_safetensors(out, entries, metadata)


MAX_KEY_PATH = 4096
"""The longest dotted key path a safetensors export builds: a deep tree of long keys would
otherwise build megabytes of path for every leaf."""


def _flat_tensors(state: Any) -> tuple[dict, list[str]]:
    """Tensors of ``state`` by dotted key path, and the paths of the other values."""
    import torch
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []

    def walk(v: Any, path: str) -> None:
        if len(path) > MAX_KEY_PATH:
            raise UsageError(f"a key path is longer than {MAX_KEY_PATH} characters "
                             f"({path[:60]!r}...); safetensors keys are key paths: export to a "
                             ".pt file instead")
        if isinstance(v, torch.Tensor):
            if path in tensors:
                raise UsageError(f"two tensors map to the safetensors key {path!r} (a key holds a "
                                 "dot); export to a .pt file instead")
            tensors[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)) and any(_holds_tensor(x) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}" if path else str(i))
        else:
            skipped.append(path or "<value>")

    walk(state, "")
    return tensors, skipped


def _holds_tensor(v: Any) -> bool:
    import torch
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False
