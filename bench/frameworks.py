"""The framework parts: each adapter's save against the framework's own, both driven as the
framework drives them, in interleaved rounds (the first a warm-up: it allocates what later rounds
reuse); the multi-rank ones under torchrun, the slower rank's figures (method:
docs/integrations.md, each framework's "Cost"). One ``Framework`` describes each part."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import itertools
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .floors import copy_s
from .harness import (after_warmup, dir_bytes, finish, fsync_tree, interleaved, log, one_round,
                      ratio_spread, slowest, slowest_timed, spread, summarised, timed, torchrun,
                      total)
from .markdown import digits, fixed, ms, ratio, section, spread_text, table

MLP = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters: 201 MB with Adam
MLP_QUICK = {"width": 512, "layers": 4, "rounds": 2}
KINDS = ("blocking", "durable")  # a multi-rank save's figures; "restore", its restore's
TIMES = fixed(2, unit="×")


def _mlp(width: int, layers: int) -> torch.nn.Sequential:
    """The benchmark's model, seeded alike in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _nbytes(tensors) -> int:
    """Bytes of ``tensors``; of a sharded one, this rank's shard."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _moments(optimizer) -> list:
    """The optimizer's state tensors, its step counters left out."""
    return [v for s in optimizer.state.values() for v in s.values()
            if torch.is_tensor(v) and v.dim()]


def _caption(fw: Framework, block: dict) -> str:
    """``fw.caption`` with the block's ``mb`` of state, ``ranks`` and how its figures were taken
    (``rounds``: every figure has the same)."""
    n = next(iter(block["figures"].values()))["n"]
    return fw.caption.format(mb=block["state_bytes"] / 1e6, ranks=block.get("ranks"),
                             rounds=f"median of {n} interleaved rounds after a warm-up (min–max)")


def _row(label: str, figures: dict, keys: tuple, spread_ratio: Optional[dict] = None,
         notes: tuple = ("", "")) -> list[str]:
    """``label``, each side's seconds (``keys`` of ``figures``) in ms with its note, the ratio."""
    return [label, *(ms(figures[key]) + note for key, note in zip(keys, notes)),
            ratio(spread_ratio, 3) if spread_ratio else ""]


def _compared(fw: Framework, block: dict) -> list[str]:
    """The caption and a row per ``fw.rows`` entry, ``(label, kind, our note, their note)``: both
    sides' figure of that kind and their ratio (a pair's restores: an entry of their own)."""
    rows = []
    for label, kind, *notes in fw.rows:
        entry = block.get(kind, block)
        rows.append(_row(label, entry["figures"], tuple(fw.figure.format(side=side, kind=kind)
                                                         for side in fw.sides),
                         entry["ratios"][kind], notes))
    return [_caption(fw, block), table(fw.header, rows)]


@dataclass(frozen=True)
class Framework:
    """A part: ``key`` (results.json's block, ``--part``'s name), ``sides`` (what is compared, in
    the rounds' order), ``measure(fw, root, config)`` (the block), ``worker(fw, args)`` (a torchrun
    rank's findings), ``configs`` (full and ``--quick``); its section: ``title`` and
    ``body(fw, block)`` (by default ``_compared``: ``caption``, ``header`` and ``rows``, each
    side's figure of a kind named by ``figure``)."""

    key: str
    title: str
    sides: tuple[str, ...]
    measure: Callable[..., dict]
    body: Callable[..., list] = _compared
    caption: str = ""
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    figure: str = "{side}_{kind}_s"
    worker: Optional[Callable[..., dict]] = None
    resharded: bool = True  # its restores on 4 ranks of what 2 saved
    configs: tuple[dict, dict] = (MLP, MLP_QUICK)

    def run(self, root: str, quick: bool) -> dict:
        return self.measure(self, root, self.configs[quick])

    def render(self, block: dict) -> str:
        return section(self.title, *self.body(self, block))


def worker(args: argparse.Namespace) -> None:
    """A rank of ``args.framework``'s torchrun (``harness.command``): its findings to rank 0's
    ``args.out``."""
    fw = BY_KEY[args.framework]
    finish(args.out, fw.worker(fw, args))


# --- in-process parts: the rounds' saves in this process --------------------------------------

def _per_save(fw: Framework, config: dict, state_bytes: int, rounds: list, keys: list,
              ratios: dict) -> dict:
    """The block of in-process ``rounds``: ``keys``' figures, ``ratios``, and each side's bytes
    written per save (``{side}_bytes``) ÷ the state's."""
    for r in rounds:
        r.update({f"{s}_bytes_x_state": r[f"{s}_bytes"] / state_bytes for s in fw.sides})
    return {"config": config, "state_bytes": state_bytes, "rounds": rounds, **summarised(
        rounds, [*keys, *(f"{s}_bytes_x_state" for s in fw.sides)], ratios)}


def _fit(system: str, directory: Path, config: dict) -> dict:
    """One Lightning run of ``config["saves"]`` saves through ``system``'s plugin."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from async_ckpt.integrations.lightning import AsyncCkptIO

    every = config["every"]

    class TimedCheckpoint(ModelCheckpoint):
        """ModelCheckpoint whose hook is timed at the steps it saves."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocking, self.saved_at = [], []

        def on_train_batch_end(self, trainer, *args):
            start, saved_at = time.perf_counter(), time.time()
            super().on_train_batch_end(trainer, *args)
            if trainer.global_step % every == 0:
                self.blocking.append(time.perf_counter() - start)
                self.saved_at.append(saved_at)

    class MLPModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(config["width"], config["layers"])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    steps = every * config["saves"]
    data = torch.utils.data.TensorDataset(torch.randn(steps * config["batch"], config["width"]))
    loader = torch.utils.data.DataLoader(data, batch_size=config["batch"])
    checkpoint = TimedCheckpoint(dirpath=directory / "ckpts", every_n_train_steps=every,
                                 save_top_k=1)
    callbacks = [checkpoint]
    if system == "AsyncCkptIO":
        plugin = AsyncCkptIO(directory / "engine")
        callbacks.append(plugin.callback)
    else:
        plugin = TorchCheckpointIO() if system == "TorchCheckpointIO" else AsyncCheckpointIO()
    model = MLPModule()
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", num_sanity_val_steps=0)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's hints about workers and logging intervals
        trainer.fit(model, train_dataloaders=loader)
    fit_s = time.perf_counter() - start  # teardown included: every plugin waited for its writes
    # save_top_k=1: one .ckpt is left, the last save's, and one snapshot; where a removal
    # overtook a write still in flight the previous file is left too (seen once, in a full run
    # on a busy VM; which plugin is not known yet): said, and the newest measured
    ckpt, *older = sorted((directory / "ckpts").iterdir(), key=lambda p: -p.stat().st_mtime)
    if older:
        log(f"integrations_lightning: {system} left {[p.name for p in older]} beside "
            f"{ckpt.name} (save_top_k=1)")
    snapshots = [str(d) for d in (directory / "engine").glob("step-*")]
    return {"blocking_s": checkpoint.blocking, "fit_s": fit_s,
            "state_bytes": 3 * _nbytes(model.parameters()),  # and Adam's two moments
            "file_after_s": ckpt.stat().st_mtime - checkpoint.saved_at[-1],
            "bytes_per_save": dir_bytes(str(ckpt), *snapshots)}


def _copy_floor(config: dict) -> float:
    """One warm ``copy_`` of the state's bytes (weights, biases, two Adam moments) into
    preallocated memory: what no plugin can beat without copying less."""
    width, layers = config["width"], config["layers"]
    state = [torch.randn(width, width) for _ in range(3 * layers)]
    state += [torch.randn(width) for _ in range(3 * layers)]
    staging = [torch.empty_like(t) for t in state]
    return [copy_s(state, staging) for _ in range(2)][1]  # the first touches the pages


def _lightning(fw: Framework, root: str, config: dict) -> dict:
    """A Lightning run per plugin and round, then the copy floor; a plugin's blocking figure is
    the median of a run's saves after its first."""
    def fit(system: str, n: int) -> dict:
        directory = Path(root) / f"lightning-{system}-{n}"
        figures = {system: _fit(system, directory, config)}
        shutil.rmtree(directory, ignore_errors=True)
        return figures

    rounds = interleaved(fw.key, fw.sides, config["rounds"], fit,
                         after=lambda: {"copy_floor_s": _copy_floor(config)},
                         shown=lambda r: "blocking per save " + ", ".join(
                             f"{s} {spread(r[s]['blocking_s'][1:])['median']:.3f} s"
                             for s in fw.sides))
    measured = after_warmup(rounds)  # the first round warms up the page cache and allocations
    steady = {s: [spread(r[s]["blocking_s"][1:])["median"] for r in measured] for s in fw.sides}
    floors = [r["copy_floor_s"] for r in measured]
    figures = {s: {"blocking_s": spread(steady[s]),
                   "blocking_x_floor": ratio_spread(steady[s], floors),
                   "first_save_s": spread([r[s]["blocking_s"][0] for r in measured]),
                   "file_after_s": spread([r[s]["file_after_s"] for r in measured]),
                   "bytes_x_state": spread([r[s]["bytes_per_save"] / r[s]["state_bytes"]
                                            for r in measured]),
                   "fit_s": spread([r[s]["fit_s"] for r in measured])} for s in fw.sides}
    figures["copy_floor_s"] = spread(floors)
    ours = fw.sides[0]
    ratios = {peer: {"blocking": ratio_spread(steady[ours], steady[peer]),
                     "fit": ratio_spread([r[ours]["fit_s"] for r in measured],
                                         [r[peer]["fit_s"] for r in measured])}
              for peer in fw.sides[1:]}
    return {"config": config, "state_bytes": rounds[0][ours]["state_bytes"],
            "figures": figures, "ratios": ratios, "rounds": rounds}


def _lightning_body(fw: Framework, block: dict) -> list[str]:
    f, r, config = block["figures"], block["ratios"], block["config"]
    three, times = digits(3), digits(2, "×")
    rows = [[system, f"{spread_text(f[system]['blocking_s'], three)} · "
                     f"{times(f[system]['blocking_x_floor']['median'])}",
             *(spread_text(f[system][key], three) for key in ("first_save_s", "fit_s",
                                                               "file_after_s")),
             spread_text(f[system]["bytes_x_state"], TIMES)] for system in fw.sides]
    return [
        f"An MLP of {config['layers']} × {config['width']}² + Adam: "
        f"{block['state_bytes'] / 1e6:.0f} MB of state; `ModelCheckpoint(every_n_train_steps="
        f"{config['every']}, save_top_k=1)`, {config['saves']} saves per run. Blocking: the "
        "median of a run's saves after its first (Lightning's dump_checkpoint, the plugin's save, "
        "the removal of the previous checkpoint); medians (min–max) of "
        f"{f[fw.sides[0]]['blocking_s']['n']} interleaved rounds after a warm-up; ratios "
        "round by round. Floor: one `copy_` of the state into preallocated memory, "
        f"{spread_text(f['copy_floor_s'], three)} s.",
        table(["plugin", "blocking per save s · ×floor", "first save s", "fit s",
               ".ckpt written after the save s", "bytes written per save ÷ state"], rows),
        table([f"{fw.sides[0]} against", "blocking per save", "fit time"],
              [[peer, spread_text(r[peer]["blocking"], times), spread_text(r[peer]["fit"], times)]
               for peer in fw.sides[1:]])]


VARIANTS = {  # name: (label, engine options); None: the stock Trainer
    "stock": ("`Trainer._save_checkpoint` (stock, page cache, no fsync)", None),
    "async": ("`AsyncCkptTrainer._save_checkpoint`", {}),
    "lazy": ("`AsyncCkptTrainer`, `staging=\"lazy\"`", {"staging": "lazy"}),
}


def _trained(output_dir: str, engine_options, model_config: dict):
    """A trainer of the benchmark model after one training step (the optimizer has its state)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer,
                              TrainingArguments)

    from async_ckpt.integrations.transformers import AsyncCkptTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0,
                                       **model_config))
    tokens = torch.randint(0, model_config["vocab_size"], (4, 32))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2,
                             save_strategy="no", save_total_limit=2, report_to="none",
                             disable_tqdm=True, use_cpu=True)
    trainer = (Trainer(model=model, args=args, train_dataset=data) if engine_options is None
               else AsyncCkptTrainer(model=model, args=args, train_dataset=data,
                                     async_ckpt_options=engine_options))
    trainer.remove_callback(PrinterCallback)  # stdout holds only the report
    trainer.train()
    return trainer


def _hf_save(name: str, trainer, step: int) -> dict:
    """One save at ``step``: seconds blocked, seconds until ``checkpoint-N`` is there, the bytes
    it wrote (``checkpoint-N`` and the adapter's snapshot, a file linked twice counted once),
    and for the adapter the seconds to its commit and what ``snapshot()`` alone took."""
    trainer.state.global_step = step
    started = time.time()
    blocked = timed(lambda: trainer._save_checkpoint(trainer.model, trial=None))
    engine = getattr(trainer, "checkpoint_engine", None)
    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    if engine is None:
        return {f"{name}_s": blocked, f"{name}_files_s": os.stat(checkpoint).st_mtime - started,
                f"{name}_bytes": dir_bytes(checkpoint)}
    committed = blocked + timed(engine.wait)
    figures = engine.stats()["snapshots"][-1]
    snapshot = max(glob.glob(os.path.join(engine.root, "step-*")))  # the newest: 20-digit steps
    return {f"{name}_s": blocked, f"{name}_commit_s": committed,
            f"{name}_snapshot_s": figures["blocking_s"], "state_bytes": figures["raw_bytes"],
            f"{name}_files_s": os.stat(checkpoint).st_mtime - started,
            f"{name}_bytes": dir_bytes(checkpoint, snapshot)}


def _transformers(fw: Framework, root: str, config: dict) -> dict:
    """A trainer per variant, one save of each per round; the ratios are to the stock save."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainers = {name: _trained(os.path.join(root, name), options, config["model"])
                    for name, (_, options) in VARIANTS.items()}
    try:
        rounds = interleaved(fw.key, fw.sides, config["rounds"],
                             lambda name, n: _hf_save(name, trainers[name], step=n + 2))
    finally:
        for trainer in trainers.values():
            if hasattr(trainer, "close_checkpoints"):
                trainer.close_checkpoints()
    return _per_save(fw, config, rounds[0]["state_bytes"], rounds,
                     [key for key in rounds[0] if key.endswith("_s")],
                     {name: (f"{name}_s", "stock_s") for name in fw.sides[1:]})


def _transformers_body(fw: Framework, block: dict) -> list[str]:
    f = block["figures"]
    rows = [[VARIANTS["stock"][0], ms(f["stock_s"]), "×1", "", "", ms(f["stock_files_s"]),
             spread_text(f["stock_bytes_x_state"], TIMES)]]
    rows += [[VARIANTS[name][0], ms(f[f"{name}_s"]), ratio(block["ratios"][name], 3),
              ms(f[f"{name}_snapshot_s"]), ms(f[f"{name}_commit_s"]), ms(f[f"{name}_files_s"]),
              spread_text(f[f"{name}_bytes_x_state"], TIMES)] for name in fw.sides[1:]]
    return [_caption(fw, block), table(fw.header, rows)]


def _accelerate(fw: Framework, root: str, config: dict) -> dict:
    """The adapter's ``snapshot()`` and ``Accelerator.save_state()`` of the same prepared model,
    AdamW, scheduler and stateful loader, a training step before each save."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    from async_ckpt.integrations import accelerate as accelerate_ckpt

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True))
        model = _mlp(config["width"], config["layers"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        loader = DataLoader(TensorDataset(torch.randn(64, config["width"])), batch_size=8,
                            shuffle=True)
        model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
        engine = accelerate_ckpt.engine(accelerator, os.path.join(root, "adapter"), model=model,
                                        optimizer=opt, scheduler=sched, dataloader=loader,
                                        state_dir=os.path.join(root, "adapter-state", "{step}"),
                                        keep_last=2, heartbeat_interval=None)
        batches = (batch for _ in itertools.count() for batch in loader)  # epoch after epoch
        steps = itertools.count(1)

        def train_step() -> None:
            (x,) = next(batches)
            accelerator.backward(model(x).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()

        def save(system: str, n: int) -> dict:
            train_step()
            step = next(steps)
            start = time.perf_counter()
            if system == "adapter":
                target = os.path.join(root, "adapter-state", str(step))
                engine.snapshot(step)
                figures = {"adapter_blocking_s": time.perf_counter() - start}
                engine.wait()
                figures["adapter_written_s"] = time.perf_counter() - start
                snapshot = max(glob.glob(os.path.join(engine.root, "step-*")))
                figures["adapter_bytes"] = dir_bytes(target, snapshot)  # a link counted once
            else:  # Accelerate's own (the engine's replaces the accelerator's)
                target = os.path.join(root, "save_state", f"step-{step}")
                Accelerator.save_state(accelerator, target)
                figures = {"save_state_s": time.perf_counter() - start,
                           "save_state_bytes": dir_bytes(target)}
            shutil.rmtree(target)
            return figures

        try:
            train_step()  # the optimizer's moments
            state_bytes = _nbytes([*model.parameters(), *(
                v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))])
            rounds = interleaved(fw.key, fw.sides, config["rounds"], save)
        finally:
            engine.close()
    return _per_save(fw, config, state_bytes, rounds,
                     ["adapter_blocking_s", "adapter_written_s", "save_state_s"],
                     {"blocking": ("adapter_blocking_s", "save_state_s")})


def _accelerate_body(fw: Framework, block: dict) -> list[str]:
    f = block["figures"]
    return [_caption(fw, block), table(fw.header, [
        _row("training process blocked", f, ("adapter_blocking_s", "save_state_s"),
             block["ratios"]["blocking"]),
        _row("directory written after the save", f, ("adapter_written_s", "save_state_s"),
             notes=(", durable (fsync, committed)", ", never fsynced")),
        ["bytes written per save ÷ state",
         *(spread_text(f[f"{side}_bytes_x_state"], TIMES) for side in fw.sides), ""]])]


# --- multi-rank parts: the rounds in torchrun workers, saving on 2 ranks -----------------------

def _torchrun(fw: Framework, world: int, directory: str, config: dict, phase: str) -> dict:
    """``fw``'s workers on ``world`` ranks, in ``phase`` (save or restore): rank 0's findings."""
    return torchrun(f"{fw.key}, {phase} on {world} ranks", "frameworks", world, directory, 0.0,
                    config["rounds"], "--framework", fw.key, "--phase", phase,
                    "--width", str(config["width"]), "--layers", str(config["layers"]))


def _saved_restored(fw: Framework, root: str, config: dict) -> tuple[dict, dict]:
    """The workers' findings saving on 2 ranks, and restoring on 4 (``fw.resharded``), else in
    the same rounds."""
    directory = os.path.join(root, fw.key)
    saved = _torchrun(fw, 2, directory, config, "save")
    return saved, _torchrun(fw, 4, directory, config, "restore") if fw.resharded else saved


def _summary(fw: Framework, rounds: list, kinds: tuple) -> dict:
    """Each side's figure of each of ``kinds``, and ours's ratio to theirs, round by round."""
    def name(side: str, kind: str) -> str:
        return fw.figure.format(side=side, kind=kind)

    ours, theirs = fw.sides
    return summarised(rounds, [name(side, kind) for side in fw.sides for kind in kinds],
                      {kind: (name(ours, kind), name(theirs, kind)) for kind in kinds})


def _pair(fw: Framework, root: str, config: dict) -> dict:
    return pair_block(fw, config, *_saved_restored(fw, root, config))


def pair_block(fw: Framework, config: dict, saved: dict, restored: dict) -> dict:
    """The block of a pair's ``saved`` and ``restored`` worker rounds."""
    return {"config": config, "ranks": 2, "state_bytes": saved["state_bytes"],
            "rounds": saved["rounds"], **_summary(fw, saved["rounds"], KINDS),
            "restore": _summary(fw, restored["rounds"], ("restore",))}


def _deepspeed_engine(width: int, layers: int):
    """A ZeRO-2 DeepSpeed engine over the MLP."""
    import deepspeed

    model = _mlp(width, layers)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    return engine


def _deepspeed_worker(fw: Framework, args: argparse.Namespace) -> dict:
    """Saves and restores in the same rounds: DeepSpeed loads ZeRO state only at the
    data-parallel size it was saved at (no resharded restore)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    from async_ckpt.integrations.deepspeed import install

    # The CPU accelerator compiles a shared-memory all-reduce when it starts (a minute the first
    # time); the benchmark's collectives are few and small, gloo's suffice.
    deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__,
                                        "deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    engines = {side: _deepspeed_engine(args.width, args.layers) for side in fw.sides}
    ours = install(engines["adapter"], os.path.join(args.dir, "adapter", "async_ckpt"),
                   keep_last=2, heartbeat_interval=None)

    def step(engine) -> None:
        engine.backward(engine(torch.randn(8, args.width)).square().mean())
        engine.step()

    for engine in engines.values():
        step(engine)
    optimizer = engines["torch"].optimizer  # ZeRO's: this rank's fp32 partition and its moments
    partition = [*optimizer.single_partition_of_fp32_groups, *_moments(optimizer.optimizer)]
    state_bytes = int(_nbytes(engines["torch"].parameters()) + total(_nbytes(partition)))

    def save(side: str, n: int) -> dict:
        engine, save_dir, tag = engines[side], os.path.join(args.dir, side), f"round{n}"
        step(engine)
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=tag)
        blocking = slowest(time.perf_counter() - start)
        if side == "adapter":
            ours.wait()
        else:
            fsync_tree(os.path.join(save_dir, tag))
            fsync_tree(os.path.join(save_dir, "latest"))
        durable = slowest(time.perf_counter() - start)
        restore = slowest_timed(lambda: engine.load_checkpoint(save_dir, tag=tag))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(save_dir, tag))
        return {f"{side}_blocking_s": blocking, f"{side}_durable_s": durable,
                f"{side}_restore_s": restore}

    rounds = interleaved(fw.key, fw.sides, args.rounds, save)
    ours.close()
    return {"state_bytes": state_bytes, "rounds": rounds}


def _lightning_sharded_worker(fw: Framework, args: argparse.Namespace) -> dict:
    """``save`` phase: a round at each batch's end; ``restore``: the rounds before the first
    step, of each side's last checkpoint of the 2-rank run."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from async_ckpt.integrations.lightning_sharded import AsyncCkptModelParallelStrategy
    from async_ckpt.integrations.pointer import POINTER_NAME

    width, rounds = args.width, args.rounds
    found: dict = {"rounds": []}

    class ShardedMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(width, args.layers)

        def configure_model(self):
            if isinstance(self.net, FSDPModule):
                return
            for layer in self.net:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8 * (rounds + 1), width),
                                               batch_size=8)

    def restore(trainer, side: str, n: int) -> dict:
        """Load ``side``'s last checkpoint of the 2-rank run into this run's model and
        optimizer (laid out for its world size)."""
        path = os.path.join(args.dir, side, f"round{rounds - 1}")
        return {f"{side}_restore_s": slowest_timed(
            lambda: trainer.strategy.load_checkpoint(path) if side == "adapter"
            else ModelParallelStrategy.load_checkpoint(trainer.strategy, path))}

    def save(trainer, side: str, n: int) -> dict:
        path = os.path.join(args.dir, side, f"round{n}")
        dist.barrier()
        start = time.perf_counter()
        if side == "adapter":
            trainer.save_checkpoint(path)
            blocking = slowest(time.perf_counter() - start)
            while not os.path.exists(os.path.join(path, POINTER_NAME)):
                time.sleep(0.001)  # the marker, written once the snapshot is committed
        else:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            ModelParallelStrategy.save_checkpoint(trainer.strategy, checkpoint, path)
            blocking = slowest(time.perf_counter() - start)
            if trainer.is_global_zero:
                fsync_tree(os.path.join(path, "meta.pt"))
        return {f"{side}_blocking_s": blocking,
                f"{side}_durable_s": slowest(time.perf_counter() - start)}

    class RestoreBoth(Callback):
        """Before the first step, with the model sharded and the optimizer made: the rounds."""

        def on_train_start(self, trainer, pl_module):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the data position moves with the world size
                found["rounds"] = interleaved(f"{fw.key}: restore", fw.sides, rounds,
                                              lambda side, n: restore(trainer, side, n))
            trainer.should_stop = True

    class SaveBoth(Callback):
        """At each batch's end (after the optimizer step): a round, both saves in rotated order."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            n = trainer.global_step - 1  # the round: batch_idx starts again in each epoch
            if n >= rounds:
                return
            if n == 0:
                found["state_bytes"] = int(total(_nbytes(_moments(trainer.optimizers[0]))
                                                 + _nbytes(pl_module.parameters())))
            found["rounds"].append(one_round(fw.key, fw.sides, n, rounds,
                                             lambda side, n: save(trainer, side, n)))
            if trainer.is_global_zero and n < rounds - 1:  # the last is kept for its restore
                shutil.rmtree(os.path.join(args.dir, "stock", f"round{n}"))

    world = int(os.environ["WORLD_SIZE"])
    strategy = AsyncCkptModelParallelStrategy(os.path.join(args.dir, "engine"),
                                              data_parallel_size=world, tensor_parallel_size=1,
                                              process_group_backend="gloo")
    phase = RestoreBoth() if args.phase == "restore" else SaveBoth()
    trainer = L.Trainer(max_steps=rounds, accelerator="cpu", devices=world, strategy=strategy,
                        callbacks=[phase], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(ShardedMLP())
    return found


class _Job:
    """What torchtitan's trainer hands its checkpoint manager, for ``width`` x ``layers``."""

    def __init__(self, width: int, layers: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data import IterableDataset
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        class Batches(IterableDataset):
            def __iter__(self):
                while True:
                    yield torch.randn(8, width)

        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = _mlp(width, layers)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-4})],
            implementation="foreach").build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=1000)
        self.loader = ParallelAwareDataloader(Batches(), dp_rank=rank, dp_world_size=world,
                                              batch_size=None, generator=torch.Generator())
        self.batches = iter(self.loader)
        self.train_state = _TrainState()

    def step(self) -> None:
        self.model(next(self.batches)).square().mean().backward()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.step += 1

    def manager(self, ours: bool, folder: str, **options):
        from torchtitan.components.checkpoint import CheckpointManager

        from async_ckpt.integrations.torchtitan import AsyncCkptCheckpointManager

        cls = AsyncCkptCheckpointManager if ours else CheckpointManager
        config = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=2,
                            async_mode="async", last_save_model_only=False, **options)
        return config.build(dataloader=self.loader, model_parts=[self.model],
                            optimizers=self.optimizers, lr_schedulers=self.schedulers,
                            states={"train_state": self.train_state}, sd_adapter=None)

    def state_bytes(self) -> int:
        """The model's and the optimizer's tensors, all ranks' pieces."""
        return int(total(_nbytes([*self.model.parameters(), *(
            v for v in self.optimizers.state_dict().values() if isinstance(v, torch.Tensor))])))


class _TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _torchtitan_worker(fw: Framework, args: argparse.Namespace) -> dict:
    """Each side's manager on a folder of its own, driven as torchtitan's trainer drives it:
    ``save`` phase, a save after each step; ``restore``, a load of the last save."""
    dist.init_process_group("gloo")
    job = _Job(args.width, args.layers)
    job.step()  # the optimizer's moments exist
    saving = args.phase == "save"

    def save(manager, side: str) -> dict:
        job.step()
        dist.barrier()
        start = time.perf_counter()
        manager.save(job.train_state.step)
        blocking = slowest(time.perf_counter() - start)
        manager.maybe_wait_for_saving()
        durable = time.perf_counter() - start  # rank 0's is kept
        dist.barrier()
        return {f"blocking_{side}": blocking, f"durable_{side}": durable}

    def restore(manager, side: str) -> dict:
        return {f"restore_{side}": slowest_timed(manager.load)}

    options = {} if saving else {"exclude_from_loading": ["dataloader"], "load_only": True}
    managers = {side: job.manager(side == "ours", os.path.join(args.dir, side), **options)
                for side in fw.sides}
    try:
        rounds = interleaved(f"{fw.key}: {args.phase}", fw.sides, args.rounds,
                             lambda side, n: (save if saving else restore)(managers[side], side))
    finally:
        for manager in managers.values():
            manager.close()
    return {"rounds": rounds, **({"state_bytes": job.state_bytes()} if saving else {})}


def _torchtitan(fw: Framework, root: str, config: dict) -> dict:
    """Where torchtitan is installed (an environment of its own: see ``_torchtitan_body``)."""
    if importlib.util.find_spec("torchtitan") is None:
        log(f"{fw.key}: skipped, torchtitan is not installed")
        return {"skipped": "torchtitan is not installed"}
    saved, loaded = _saved_restored(fw, root, config)
    # one round's figures of both runs side by side: their warm-ups are both round 0
    rounds = [{**save, **load} for save, load in zip(saved["rounds"], loaded["rounds"])]
    return {"config": config, "state_bytes": saved["state_bytes"],
            **_summary(fw, rounds, (*KINDS, "restore")),
            "rounds": {"save": saved["rounds"], "restore": loaded["rounds"]}}


def _torchtitan_body(fw: Framework, block: dict) -> list[str]:
    if "skipped" in block:
        return [f"Not measured: {block['skipped']} (pip install 'async_ckpt[torchtitan]', in an "
                "environment without the transformers extra)."]
    return _compared(fw, block)


# --- the parts, in report order ------------------------------------------------------------------

BLOCKED = ("training blocked", "blocking", "", "")
LIGHTNING = Framework(
    "integrations_lightning", "Lightning: blocking time per save, by checkpoint IO plugin",
    ("AsyncCkptIO", "TorchCheckpointIO", "AsyncCheckpointIO"), _lightning, _lightning_body,
    configs=({"width": 2048, "layers": 4, "batch": 64, "every": 6, "saves": 4, "rounds": 4},
             {"width": 256, "layers": 2, "batch": 16, "every": 8, "saves": 3, "rounds": 2}))
LIGHTNING_SHARDED = Framework(
    "integrations_lightning_sharded", "Lightning ModelParallelStrategy: a sharded save's cost, "
    "the adapter against the stock strategy", ("adapter", "stock"), _pair,
    caption="FSDP2 on {ranks} ranks (CPU, gloo), {mb:.0f} MB of parameters and Adam moments in "
            "all; {rounds}; the slower rank's figure.",
    header=("per save", "`AsyncCkptModelParallelStrategy`", "`ModelParallelStrategy`", "ratio"),
    rows=(BLOCKED, ("durable (every shard fsynced)", "durable", "",
                    " (DCP's save, then an fsync of `meta.pt`)"),
          ("restore of the last 2-rank checkpoint on 4 ranks (resharded)", "restore", "",
           " (DCP's load)")),
    worker=_lightning_sharded_worker)
TRANSFORMERS = Framework(
    "integrations_transformers", "Hugging Face Trainer: a checkpoint save", tuple(VARIANTS),
    _transformers, _transformers_body,
    caption="GPT-2 from a config with AdamW, {mb:.0f} MB of state; {rounds}; the ratio is to the "
            "stock save, round by round.",
    header=("per save", "blocks training", "ratio", "of which `snapshot()`",
            "save → committed (fsynced)", "`checkpoint-N` there after", "bytes written ÷ state"),
    configs=({"model": {"n_embd": 512, "n_layer": 4, "n_head": 8, "vocab_size": 8192},
              "rounds": 4},
             {"model": {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512}, "rounds": 2}))
ACCELERATE = Framework(
    "integrations_accelerate", "Accelerate: a save's cost, the adapter against `save_state()`",
    ("adapter", "save_state"), _accelerate, _accelerate_body,
    caption="{mb:.0f} MB of model and AdamW state, a scheduler and a prepared stateful loader; "
            "{rounds}. The adapter's snapshot leaves the directory `save_state()` writes "
            "(`state_dir=`).",
    header=("per save", "adapter `snapshot()`", "`Accelerator.save_state()`", "ratio"))
DEEPSPEED = Framework(
    "integrations_deepspeed", "DeepSpeed: a save's cost, the adapter against DeepSpeed's torch "
    "engine", ("adapter", "torch"), _pair,
    caption="ZeRO stage 2 on {ranks} ranks (CPU, gloo), {mb:.0f} MB of fp32 parameters, ZeRO fp32 "
            "partitions and Adam moments in all; {rounds}; the slower rank's figure.",
    header=("per `save_checkpoint`", "adapter", "`TorchCheckpointEngine`", "ratio"),
    rows=(BLOCKED, ("durable (every file and `latest` fsynced)", "durable", "",
                    " (its save, then an fsync of its files)"),
          ("`load_checkpoint` of that save on the same 2 ranks", "restore", "",
           " (its files, from the page cache)")),
    worker=_deepspeed_worker, resharded=False)
TORCHTITAN = Framework(
    "integrations_torchtitan", "torchtitan: the checkpoint manager against torchtitan's own "
    "(`async` mode)", ("ours", "theirs"), _torchtitan, _torchtitan_body,
    caption="{mb:.0f} MB of FSDP2 model and AdamW state in torchtitan's containers, on CPU ranks "
            "(gloo); {rounds}; the ratio round by round.",
    header=("", "`AsyncCkptCheckpointManager`", "`torchtitan CheckpointManager`", "ratio"),
    rows=(("training process blocked per save (2 ranks)", "blocking", ", staged",
           ", staged by `dcp.async_save`"),
          ("save to durable (2 ranks)", "durable", ", committed", ", DCP metadata written"),
          ("restore of the 2-rank checkpoint on 4 ranks", "restore", ", resharded",
           ", `dcp.load`")),
    figure="{kind}_{side}", worker=_torchtitan_worker)
BY_KEY = {fw.key: fw for fw in (LIGHTNING, LIGHTNING_SHARDED, TRANSFORMERS, ACCELERATE, DEEPSPEED,
                                TORCHTITAN)}
