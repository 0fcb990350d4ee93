"""DeepSpeed ZeRO stages 1, 2 and 3 saving through async_ckpt, under torchrun (CPU, gloo).

One DeepSpeed engine per stage (a small MLP with dropout, Adam), trained side by side, each with
a global RNG of its own (swapped in around its steps and saves, so each draws as if alone).

``--phase kill``: trains ``TOTAL`` steps, with ``save_checkpoint`` after steps ``EVERY``,
2 * ``EVERY``, ... up to ``SAVED``; before the last of them rank 1 stops its writers (SIGSTOP), so
that save can never be committed. Rank 0 writes every rank's losses and final fp32 parameters and
Adam moments as JSON (the uninterrupted run) and waits until its own part of that last save is
durable; then every rank SIGKILLs its writers and itself. ``--phase resume``: for each stage,
``load_checkpoint`` of what ``latest`` names, then trains on to ``TOTAL`` steps; compares what the
copied ``zero_to_fp32.py`` makes of that checkpoint with the engine's full fp32 parameters right
after the load, and the resumed run's losses and final state with the uninterrupted run's. Rank 0
writes the findings as JSON; then every rank ends without the interpreter's teardown (``leave``).
"""

import argparse
import glob
import json
import os
import runpy
import signal
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import deepspeed.runtime.compiler  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from async_ckpt.integrations.deepspeed import install  # noqa: E402

STAGES = (1, 2, 3)
EVERY, SAVED, TOTAL = 2, 6, 9  # saves after steps 2, 4, 6; the one after 6 is never committed
# The CPU accelerator compiles a shared-memory all-reduce at start-up (a minute); gloo suffices.
deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm": False}
# ZeRO imports DeepSpeed's Muon optimizer, whose kernels are wrapped in torch.compile at import
# (which imports torch's inductor: seconds per process); Adam is what is trained here.
deepspeed.runtime.compiler.compile = lambda: (lambda kernel: kernel)


def make(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(10, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    return engine


class OwnRNG:
    """The global torch RNG of one stage, swapped in while it trains or saves."""

    def __init__(self, stage):
        saved = torch.get_rng_state()
        torch.manual_seed(100 + stage)
        self.state = torch.get_rng_state()
        torch.set_rng_state(saved)

    def __enter__(self):
        self.outer = torch.get_rng_state()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc):
        self.state = torch.get_rng_state()
        torch.set_rng_state(self.outer)


def train_step(engine):
    """One step on the batch of (global step, rank); the loss, exactly."""
    batch = torch.Generator().manual_seed(1000 * engine.global_steps + dist.get_rank())
    x = torch.randn(4, 6, generator=batch)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item().hex()


def full_state(engine, moments=True):
    """Every parameter's fp32 master copy and (once the optimizer stepped: DeepSpeed maps them
    then) Adam moments, whole (a collective under ZeRO-3)."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = [safe_get_full_fp32_param(p).tolist()] + [
            safe_get_full_optimizer_state(p, key).tolist()
            for key in ("exp_avg", "exp_avg_sq") if moments]
    return out


def kill(root, out):
    rank = dist.get_rank()
    engines = {s: make(s) for s in STAGES}
    ours = {s: install(e, os.path.join(root, f"zero{s}", "async_ckpt")) for s, e in engines.items()}
    rngs = {s: OwnRNG(s) for s in STAGES}
    losses = {s: [] for s in STAGES}
    for step in range(1, TOTAL + 1):
        for s, engine in engines.items():
            with rngs[s]:
                losses[s].append(train_step(engine))
                if step == SAVED:
                    ours[s].wait()  # the save before is in place: "latest" names it
                    if rank == 1:
                        os.kill(ours[s].engine.stats()["writer_pid"], signal.SIGSTOP)
                if step % EVERY == 0 and step <= SAVED:
                    engine.save_checkpoint(os.path.join(root, f"zero{s}"))
    uninterrupted = {s: {"losses": losses[s], "state": full_state(engine)}
                     for s, engine in engines.items()}
    write_gathered(uninterrupted, out)
    if rank == 0:  # its part of the last save is durable: only rank 1's is missing
        for s in STAGES:
            pattern = os.path.join(root, f"zero{s}", "async_ckpt",
                                   f"step-{SAVED // EVERY - 1:020d}.*", "rank-00000.ackpt")
            deadline = time.monotonic() + 60
            while not glob.glob(pattern) and time.monotonic() < deadline:
                time.sleep(0.02)
    for s in STAGES:
        os.kill(ours[s].engine.stats()["writer_pid"], signal.SIGKILL)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(root, uninterrupted):
    found = {}
    for s in STAGES:
        save_dir = os.path.join(root, f"zero{s}")
        expected = uninterrupted[str(s)]
        engine = make(s)
        ours = install(engine, os.path.join(save_dir, "async_ckpt"))
        rng = OwnRNG(s)
        with rng:
            path, client = engine.load_checkpoint(save_dir)
        loaded = full_state(engine, moments=False)
        start = engine.global_steps
        with rng:
            resumed = [train_step(engine) for _ in range(start, TOTAL)]
        consolidated = None
        if dist.get_rank() == 0:  # the script DeepSpeed copied next to the checkpoints
            script = runpy.run_path(os.path.join(save_dir, "zero_to_fp32.py"))
            consolidated = {k: v.tolist() for k, v in
                            script["get_fp32_state_dict_from_zero_checkpoint"](save_dir).items()}
        found[s] = {"path": os.path.relpath(path, save_dir), "start": start,
                    "losses_equal": resumed == expected["losses"][start:], "resumed": resumed,
                    "expected": expected["losses"][start:],
                    "state_equal": full_state(engine) == expected["state"],
                    "zero_to_fp32_equal": consolidated == {k: v[0] for k, v in loaded.items()}
                    if consolidated is not None else None}
        ours.close()
    return found


def write_gathered(found, out):
    """Every rank's ``found``, as a JSON list in rank order, written by rank 0."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)


def leave():
    """End this rank now, skipping the interpreter's teardown. A gloo worker thread that drops a
    finished collective's tensors once teardown has begun needs the GIL, and Python ends such a
    thread by unwinding it through C++ that may not throw: std::terminate, SIGABRT
    (pytorch/pytorch#190489). ``destroy_process_group`` would join those threads first, but
    DeepSpeed keeps its process groups alive past it (``torch.distributed.nn``, imported once
    the group exists, keeps the default group in its defaults; a ZeRO-3 engine is never freed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("kill", "resume"), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", help="where the resume phase writes its findings")
    args = parser.parse_args()
    torch.set_num_threads(1)  # losses compared bit for bit across processes (docs/data.md)
    deepspeed.init_distributed(dist_backend="gloo")
    uninterrupted = os.path.join(args.root, "uninterrupted.json")
    if args.phase == "kill":
        kill(args.root, uninterrupted)
        sys.exit("not killed")
    with open(uninterrupted) as f:
        write_gathered(resume(args.root, json.load(f)[dist.get_rank()]), args.out)
    leave()


if __name__ == "__main__":
    main()
