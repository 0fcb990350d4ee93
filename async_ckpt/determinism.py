"""What makes a PyTorch run bit-reproducible from process to process, set where a process can set
it, and said where it cannot (docs/data.md, "Reproducible runs").

Comparing a resumed run's losses with an uninterrupted run's (``async-ckpt compare-loss``) tests the
resume only when two uninterrupted runs agree bit for bit. On CPU they do not once a BLAS splits a
matrix product over a number of threads it picks by the machine's load: measured with torch 2.13
(MKL, 2 intra-op threads, a busy machine), 1 process in 12 trained the same MLP to other losses
(differences of about 3e-7); with one thread, 16 in 16 agreed. On CUDA, cuBLAS and kernels that add
with atomics differ from run to run unless told otherwise.
"""

from __future__ import annotations

import logging
import os

import torch

from .checks import is_int, short_repr
from .errors import InvalidArgumentError

__all__ = ["deterministic", "CUBLAS_WORKSPACE"]

log = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"  # what torch's reproducibility notes give CUBLAS_WORKSPACE_CONFIG


def deterministic(threads: int = 1, warn_only: bool = False) -> dict[str, str]:
    """Set what this process can set to train bit-reproducibly; returns (and logs at INFO) what it
    set, each setting's name to its value and how, and what it could not set, as ``"not set: "``
    and the reason.

    - ``torch.set_num_threads(threads)``: the intra-op threads (OpenMP and MKL), pinned. One thread
      is what was measured reproducible on a busy machine; a larger fixed count is only where the
      BLAS does not adapt its split to the load, which MKL with 2 threads did not keep to;
    - ``OMP_NUM_THREADS``, when unset: to ``threads``, for the processes this one starts (this
      process's OpenMP read it at start-up, so ``set_num_threads`` does it here);
    - ``torch.use_deterministic_algorithms(True, warn_only=warn_only)``: an operation without a
      deterministic implementation then raises (or warns, with ``warn_only``);
    - ``torch.backends.cudnn.benchmark = False`` and ``cudnn.deterministic = True``;
    - ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, when unset and CUDA is not yet initialised (cuBLAS reads
      it when it starts); once CUDA is initialised it cannot be set from here: set it in the
      environment that starts the process.

    Call it first thing, before building the model and the data. It cannot make a run reproducible
    by itself: seed the RNGs (the engine saves and restores them), draw the data in an order that
    is a function of the seed and the position (``async_ckpt.data``), run the same versions on the
    same kind of hardware with the same number of ranks.
    """
    if not is_int(threads, 1):
        raise InvalidArgumentError(f"deterministic(threads=...) must be a whole number of at least "
                                   f"1, got {short_repr(threads)}")
    done: dict[str, str] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    done["torch.set_num_threads"] = f"{threads} (was {before})"
    if "OMP_NUM_THREADS" in os.environ:
        done["OMP_NUM_THREADS"] = (f"not set: already {os.environ['OMP_NUM_THREADS']!r} in the "
                                   "environment (child processes inherit it)")
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        done["OMP_NUM_THREADS"] = f"{threads} (for child processes)"
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    done["torch.use_deterministic_algorithms"] = f"True (warn_only={warn_only})"
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    done["torch.backends.cudnn.benchmark"] = "False"
    done["torch.backends.cudnn.deterministic"] = "True"
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current is not None:
        done["CUBLAS_WORKSPACE_CONFIG"] = (f"{current} (already set)" if current in
                                           (CUBLAS_WORKSPACE, ":16:8") else
                                           f"not set: already {current!r}, which torch does not "
                                           f"count as deterministic; start the process with "
                                           f"{CUBLAS_WORKSPACE}")
    elif torch.cuda.is_initialized():
        done["CUBLAS_WORKSPACE_CONFIG"] = ("not set: CUDA is already initialised; start the "
                                           "process with CUBLAS_WORKSPACE_CONFIG="
                                           f"{CUBLAS_WORKSPACE}")
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        done["CUBLAS_WORKSPACE_CONFIG"] = f"{CUBLAS_WORKSPACE} (read when cuBLAS starts)"
    log.info("deterministic(): %s", "; ".join(f"{k} {v}" for k, v in done.items()))
    return done
