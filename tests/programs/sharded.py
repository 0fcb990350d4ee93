"""Sharded training state under torchrun (CPU, gloo): FSDP2, tensor parallel and FSDP x TP.

``--phase save`` (any world size): for each layout, trains a small MLP + AdamW a few steps,
snapshots it with async_ckpt twice (steps 2 and 3), saves the same state with DCP, and rank 0
writes the full (unsharded) state as the reference. ``--phase restore``: for each pair
``SAVED:LAYOUT``, restores the saved layout's newest async_ckpt snapshot into a model laid out as
LAYOUT on this world size, gathers the full state and compares it bit for bit with the
reference; then loads the DCP checkpoint SAVED/dcp into a second model of the same layout,
compares its full state with the reference too, and trains both on the same batches: the losses
must be identical. ``--memory big`` measures a restore's peak
memory, ``--damaged DIR`` restores a damaged copy. Rank 0 writes what every rank found as JSON.
"""

import argparse
import ctypes
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from async_ckpt import CheckpointEngine
from async_ckpt.errors import LayoutError

# The hidden size divides among 1-4 tensor-parallel ranks; 13 and 7 rows shard unevenly.
SIZES = (13, 12, 7)
BIG = (1024, 4096, 1000)  # 8.3M parameters: 100 MB of model + AdamW state in all


class AppState:
    """The pattern of the DCP tutorial: model and optimizer through get/set_state_dict."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def build(layout: str, world: int):
    torch.manual_seed(0)
    sizes = BIG if layout == "big" else SIZES
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.GELU(),
                                torch.nn.Linear(sizes[1], sizes[2]))
    if layout in ("fsdp", "big"):
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif layout == "2d":
        dp = 2 if world % 2 == 0 and world > 2 else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(layout)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def batch(step: int, sizes=SIZES):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, sizes[0], generator=g), torch.randn(8, sizes[2], generator=g)


def train_step(model, optimizer, step: int) -> float:
    x, y = batch(step, (model[0].in_features, None, model[2].out_features))
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def full_state(model, optimizer) -> dict:
    """The whole model and optimizer state, gathered by DCP's helpers (on rank 0; others: {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state.get("state", {})}


def save(args, rank: int, world: int) -> dict:
    for layout in args.layouts:
        model, optimizer = build(layout, world)
        root = os.path.join(args.root, layout)
        # 2d's shards go to disk with direct I/O: every restore of it checks that path too
        with CheckpointEngine(os.path.join(root, "ckpt"), {"app": AppState(model, optimizer)},
                              keep_last=3, direct_io=layout == "2d") as engine:
            for step in range(4):
                train_step(model, optimizer, step)
                if step >= 2:
                    engine.snapshot(step, force=True)
            engine.wait()
        if layout == "big":  # for the memory check only
            continue
        if layout == "fsdp":  # the memory tier refuses sharded modules when the engine is made
            try:
                CheckpointEngine(os.path.join(root, "memory"), {"app": AppState(model, optimizer)},
                                 memory_every=1, slots=3)
            except LayoutError as e:
                assert "is a sharded tensor: memory_every does not hold" in str(e), e
            else:
                raise AssertionError("an engine with memory_every took a sharded model")
            assert not os.path.exists(os.path.join(root, "memory"))
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=os.path.join(root, "dcp"))
        reference = full_state(model, optimizer)
        if rank == 0:
            torch.save(reference, os.path.join(root, "full.pt"))
    return {}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def restore(args, rank: int, world: int) -> dict:
    found = {}
    for pair in args.pairs:
        saved, layout = pair.split(":")
        root = os.path.join(args.root, saved)
        model, optimizer = build(layout, world)
        with CheckpointEngine(os.path.join(root, "ckpt"), {"app": AppState(model, optimizer)},
                              keep_last=3) as engine:
            restored = engine.restore()
        gathered = full_state(model, optimizer)  # a collective: every rank takes part
        exact = rank != 0 or same(gathered, torch.load(os.path.join(root, "full.pt"),
                                                       weights_only=True))
        twin, twin_optimizer = build(layout, world)
        dcp.load({"app": AppState(twin, twin_optimizer)}, checkpoint_id=os.path.join(root, "dcp"))
        gathered = full_state(twin, twin_optimizer)
        dcp_exact = rank != 0 or same(gathered, torch.load(os.path.join(root, "full.pt"),
                                                           weights_only=True))
        ours = [train_step(model, optimizer, step) for step in range(4, 8)]
        theirs = [train_step(twin, twin_optimizer, step) for step in range(4, 8)]
        found[pair] = {"restored": restored, "exact": exact, "dcp_exact": dcp_exact,
                       "losses": ours, "same_losses_as_dcp": ours == theirs}
    if args.memory:
        found["memory"] = restore_memory(os.path.join(args.root, args.memory, "ckpt"), world)
    if args.damaged:
        model, optimizer = build("fsdp", world)
        with CheckpointEngine(args.damaged, {"app": AppState(model, optimizer)}) as engine:
            found["damaged"] = {"restored": engine.restore()}
    return found


def restore_memory(ckpt: str, world: int) -> dict:
    """How far this rank's resident memory rises above its baseline (model and initialised
    optimizer state, engine started) while restoring: the kernel's peak (VmHWM), reset first."""
    model, optimizer = build("big", world)
    app = AppState(model, optimizer)
    own = sum(local.numel() * local.element_size() for part in app.state_dict().values()
              for local in (getattr(t, "to_local", lambda t=t: t)() for t in _tensors(part)))
    with CheckpointEngine(ckpt, {"app": app}) as engine:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory would hide what restore takes
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set size starts again from the current one
        baseline = _status_kb("VmRSS")
        engine.restore()
        peak = _status_kb("VmHWM")
    return {"own_bytes": own, "peak_growth": (peak - baseline) * 1024}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("save", "restore"), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--layouts", nargs="*", default=())
    parser.add_argument("--pairs", nargs="*", default=())
    parser.add_argument("--memory", help="a layout whose snapshot to restore measuring memory")
    parser.add_argument("--damaged", help="a checkpoint directory to restore into 'fsdp'")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: our losses, DCP's and the saved state agree bit for bit
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    found = (save if args.phase == "save" else restore)(args, rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, found)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    # FSDP and DTensor objects sit in reference cycles that hold the group: collect them while
    # Python is alive, or the group's threads are torn down at exit, which aborts the process
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
