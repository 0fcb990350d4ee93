"""Lightning: what a checkpoint costs the training process per save, by checkpoint IO plugin:
``AsyncCkptIO`` against Lightning's ``TorchCheckpointIO`` and ``AsyncCheckpointIO``, and against
a ``copy_`` of the same bytes (method: docs/integrations.md, Lightning, "Cost")."""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

import torch

from .floors import copy_s
from .harness import after_warmup, dir_bytes, interleaved, log, ratio_spread, spread
from .markdown import digits, fixed, section, spread_text, table

FULL = {"width": 2048, "layers": 4, "batch": 64, "every": 6, "saves": 4, "rounds": 4}
QUICK = {"width": 256, "layers": 2, "batch": 16, "every": 8, "saves": 3, "rounds": 2}
SYSTEMS = ("AsyncCkptIO", "TorchCheckpointIO", "AsyncCheckpointIO")
PEERS = SYSTEMS[1:]


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

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            width = config["width"]
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                             for _ in range(config["layers"])])

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
    torch.manual_seed(0)
    model = MLP()
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", num_sanity_val_steps=0)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's hints about workers and logging intervals
        trainer.fit(model, train_dataloaders=loader)
    fit_s = time.perf_counter() - start  # teardown included: every plugin waited for its writes
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # + Adam
    # save_top_k=1: one .ckpt is left, the last save's, and one snapshot; where a removal
    # overtook a write still in flight the previous file is left too (seen once, in a full run
    # on a busy VM; which plugin is not known yet): said, and the newest measured
    ckpt, *older = sorted((directory / "ckpts").iterdir(), key=lambda p: -p.stat().st_mtime)
    if older:
        log(f"integrations_lightning: {system} left {[p.name for p in older]} beside "
            f"{ckpt.name} (save_top_k=1)")
    snapshots = [str(d) for d in (directory / "engine").glob("step-*")]
    return {"blocking_s": checkpoint.blocking, "fit_s": fit_s, "state_bytes": state_bytes,
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


def run(root: str, quick: bool) -> dict:
    config = QUICK if quick else FULL

    def fit(system: str, n: int) -> dict:
        directory = Path(root) / f"lightning-{system}-{n}"
        figures = {system: _fit(system, directory, config)}
        shutil.rmtree(directory, ignore_errors=True)
        return figures

    rounds = interleaved("integrations_lightning", SYSTEMS, config["rounds"], fit,
                         after=lambda: {"copy_floor_s": _copy_floor(config)},
                         shown=lambda r: "blocking per save " + ", ".join(
                             f"{s} {spread(r[s]['blocking_s'][1:])['median']:.3f} s"
                             for s in SYSTEMS))
    measured = after_warmup(rounds)  # the first round warms up the page cache and allocations
    steady = {s: [spread(r[s]["blocking_s"][1:])["median"] for r in measured] for s in SYSTEMS}
    floors = [r["copy_floor_s"] for r in measured]
    figures = {s: {"blocking_s": spread(steady[s]),
                   "blocking_x_floor": ratio_spread(steady[s], floors),
                   "first_save_s": spread([r[s]["blocking_s"][0] for r in measured]),
                   "file_after_s": spread([r[s]["file_after_s"] for r in measured]),
                   "bytes_x_state": spread([r[s]["bytes_per_save"] / r[s]["state_bytes"]
                                            for r in measured]),
                   "fit_s": spread([r[s]["fit_s"] for r in measured])} for s in SYSTEMS}
    figures["copy_floor_s"] = spread(floors)
    ratios = {peer: {"blocking": ratio_spread(steady["AsyncCkptIO"], steady[peer]),
                     "fit": ratio_spread([r["AsyncCkptIO"]["fit_s"] for r in measured],
                                         [r[peer]["fit_s"] for r in measured])}
              for peer in PEERS}
    return {"config": config, "state_bytes": rounds[0]["AsyncCkptIO"]["state_bytes"],
            "figures": figures, "ratios": ratios, "rounds": rounds}


def render(block: dict) -> str:
    f, r, config = block["figures"], block["ratios"], block["config"]
    three, times = digits(3), digits(2, "×")
    rows = []
    for system in SYSTEMS:
        s = f[system]
        rows.append([system, f"{spread_text(s['blocking_s'], three)} · "
                             f"{times(s['blocking_x_floor']['median'])}",
                     *(spread_text(s[key], three) for key in ("first_save_s", "fit_s",
                                                              "file_after_s")),
                     spread_text(s["bytes_x_state"], fixed(2, unit="×"))])
    return section(
        "Lightning: blocking time per save, by checkpoint IO plugin",
        f"An MLP of {config['layers']} × {config['width']}² + Adam: "
        f"{block['state_bytes'] / 1e6:.0f} MB of state; `ModelCheckpoint(every_n_train_steps="
        f"{config['every']}, save_top_k=1)`, {config['saves']} saves per run. Blocking: the "
        "median of a run's saves after its first (Lightning's dump_checkpoint, the plugin's save, "
        "the removal of the previous checkpoint); medians (min–max) of "
        f"{f['AsyncCkptIO']['blocking_s']['n']} interleaved rounds after a warm-up; ratios "
        "round by round. Floor: one `copy_` of the state into preallocated memory, "
        f"{spread_text(f['copy_floor_s'], three)} s.",
        table(["plugin", "blocking per save s · ×floor", "first save s", "fit s",
               ".ckpt written after the save s", "bytes written per save ÷ state"], rows),
        table(["AsyncCkptIO against", "blocking per save", "fit time"],
              [[peer, spread_text(r[peer]["blocking"], times), spread_text(r[peer]["fit"], times)]
               for peer in PEERS]))
