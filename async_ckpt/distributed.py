"""Agreement between the ranks' engines of one ``torch.distributed`` job.

The engines agree on a few things, always from the training thread and at points every rank
reaches together in program order: the set-up when they start, the step to restore, and (with
preemption handling) whether a preemption notice reached any rank. They use the job's default
process group, already connected by then; never from a background thread, so they cannot
interleave with training's own collectives. (A group of their own would be tidier, but torch 2.x
reuses the rendezvous store across torchrun restarts, and a new gloo group then often fails to
connect after a restart.) Snapshots themselves need no agreement: rank 0's writer commits through
the shared directory (``commit.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .errors import DistributedSetupError, InvalidArgumentError


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_ranks(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, or those of the initialised process group, or 0 and 1."""
    if rank is None and world_size is None:
        if _initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise InvalidArgumentError("pass both rank and world_size, or neither (then they come "
                                 "from torch.distributed)")
    return rank, world_size


class Coordinator:
    """The engines' agreements; with one rank every agreement is trivially local."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        if world_size == 1:
            return
        if not _initialized():
            raise DistributedSetupError(
                f"world_size={world_size} needs torch.distributed: call "
                "torch.distributed.init_process_group() (e.g. under torchrun) before creating the "
                "engine")
        if (torch.distributed.get_rank(), torch.distributed.get_world_size()) != (rank, world_size):
            raise DistributedSetupError(
                f"rank={rank}, world_size={world_size} do not match the process group (rank "
                f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}); leave "
                "them out to use the group's")

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out

    def from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` run on rank 0 only, its result (or its CheckpointError) on every rank."""
        outcome = [None]
        if self.rank == 0:
            try:
                outcome = [("ok", compute())]
            except Exception as e:  # every rank must learn of it, or the others wait forever
                outcome = [("error", e)]
        if self.world_size > 1:
            torch.distributed.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "error":
            raise value
        return value

    def raise_if_any(self, problem: Optional[str], error_type: type, what: str) -> None:
        """Raise ``error_type`` on every rank when any rank reports a problem."""
        if self.world_size == 1:
            if problem:
                raise error_type(problem)
            return
        problems = [f"rank {r}: {p}" for r, p in enumerate(self.gather(problem)) if p]
        if problems:
            raise error_type(f"{what}: " + "; ".join(problems))

    def max(self, value: int) -> int:
        """The largest ``value`` over all ranks (with NCCL, through the current GPU, which makes
        the call wait for the GPU's queued work)."""
        if self.world_size == 1:
            return value
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())


def newest_common_step(steps: list[int], group=None) -> Optional[int]:
    """For ranks that keep their snapshots in separate directories (one engine per rank with
    ``rank=0, world_size=1``, e.g. on node-local disks): the newest step that every rank has
    committed, to pass to ``restore(step=...)`` on every rank. ``steps`` is this rank's
    ``engine.committed_steps()``; "newest" follows rank 0's commit order. Call it on every rank,
    from the training thread; None when no step is common to all.
    """
    everyone = [steps]
    if _initialized():
        everyone = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(everyone, list(steps), group=group)
    common = set(everyone[0]).intersection(*map(set, everyone[1:]))
    return next((s for s in reversed(everyone[0]) if s in common), None)
