"""Recovery consistency: is a restore bit-exact, and is one flipped byte caught? Method:
docs/performance.md, "What runs" (training loop)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings

from .harness import files_under
from .records import Consistency, Damage
from .systems import System
from .workloads import TrainingWorkload


def check(system: System, workload: TrainingWorkload, step: int) -> Consistency:
    """On a system with older snapshots, so that one that detects damage can fall back."""
    to_commit = system.saved(step)
    expected = workload.clone_tensors()
    workload.step()
    workload.step()  # so that a restore that does nothing is caught
    system.restart()  # restores read the files, as after a crash (not what the process holds)
    restored = system.restore()
    differing = workload.differing_tensors(expected)
    result = functools.partial(Consistency, step, to_commit, restored, differing == 0, differing,
                               len(expected))
    flip_byte(max(files_under(system.newest_path()), key=os.path.getsize))
    system.restart()
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
    """No warnings or logs below ERROR: a deliberately damaged restore's would read as trouble."""
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
