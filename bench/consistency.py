"""Recovery consistency, measured: does a restore give back the snapshot bit for bit, and is a
damaged snapshot caught?

``check`` runs on a system that has taken snapshots already (the training loop's), so a system that
detects damage has an older snapshot to fall back to:

1. snapshot the current state and wait until it is durable; keep a copy of the state's tensors;
2. train two more steps (so a restore that does nothing is caught), restore, compare every tensor
   bit for bit with the copy;
3. flip one byte in the middle of the snapshot's largest file (tensor data in every format here),
   train a step, restore again. Outcomes: an error (detected), a restore of an older snapshot
   (detected, fell back), or a state that differs from the snapshot with no error (not detected:
   silently wrong values).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings

from .measure import files_under
from .records import Consistency, Damage
from .systems import System
from .workloads import TrainingWorkload


def check(system: System, workload: TrainingWorkload, step: int) -> Consistency:
    system.save(step)
    system.wait()
    to_commit = system.to_commit_s()
    expected = workload.clone_tensors()
    workload.step()
    workload.step()
    restored = system.restore()
    differing = workload.differing_tensors(expected)
    result = functools.partial(Consistency, step, to_commit, restored, differing == 0, differing,
                               len(expected))
    flip_byte(max(files_under(system.newest_path()), key=os.path.getsize))
    workload.step()
    try:
        with _quietly():  # the fallback's warning is the finding, recorded below
            restored = system.restore()
    except Exception as e:  # noqa: BLE001 - any error is a detection; its type is the finding
        return result(Damage("detected", type(e).__name__))
    differing = workload.differing_tensors(expected)
    if restored is not None and restored != step:
        return result(Damage("detected", f"fell back to step {restored}"))
    if differing:
        return result(Damage("not detected",
                             f"loaded silently; {differing} of {len(expected)} tensors wrong"))
    return result(Damage("no effect", "the flipped byte changed no tensor"))


@contextlib.contextmanager
def _quietly():
    """Neither warnings nor log records below ERROR while a deliberately damaged snapshot is
    restored: they would read as trouble in the benchmark's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
