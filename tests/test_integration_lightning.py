"""The Lightning adapter (async_ckpt.integrations.lightning), with the real framework on CPU.

Resume through Lightning's own entry point: a run killed with SIGKILL in the middle of an epoch
and resumed with ``trainer.fit(ckpt_path="last")``, or from a given ``.ckpt`` path, logs the same
loss at every step as an uninterrupted run, bit for bit (dropout and in-process augmentation
draw from the global RNG); resumed from a save at an epoch's last batch, it counts epochs as
Lightning's own resume does. ``save_top_k`` deletions drop exactly the snapshots no pointer
names, never before a save in flight is written; a damaged snapshot fails a given path with a
typed error and makes ``last`` fall back; a killed save leaves no pointer. Lightning's contracts
of names, time and lifetime hold with every save in flight: versioned names and ``last`` links
come out as with the stock IO, a load waits for the save, a save outside a stage is there when
it returns, and nothing (engine, lock, thread) outlives a Trainer, ``ddp_spawn`` included.
"""

import copy
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import (FSDPStrategy, ModelParallelStrategy,  # noqa: E402
                                          SingleDeviceStrategy)
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from async_ckpt import Marker, load  # noqa: E402
from async_ckpt.errors import (CorruptSnapshotError, EncodingError,  # noqa: E402
                               IntegrationError, NoSnapshotError, PointerFileError,
                               UnsupportedOptionError, WriterDiedError)
from async_ckpt.storage.names import replacement_name  # noqa: E402
from async_ckpt.integrations.lightning import AsyncCkptIO, read_pointer  # noqa: E402
from conftest import assert_same  # noqa: E402
from test_resume import read_log, run_killed  # noqa: E402

pytestmark = pytest.mark.usefixtures("restored_environment")  # Lightning's fit writes os.environ

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "lightning_fit.py")
STEPS, EVERY = 30, 4  # as programs/lightning_fit.py trains, 12 batches per epoch
KILLED = 20  # the global step in whose saves the run of the first test is killed: mid-epoch 1


def fit(root, log, *extra, kill_after_step=None):
    return run_killed([PROGRAM, "--root", str(root), "--log", str(log), "--steps", str(STEPS),
                       "--every", str(EVERY), *extra], kill_after_step, str(log))


def last_state(root):
    """The checkpoint dict ``last.ckpt`` of a run stands for, read through the adapter."""
    io = AsyncCkptIO(root / "engine")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no Trainer here: the callback is not attached
            return io.load_checkpoint(root / "ckpts" / "last.ckpt")
    finally:
        io.teardown()


def assert_same_training_state(a, b):
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch",
                "global_step", "hyper_parameters"):
        assert_same(a[key], b[key], key)


def assert_matches(records, reference):
    assert {r["step"] for r in records} == set(range(1, STEPS + 1))
    for r in records:
        assert r == reference[r["step"]], f"step {r['step']} differs after a resume"


def resumed_at(records):
    """The first step each restarted run logged (the log goes back when a run resumes)."""
    return [b["step"] for a, b in zip(records, records[1:]) if b["step"] <= a["step"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    assert fit(root, root / "loss.jsonl") == 0
    records = read_log(root / "loss.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return root, {r["step"]: r for r in records}


# --- resume through Lightning, in real processes ----------------------------------------------

@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_from_last_bit_identical(tmp_path, reference):
    """Killed (SIGKILL, its writer too) between the two saves of global step 20, in the middle
    of epoch 1: its top-k file is there, ``last.ckpt`` still names the save of step 16 (as with
    Lightning's stock IO, which saves them in that order); ``ckpt_path="last"`` resumes from
    step 16, replaces the killed run's top-k file, and ends in the uninterrupted run's state.

    Deterministic: the run kills itself once its saves are committed, so the resume point is
    known. A kill from outside at a random step resumes from whichever ``last.ckpt`` the writer
    had committed by then, which depends on the machine's load, and sometimes is a save at an
    epoch's last batch (global step 12 or 24): Lightning's own resume counts that epoch twice
    (see test_a_resume_from_an_epoch_s_last_batch_counts_epochs_as_lightning_s_own_does), so the
    loop counters at the end differ from an uninterrupted run's, whatever the CheckpointIO."""
    ref_root, ref_records = reference
    log, ckpts = tmp_path / "loss.jsonl", tmp_path / "ckpts"
    assert fit(tmp_path, log, "--kill-before-last", str(KILLED)) == -signal.SIGKILL
    assert read_pointer(str(ckpts / "last.ckpt")).global_step == KILLED - EVERY
    assert read_pointer(str(ckpts / f"epoch=1-step={KILLED}.ckpt")).global_step == KILLED
    assert fit(tmp_path, log, "--resume", "last") == 0
    records = read_log(log)
    assert_matches(records, ref_records)
    assert resumed_at(records) == [KILLED - EVERY + 1]
    assert_same_training_state(last_state(tmp_path), last_state(ref_root))
    named = {read_pointer(str(p)).step for p in ckpts.iterdir()}
    io = AsyncCkptIO(tmp_path / "engine")
    assert sorted(io._open().committed_steps()) == sorted(named)  # the replaced one was dropped
    io.teardown()


@pytest.mark.slow
def test_a_killed_save_leaves_no_pointer_and_a_given_path_resumes_exactly(tmp_path, reference):
    _, ref_records = reference
    stopped = 16  # the writer is stopped just before the saves of this step, the run killed after
    killed = tmp_path / "killed"
    assert fit(killed, tmp_path / "killed.jsonl", "--stop-writer-at", str(stopped),
               kill_after_step=stopped + 1) == -signal.SIGKILL
    pointers = {p.name: read_pointer(str(p)) for p in (killed / "ckpts").iterdir()}
    assert "last.ckpt" in pointers and not [n for n in pointers if f"step={stopped}" in n]
    assert all(p.global_step < stopped for p in pointers.values())
    for pointer in pointers.values():  # every pointer there stands for a committed snapshot
        assert load(killed / "engine", pointer.step)[1]["global_step"] == pointer.global_step

    root = tmp_path / "moved"
    shutil.copytree(killed, root)  # pointers name their directory relatively: a copy works
    given = min((p for p in (root / "ckpts").iterdir() if p.name != "last.ckpt"),
                key=lambda p: read_pointer(str(p)).global_step)
    log = tmp_path / "loss.jsonl"
    assert fit(root, log, "--resume", str(given)) == 0
    records = read_log(log)
    assert records[0]["step"] == read_pointer(str(given)).global_step + 1
    assert records[-1]["step"] == STEPS
    for r in records:
        assert r == ref_records[r["step"]], f"step {r['step']} differs after resuming {given}"


# --- in this process: what is saved, retention, damage ----------------------------------------

class TinyModel(L.LightningModule):
    def __init__(self, hidden: int = 8, dims: tuple = (1, 2), extra=None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=50)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g),
                                              torch.randn(40, 1, generator=g))
        return StatefulDataLoader(data, batch_size=4, shuffle=True)


class SavedDicts(AsyncCkptIO):
    """Keeps a deep copy of every dict Lightning hands over, by path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved[os.path.abspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def train(root, io, steps=16, precision=None, callback=True, model=None, ckpt_path=None,
          **checkpoint_args):
    L.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpts", **{
        "monitor": "loss", "save_top_k": 2, "every_n_train_steps": 2, "save_last": True,
        **checkpoint_args})
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu",
                        plugins=[io] + ([precision] if precision else []),
                        callbacks=([io.callback] if callback and hasattr(io, "callback") else [])
                        + [checkpoint])
    trainer.fit(model or TinyModel(), ckpt_path=ckpt_path)
    return checkpoint


def test_every_entry_of_lightning_s_checkpoint_round_trips(tmp_path):
    io = SavedDicts(tmp_path / "engine")
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    train(tmp_path, io, precision=scaler)
    assert io._engine is None  # torn down with the Trainer
    for path, saved in io.saved.items():
        if os.path.exists(path):
            loaded = io.load_checkpoint(path)
            assert_same(loaded, saved)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "epoch",
            "hyper_parameters", "hparams_name", "global_step", "pytorch-lightning_version",
            "MixedPrecision"} <= set(loaded)
    io.export(path, tmp_path / "exported.ckpt")  # a copy through torch.save
    model = TinyModel.load_from_checkpoint(tmp_path / "exported.ckpt")
    assert_same(dict(model.state_dict()), dict(loaded["state_dict"]))
    io.teardown()


def test_the_ckpt_is_a_torch_file_that_lightning_and_torch_read_without_async_ckpt(tmp_path):
    """What users do with a .ckpt outside the Trainer's CheckpointIO: load_from_checkpoint,
    torch.load(weights_only=True), also mapped, in a process that never imports async_ckpt,
    bit for bit what the adapter itself loads."""
    io = AsyncCkptIO(tmp_path / "engine")
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    train(tmp_path, io, precision=scaler)
    paths = sorted(str(p) for p in (tmp_path / "ckpts").iterdir())
    assert len(paths) == 3
    reader = textwrap.dedent("""
        import sys, torch
        import lightning as L

        class TinyModel(L.LightningModule):  # the test's model, without the test's imports
            def __init__(self, hidden: int = 8, dims: tuple = (1, 2), extra=None):
                super().__init__()
                self.save_hyperparameters()
                self.net = torch.nn.Sequential(
                    torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden),
                    torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))

        out = {}
        for path in sys.argv[2:]:
            plain = torch.load(path, weights_only=True)
            mapped = torch.load(path, weights_only=True, mmap=True)
            model = TinyModel.load_from_checkpoint(path)
            out[path] = (plain, {k: v.clone() for k, v in mapped["state_dict"].items()},
                         model.state_dict())
        assert not [m for m in sys.modules if m.startswith("async_ckpt")]
        torch.save(out, sys.argv[1])
    """)
    result = tmp_path / "read.pt"
    subprocess.run([sys.executable, "-c", reader, str(result), *paths], check=True,
                   cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    read = torch.load(result, weights_only=True)
    for path in paths:
        plain, mapped, model_state = read[path]
        loaded = io.load_checkpoint(path)
        assert set(plain) == set(loaded)
        assert_same(plain, loaded)
        assert_same(mapped, dict(loaded["state_dict"]))
        assert_same(dict(model_state), dict(loaded["state_dict"]))
    io.teardown()


def test_save_top_k_keeps_the_files_the_stock_io_keeps_and_drops_the_other_snapshots(tmp_path):
    io = AsyncCkptIO(tmp_path / "async" / "engine")
    kept = train(tmp_path / "async", io)
    stock = train(tmp_path / "stock", TorchCheckpointIO())
    files = sorted(os.listdir(tmp_path / "async" / "ckpts"))
    assert files == sorted(os.listdir(tmp_path / "stock" / "ckpts"))
    assert len(files) == 3
    assert sorted(map(os.path.basename, kept.best_k_models)) == sorted(
        map(os.path.basename, stock.best_k_models))
    named = {read_pointer(str(tmp_path / "async" / "ckpts" / f)).step for f in files}
    engine = io._open()
    assert sorted(engine.committed_steps()) == sorted(named)  # nothing else is kept
    io.teardown()


def progress(checkpoint):
    """Where a checkpoint says training stands: every counter of the loops, the epoch and the
    global step; not the data loader's position (its shuffling generator draws from the global
    RNG, which only the adapter sets back on resume)."""
    loops = copy.deepcopy(checkpoint["loops"])
    del loops["fit_loop"]["state_dict"]["combined_loader"]
    return {"loops": loops, "epoch": checkpoint["epoch"], "global_step": checkpoint["global_step"]}


def test_a_resume_from_an_epoch_s_last_batch_counts_epochs_as_lightning_s_own_does(tmp_path):
    """``every_n_train_steps`` saves at an epoch's last batch (step 10: TinyModel has 10 batches
    per epoch). Lightning (2.6) resuming such a checkpoint with its stock IO counts that epoch
    twice: from there on its epoch counters (``current_epoch``, ``epoch_progress``) are one ahead
    of an uninterrupted run's, and a ``max_epochs`` run trains one epoch less. Through the
    adapter, the same checkpoint resumes with the same counters as through the stock IO."""
    io = AsyncCkptIO(tmp_path / "engine")
    train(tmp_path, io, steps=10, save_top_k=-1)
    at_epoch_end = tmp_path / "ckpts" / "epoch=0-step=10.ckpt"
    saved = io.load_checkpoint(at_epoch_end)
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]
    io.export(at_epoch_end, tmp_path / "stock.ckpt")
    resumed = AsyncCkptIO(tmp_path / "engine")
    train(tmp_path, resumed, steps=14, ckpt_path=at_epoch_end, save_top_k=-1)
    train(tmp_path / "stock", TorchCheckpointIO(), steps=14, ckpt_path=tmp_path / "stock.ckpt",
          save_top_k=-1)
    stock = TorchCheckpointIO().load_checkpoint(tmp_path / "stock" / "ckpts" / "last.ckpt",
                                                weights_only=False)
    assert stock["global_step"] == 14
    assert_same(progress(resumed.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")),
                progress(stock))
    resumed.teardown()


def in_a_stage(io, fn="validate"):
    """``io`` as while a Trainer's stage runs (its callback set up): saves are asynchronous and
    the engine stays open until ``io.teardown()`` (outside a stage each save waits for its commit
    and closes the engine)."""
    trainer = SimpleNamespace(strategy=SingleDeviceStrategy("cpu"), state=SimpleNamespace(fn=fn),
                              checkpoint_callbacks=[])
    io.callback.setup(trainer, None, fn)
    return io


def plain_checkpoint(global_step, value=1.0):
    return {"state_dict": {"w": torch.full((4,), value)}, "global_step": global_step, "epoch": 0}


def test_removing_a_save_still_in_flight_does_not_wait_and_leaves_neither_pointer_nor_snapshot(
        tmp_path):
    io = in_a_stage(AsyncCkptIO(tmp_path / "engine"))
    path = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
    engine = io._open()
    os.kill(engine._writer.pid, signal.SIGSTOP)  # nothing commits while the writer is stopped
    try:
        io.save_checkpoint(plain_checkpoint(2), path)
        io.remove_checkpoint(path)  # returns although the save is not committed
        assert not path.exists()
    finally:
        os.kill(engine._writer.pid, signal.SIGCONT)
    io.teardown()
    assert not path.exists()  # the pointer, written at the commit, went with the drop
    assert io._open().committed_steps() == []  # and its snapshot with it
    io.teardown()


def test_a_removal_queued_when_the_job_is_killed_keeps_the_pointer_and_its_snapshot(tmp_path):
    """save_top_k removes the old best after saving the new one; killed before the writer got
    to the removal, both pointers and both snapshots stay (never a snapshot nothing names, as
    when the pointer was deleted at once and the drop lost)."""
    io = in_a_stage(AsyncCkptIO(tmp_path / "engine"))
    old, new = tmp_path / "ckpts" / "epoch=0-step=2.ckpt", tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    io.save_checkpoint(plain_checkpoint(2), old)
    engine = io._open()
    engine.wait()
    writer = engine._writer.pid
    os.kill(writer, signal.SIGSTOP)
    io.save_checkpoint(plain_checkpoint(4), new)
    io.remove_checkpoint(old)
    os.kill(writer, signal.SIGKILL)  # the new save and the removal never reach the manifest
    engine._writer.process.wait()
    with pytest.raises(WriterDiedError):
        io.teardown()
    io = AsyncCkptIO(tmp_path / "engine")
    assert old.exists() and not new.exists()
    assert read_pointer(old).step in io._open().committed_steps()
    io.teardown()


def test_a_replaced_pointer_drops_its_snapshot_unless_another_pointer_names_it(tmp_path):
    io = in_a_stage(AsyncCkptIO(tmp_path / "engine"))
    last, copied = tmp_path / "ckpts" / "last.ckpt", tmp_path / "ckpts" / "kept.ckpt"
    io.save_checkpoint(plain_checkpoint(1), last)
    io._engine.wait()
    shutil.copy(last, copied)  # a second pointer to snapshot 0
    io.save_checkpoint(plain_checkpoint(2), last)  # replaces last.ckpt: snapshot 0 stays
    io.save_checkpoint(plain_checkpoint(3), last)  # snapshot 1 is named by nothing: dropped
    io._engine.wait()
    assert read_pointer(str(last)).step == 2 and io._engine.committed_steps() == [0, 2]
    io.remove_checkpoint(copied)
    io._engine.wait()
    assert io._engine.committed_steps() == [2] and not copied.exists()
    io.teardown()


def test_a_pointer_the_writer_is_writing_keeps_no_snapshot(tmp_path):
    """The writer writes a pointer as NAME.tmp-PID, then renames it over NAME. Replacing
    last.ckpt while the writer is between the two (or was killed there) must still drop the
    snapshot last.ckpt named: that file is not a pointer that names it."""
    io = in_a_stage(AsyncCkptIO(tmp_path / "engine"))
    last = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint(plain_checkpoint(1), last)
    engine = io._engine
    engine.wait()
    os.kill(engine._writer.pid, signal.SIGSTOP)  # nothing is written until it goes on
    try:
        shutil.copy(last, last.with_name(replacement_name(last.name, engine._writer.pid)))
        io.save_checkpoint(plain_checkpoint(2), last)  # replaces last.ckpt: snapshot 0 goes
    finally:
        os.kill(engine._writer.pid, signal.SIGCONT)
    engine.wait()
    assert read_pointer(str(last)).step == 1 and engine.committed_steps() == [1]
    io.teardown()


def save_four(io, ckpts):
    """Two global steps saved as Lightning does: a top-k file, then last.ckpt (snapshots 0-3)."""
    in_a_stage(io)
    for global_step in (2, 4):
        io.save_checkpoint(plain_checkpoint(global_step),
                           ckpts / f"epoch=0-step={global_step}.ckpt")
        io.save_checkpoint(plain_checkpoint(global_step), ckpts / "last.ckpt")
    io.teardown()


def damage(engine_dir, step):
    (shard,) = glob.glob(os.path.join(engine_dir, f"step-{step:020d}.*", "rank-*.ackpt"))
    os.truncate(shard, os.path.getsize(shard) // 2)


def test_a_damaged_snapshot_fails_its_own_path_and_last_falls_back(tmp_path):
    ckpts, engine_dir = tmp_path / "ckpts", tmp_path / "engine"
    io = AsyncCkptIO(engine_dir)
    save_four(io, ckpts)
    damage(engine_dir, 3)  # last.ckpt's
    damage(engine_dir, 2)  # epoch=0-step=4.ckpt's
    with pytest.raises(CorruptSnapshotError, match="Lightning asked for this checkpoint"):
        io.load_checkpoint(ckpts / "epoch=0-step=4.ckpt")
    with pytest.warns(RuntimeWarning, match="newest committed snapshot that verifies"):
        loaded = io.load_checkpoint(ckpts / "last.ckpt")
    assert loaded["global_step"] == 2  # snapshot 1: the newest one that is whole
    io.teardown()


def test_ckpt_path_last_resumes_past_a_damaged_newest_snapshot(tmp_path):
    io = AsyncCkptIO(tmp_path / "engine")
    train(tmp_path, io, steps=6)
    damage(tmp_path / "engine", read_pointer(str(tmp_path / "ckpts" / "last.ckpt")).step)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[io],
                        callbacks=[io.callback, ModelCheckpoint(dirpath=tmp_path / "ckpts")])
    with pytest.warns(RuntimeWarning, match="newest committed snapshot that verifies"):
        trainer.fit(TinyModel(), ckpt_path="last")
    assert trainer.global_step == 8


def test_a_pointer_is_untrusted_input(tmp_path):
    io = AsyncCkptIO(tmp_path / "engine")
    save_four(io, tmp_path / "ckpts")
    with open(tmp_path / "ckpts" / "last.ckpt", "rb") as f:
        good = json.loads(Marker.record_in(f))  # as earlier versions wrote it: a file of its own
    bad = tmp_path / "ckpts" / "bad.ckpt"
    for change in ({"step": -1}, {"step": "3"}, {"step": 1.0}, {"step": True},
                   {"step": 10**20}, {"version": 2}, {"directory": 7}, {"global_step": "x"},
                   {"extra": 1}):
        bad.write_text(json.dumps({**good, **change}))
        with pytest.raises(PointerFileError):
            io.load_checkpoint(bad)
    bad.write_text(json.dumps(good)[:-2])  # cut short
    with pytest.raises(PointerFileError):
        io.load_checkpoint(bad)
    bad.write_text(json.dumps(good) + " " * 5000)
    with pytest.raises(PointerFileError, match="longer than"):
        io.load_checkpoint(bad)
    bad.write_text(json.dumps({**good, "directory": "../elsewhere"}))
    with pytest.raises(PointerFileError, match="AsyncCkptIO"):
        io.load_checkpoint(bad)
    bad.write_text(json.dumps({**good, "global_step": 99}))
    with pytest.raises(PointerFileError, match="another run"):
        io.load_checkpoint(bad)
    bad.write_text(json.dumps({**good, "step": 17}))
    with pytest.raises(NoSnapshotError, match="not committed"):
        io.load_checkpoint(bad)
    io.teardown()


def test_a_checkpoint_of_the_stock_io_loads_with_weights_only(tmp_path):
    path = tmp_path / "plain.ckpt"
    TorchCheckpointIO().save_checkpoint({**plain_checkpoint(3), "where": Path("x")}, path)
    io = AsyncCkptIO(tmp_path / "engine")
    with pytest.raises(Exception, match="weights_only"):
        io.load_checkpoint(path)  # a pickled Path is not allowed by weights_only=True
    assert io.load_checkpoint(path, weights_only=False)["where"] == Path("x")
    io.teardown()


def test_a_value_the_engine_cannot_encode_is_refused_at_save_naming_it(tmp_path):
    io = AsyncCkptIO(tmp_path / "engine")
    with pytest.raises(EncodingError, match=r"hyper_parameters\.data_dir.*save_hyperparameters"):
        io.save_checkpoint({**plain_checkpoint(1), "hyper_parameters": {"data_dir": Path("d")}},
                           tmp_path / "ckpts" / "last.ckpt")
    io.teardown()
    assert not (tmp_path / "ckpts" / "last.ckpt").exists()


class ConfiguredModel(TinyModel):
    """Hyperparameters given as one omegaconf config, as Hydra users give them: Lightning saves
    the config and its class."""

    def __init__(self, config):
        super().__init__(hidden=config.hidden)
        self.save_hyperparameters(config)


def test_omegaconf_hparams_are_saved_without_pickling_and_loaded_back(tmp_path):
    """The config is saved as its container and its class's name: the plugin gives the config
    and its class back, and Lightning's own loading of the .ckpt (weights_only) takes it."""
    omegaconf = pytest.importorskip("omegaconf")
    fields = {"hidden": 8, "width": "${hidden}"}  # an interpolation stays one
    io = AsyncCkptIO(tmp_path / "engine")
    path = train(tmp_path, io, steps=4,
                 model=ConfiguredModel(omegaconf.OmegaConf.create(fields))).last_model_path
    loaded = io.load_checkpoint(path)
    assert loaded["hparams_type"] is omegaconf.DictConfig
    assert omegaconf.OmegaConf.to_container(loaded["hyper_parameters"]) == fields
    assert loaded["hyper_parameters"].width == 8
    on_disk = torch.load(path, weights_only=True)
    assert on_disk["hyper_parameters"] == fields
    assert on_disk["hparams_type"] == "omegaconf.dictconfig.DictConfig"
    model = ConfiguredModel.load_from_checkpoint(path)
    assert model.hparams.hidden == 8 and model.net[0].out_features == 8


def test_strategies_that_bypass_checkpoint_io_are_refused_and_a_last_link_warns():
    io = AsyncCkptIO("unused")
    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        trainer = SimpleNamespace(strategy=strategy, state=SimpleNamespace(fn="validate"),
                                  checkpoint_callbacks=[])
        with pytest.raises(IntegrationError, match=type(strategy).__name__):
            io.callback.setup(trainer, None, "validate")
    trainer = SimpleNamespace(strategy=L.Trainer(logger=False).strategy,
                              state=SimpleNamespace(fn="validate"),
                              checkpoint_callbacks=[ModelCheckpoint(save_last="link")])
    with pytest.warns(RuntimeWarning, match="save_last=True"):
        io.callback.setup(trainer, None, "validate")


def test_settings_the_adapter_owns_are_refused():
    with pytest.raises(ValueError, match="keep_last"):
        AsyncCkptIO("unused", keep_last=3)


def test_warnings_name_a_missing_callback_and_a_loader_that_cannot_resume(tmp_path):
    class PlainLoader(TinyModel):
        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
            return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)

    io = AsyncCkptIO(tmp_path / "engine")
    with pytest.warns(RuntimeWarning) as caught:
        train(tmp_path, io, steps=6, callback=False, model=PlainLoader())
    messages = [str(w.message) for w in caught if "AsyncCkptIO" in str(w.message)
                or "StatefulDataLoader" in str(w.message)]
    assert len(messages) == 2  # each once, though three saves were taken
    assert any("io.callback" in m for m in messages)
    assert any("StatefulDataLoader" in m for m in messages)


# --- Lightning's contracts of names, time and lifetime ------------------------------------------

class HoldWriter(L.Callback):
    """Stops the writer for the whole training (SIGSTOP at on_train_start, SIGCONT at
    on_train_end, before the teardown that waits for it): every save of the fit is still in
    flight when ModelCheckpoint picks the next name, whatever the machine's load."""

    def __init__(self, io):
        self.io = io

    def on_train_start(self, trainer, pl_module):
        os.kill(self.io._engine._writer.pid, signal.SIGSTOP)

    def on_train_end(self, trainer, pl_module):
        os.kill(self.io._engine._writer.pid, signal.SIGCONT)


def fit_with(root, io, model=None, ckpt_path=None, **checkpoint_args):
    """A short fit (4 epochs of 2 batches) saving into ``root`` through ``io`` (the writer held
    with an AsyncCkptIO); returns the Trainer and its ModelCheckpoint."""
    L.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=root, **checkpoint_args)
    ours = [io.callback, HoldWriter(io)] if isinstance(io, AsyncCkptIO) else []
    trainer = L.Trainer(max_epochs=4, limit_train_batches=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        plugins=[io], callbacks=ours + [checkpoint])
    trainer.fit(model or TinyModel(), ckpt_path=ckpt_path)
    return trainer, checkpoint


def test_a_save_in_flight_counts_as_a_file_for_versioned_names(tmp_path):
    """ModelCheckpoint versions a name taken by an existing file (test.ckpt, test-v1.ckpt...);
    the previous save is still in flight when it picks the next: it must count as a file."""
    every = {"filename": "test", "save_top_k": -1, "monitor": "epoch"}
    fit_with(tmp_path / "stock", TorchCheckpointIO(), **every)
    io = AsyncCkptIO(tmp_path / "engine", slots=5)  # four saves in flight at once
    _, checkpoint = fit_with(tmp_path / "async", io, **every)
    files = sorted(os.listdir(tmp_path / "async"))
    assert files == sorted(os.listdir(tmp_path / "stock"))
    assert files == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert sorted(map(os.path.basename, checkpoint.best_k_models)) == files
    assert sorted(read_pointer(tmp_path / "async" / f).epoch for f in files) == [0, 1, 2, 3]


def test_save_last_links_with_versioned_names_leave_no_stale_link(tmp_path, monkeypatch):
    """save_last="link" with a last name per epoch: each epoch links last-epoch=N.ckpt to that
    epoch's file (a save still in flight) and removes the previous link, as the stock IO does."""
    monkeypatch.setattr(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}")
    fit_with(tmp_path / "stock", TorchCheckpointIO(), save_top_k=-1, save_last="link")
    io = AsyncCkptIO(tmp_path / "engine", slots=5)
    with pytest.warns(RuntimeWarning, match="save_last=True"):
        _, checkpoint = fit_with(tmp_path / "async", io, save_top_k=-1, save_last="link")

    def layout(root):
        return {f: os.readlink(root / f) if os.path.islink(root / f) else None
                for f in os.listdir(root)}

    assert layout(tmp_path / "async") == layout(tmp_path / "stock")
    assert sorted(layout(tmp_path / "async").values(), key=str) == [
        None, None, None, None, "epoch=3-step=8.ckpt"]  # one link, to the last epoch's file
    last = tmp_path / "async" / "last-epoch=3.ckpt"
    assert checkpoint.last_model_path == str(last)
    assert io.load_checkpoint(last)["epoch"] == 3


class WithValidation(TinyModel):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_load_of_a_save_in_flight_waits_for_its_commit(tmp_path):
    io = in_a_stage(AsyncCkptIO(tmp_path / "engine"))
    path, link = tmp_path / "ckpts" / "epoch=0-step=2.ckpt", tmp_path / "ckpts" / "last.ckpt"
    engine = io._open()
    os.kill(engine._writer.pid, signal.SIGSTOP)  # nothing commits while the writer is stopped
    try:
        io.save_checkpoint(plain_checkpoint(2, value=3.0), path)
        os.symlink(path.name, link)  # as save_last="link" does
        assert not path.exists()
    finally:
        os.kill(engine._writer.pid, signal.SIGCONT)
    assert io.load_checkpoint(link)["global_step"] == 2  # through the link: waits too
    assert_same(io.load_checkpoint(path)["state_dict"], plain_checkpoint(2, 3.0)["state_dict"])
    io.teardown()


def test_save_checkpoint_then_validate_from_it_at_once(tmp_path):
    """``trainer.save_checkpoint(p)`` returns with ``p`` there: a save outside a stage waits for
    its commit and closes the engine (no teardown follows that would)."""
    io = AsyncCkptIO(tmp_path / "engine")
    trainer = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", plugins=[io],
                        callbacks=[io.callback], enable_checkpointing=False)
    model = WithValidation()
    trainer.fit(model)
    saved = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(saved)
    assert io._engine is None and read_pointer(saved).global_step == 2
    (metrics,) = trainer.validate(model, ckpt_path=saved, verbose=False)
    assert "val_loss" in metrics


class FailsAtStep(TinyModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            raise KeyError("stop")  # Lightning runs the strategy's teardown, not the callbacks'
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("fit_fails", [False, True])
def test_a_second_trainer_on_the_directory_right_after_a_save_outside_fit(tmp_path, fit_fails):
    """A new Trainer with a new AsyncCkptIO on the same directory, right after the first one's
    ``save_checkpoint`` outside fit (after a fit that ended, or that raised), opens it at once
    (lock_timeout=0: a lock still held would raise DirectoryInUseError instead of waiting) and
    resumes from that save."""
    first = AsyncCkptIO(tmp_path / "engine")
    trainer = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[first], callbacks=[first.callback],
                        enable_checkpointing=False)
    if fit_fails:
        with pytest.raises(KeyError):
            trainer.fit(FailsAtStep())
    else:
        trainer.fit(TinyModel())
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    second = AsyncCkptIO(tmp_path / "engine", lock_timeout=0)
    trainer = L.Trainer(max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[second],
                        callbacks=[second.callback,
                                   ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)])
    trainer.fit(TinyModel(), ckpt_path=tmp_path / "saved.ckpt")
    assert trainer.global_step == 4 and first._engine is None and second._engine is None
    assert second.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 4


def test_storage_options_raise_a_typed_error_naming_what_to_do(tmp_path):
    io = AsyncCkptIO(tmp_path / "engine")
    with pytest.raises(UnsupportedOptionError, match=r"AsyncCkptIO\(directory, \*\*options\)"):
        io.save_checkpoint(plain_checkpoint(1), tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(TypeError):  # what Lightning's own CheckpointIO raises
        io.save_checkpoint(plain_checkpoint(1), tmp_path / "a.ckpt", storage_options="x")
    assert io._engine is None and not (tmp_path / "a.ckpt").exists()


def test_checkpoints_on_another_file_system_are_the_stock_io_s_with_a_warning(tmp_path):
    """A ModelCheckpoint dirpath (or a save_checkpoint path) that is an fsspec URL, which the
    writer process cannot write: saved, kept by save_top_k, resumed from and removed by
    Lightning's stock IO, as with it; none of them is a snapshot."""
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    root = f"memory://{tmp_path.name}"
    io = AsyncCkptIO(tmp_path / "engine")
    checkpoint = ModelCheckpoint(dirpath=f"{root}/ckpts", monitor="loss", save_top_k=2,
                                 every_n_train_steps=2, save_last=True)
    trainer = L.Trainer(max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[io],
                        callbacks=[io.callback, checkpoint])
    with pytest.warns(RuntimeWarning, match="stock TorchCheckpointIO, which blocks"):
        trainer.fit(TinyModel())
    try:
        saved = sorted(os.path.basename(p) for p in memory.ls(f"{root}/ckpts", detail=False))
        assert saved == sorted(os.path.basename(p) for p in checkpoint.best_k_models) + [
            "last.ckpt"] and len(saved) == 3  # save_top_k=2 removed the others
        trainer = L.Trainer(max_steps=10, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=tmp_path, plugins=[io], callbacks=[io.callback])
        trainer.fit(TinyModel(), ckpt_path=f"{root}/ckpts/last.ckpt")
        assert trainer.global_step == 10
        trainer.save_checkpoint(f"{root}/end.ckpt")
        assert io.load_checkpoint(f"{root}/end.ckpt")["global_step"] == 10
        io.remove_checkpoint(f"{root}/end.ckpt")
        assert not memory.exists(f"{root}/end.ckpt")
        with memory.open(f"{root}/ckpts/last.ckpt", "rb") as f:
            assert Marker.record_in(f) is None  # a file of the stock IO, not a snapshot's
    finally:
        memory.rm(root, recursive=True)


def test_no_thread_outlives_the_trainer(tmp_path):
    """A resumed fit reads through the engine, whose verify threads it keeps while it is open;
    after the fit (and an engine-free load) none of the library's threads is left, as
    Lightning's own test suite checks with threading.enumerate()."""
    io = AsyncCkptIO(tmp_path / "engine")
    train(tmp_path, io, steps=4, model=TinyModel(hidden=256))
    before = set(threading.enumerate())
    seen = []

    class Threads(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.extend(t.name for t in threading.enumerate() if t.name.startswith("async_ckpt"))

    resumed = AsyncCkptIO(tmp_path / "engine")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[resumed],
                        callbacks=[resumed.callback, Threads(),
                                   ModelCheckpoint(dirpath=tmp_path / "ckpts")])
    trainer.fit(TinyModel(hidden=256), ckpt_path="last")
    assert any(name.startswith("async_ckpt-verify") for name in seen)  # kept while open
    resumed.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert set(threading.enumerate()) - before == set()


@pytest.mark.slow
def test_ddp_spawn_saves_in_its_workers_and_leaves_nothing_open(tmp_path):
    """``strategy="ddp_spawn"`` pickles the plugin into 2 worker processes (gloo): rank 0's
    saves, and its hand-over of the weights to the main process (a save and a removal after the
    fit), leave no engine open anywhere, so the Trainer pickles and the directory is free."""
    io = AsyncCkptIO(tmp_path / "engine")
    trainer = L.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=4,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[io],
                        callbacks=[io.callback, ModelCheckpoint(dirpath=tmp_path / "ckpts",
                                                                every_n_train_steps=2,
                                                                save_last=True)])
    trainer.fit(TinyModel())
    assert io._engine is None
    torch.save(trainer, tmp_path / "trainer.pt")  # failed on the engine's locks
    assert read_pointer(tmp_path / "ckpts" / "last.ckpt").global_step == 4
    free = AsyncCkptIO(tmp_path / "engine", lock_timeout=0)  # no writer holds the directory
    assert free.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 4
    named = sorted(read_pointer(p).step for p in (tmp_path / "ckpts").iterdir())
    assert free._open().committed_steps() == named  # the hand-over's snapshot went with it
    free.teardown()
