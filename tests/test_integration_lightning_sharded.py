"""Lightning's ModelParallelStrategy saving through async_ckpt
(async_ckpt.integrations.lightning_sharded), with the real framework and FSDP2 on CPU (gloo).

Under torchrun (tests/programs/lightning_sharded.py, three launches in one test): a 2-rank run
SIGKILLed in the middle of an epoch, with the saves of its last checkpoint step staged but never
committed, resumes with ``ckpt_path="last"`` (and from a given path) logging the same loss at
every step as an uninterrupted run and ending in the same state, bit for bit, with the same
checkpoint files; its last checkpoint resumes on 4 ranks with exactly the saved state re-split,
and so does the single file the consolidation command makes of it, through Lightning's own
loading. In this process (one rank): ModelCheckpoint's versioned names, top-k removals and last
links come out as with the stock strategy with every save in flight; a stock checkpoint resumes
through the strategy; a save after fit is there when it returns; damage, and what the strategy
refuses.
"""

import json
import os
import signal
import time

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from async_ckpt.storage.local import LocalStorage  # noqa: E402
from async_ckpt.errors import (CorruptSnapshotError, PointerFileError,  # noqa: E402
                               StateMismatchError, UnsupportedOptionError)
from async_ckpt.format.manifest import read_manifest  # noqa: E402
from async_ckpt.integrations.pointer import read_pointer  # noqa: E402
from async_ckpt.integrations.lightning_sharded import (AsyncCkptModelParallelStrategy,  # noqa
                                                       consolidate, main as consolidate_main)
from conftest import assert_same  # noqa: E402
from programs.lightning_sharded import STEPS, ShardedMLP  # noqa: E402
from test_distributed import kill_everything, torchrun  # noqa: E402
from test_integration_lightning import damage  # noqa: E402
from test_sharded import wait_torchrun  # noqa: E402

pytestmark = pytest.mark.usefixtures("restored_environment")  # Lightning's fit writes os.environ

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "lightning_sharded.py")


def run(out, nproc, phase, *extra, until=None):
    """Run the program's ``phase``; with ``until`` (a file), SIGKILL every process of the run
    (torchrun, workers, writers) once the program has written it."""
    log = os.path.join(out, f"{phase}.txt")
    process = torchrun(PROGRAM, nproc, "--phase", phase, "--out", str(out), *extra, output=log)
    if until is None:
        wait_torchrun(process, log, timeout=300)
        return
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(until):
            assert process.poll() is None, f"exited with {process.returncode} before {until}"
            assert time.monotonic() < deadline, f"{until} never appeared"
            time.sleep(0.1)
    finally:
        kill_everything(process)


def losses(root, rank):
    with open(os.path.join(root, f"rank-{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def named_steps(*ckpt_dirs):
    return {read_pointer(os.path.join(d, name))[1] for d in ckpt_dirs for name in os.listdir(d)}


@pytest.mark.slow
def test_killed_mid_epoch_resumes_bit_exact_and_reshards_from_2_to_4_ranks(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run(tmp_path, 2, "train", until=killed / "ready")
    # step 10's saves were staged, never committed: last.ckpt still names step 5's save
    assert sorted(os.listdir(killed / "ckpts")) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert torch.load(killed / "ckpts" / "last.ckpt" / "meta.pt",
                      weights_only=True)["global_step"] == 5

    run(tmp_path, 2, "resume")
    for rank in range(2):
        expected = {r["step"]: r["loss"] for r in losses(reference, rank)}
        records = losses(killed, rank)
        assert [r["step"] for r in records] == list(range(1, 11)) + list(range(6, STEPS + 1))
        assert all(r["loss"] == expected[r["step"]] for r in records), f"rank {rank}"
        given = losses(tmp_path / "explicit", rank)  # from epoch=0-step=5.ckpt, to step 10
        assert [(r["step"], r["loss"]) for r in given] == [(s, expected[s]) for s in range(6, 11)]
    assert_same(torch.load(killed / "full.pt"), torch.load(reference / "full.pt"))
    assert sorted(os.listdir(killed / "ckpts")) == sorted(os.listdir(reference / "ckpts"))
    # the engine keeps exactly the snapshots some checkpoint directory names (killed and explicit
    # share it): replaced and removed ones were dropped, the killed run's attempt never committed
    engine = killed / "engine"
    assert read_manifest(LocalStorage(str(engine))).steps() == sorted(
        named_steps(killed / "ckpts", tmp_path / "explicit" / "ckpts"))
    # the consolidated file of the last checkpoint: the whole state torch's full_state_dict gave
    last = killed / "ckpts" / "last.ckpt"
    consolidated = tmp_path / "last.consolidated"
    assert consolidate_main([str(last), "--output_file", str(consolidated)]) == 0
    whole = torch.load(consolidated, weights_only=True)
    ended = torch.load(killed / "full.pt")
    assert whole["global_step"] == STEPS
    assert_same(whole["state_dict"], ended["state_dict"])
    assert_same(whole["optimizer_states"], [ended["optimizer"]])
    assert set(whole) - {"state_dict", "optimizer_states"} == set(
        torch.load(last / "meta.pt", weights_only=True))
    assert_same(ShardedMLP.load_from_checkpoint(consolidated).state_dict(), whole["state_dict"])

    run(tmp_path, 4, "reshard", "--consolidated", str(consolidated))
    resharded = torch.load(tmp_path / "reshard" / "loaded.pt")  # gathered right after the load
    assert_same(resharded["state_dict"], whole["state_dict"])
    assert_same(resharded["optimizer"], whole["optimizer_states"][0])
    from_file = torch.load(tmp_path / "from-file" / "loaded.pt")  # Lightning's own loading
    assert_same(from_file["state_dict"], whole["state_dict"])
    assert_same(from_file["optimizer"]["state"], whole["optimizer_states"][0]["state"])
    # (its broadcast of the whole state gives the Adam betas back as a list, not a tuple)
    assert json.dumps(from_file["optimizer"]["param_groups"]) == json.dumps(
        whole["optimizer_states"][0]["param_groups"])
    for rank in range(4):
        assert [r["step"] for r in losses(tmp_path / "reshard", rank)] == [16, 17, 18]
    with open(tmp_path / "reshard" / "warnings.json") as f:
        (warned,) = json.load(f)  # saved mid-epoch on 2 data-parallel ranks, resumed on 4
    assert "with 2 data-parallel rank(s), and resumes with 4" in warned


# --- one rank, in this process -----------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_process_group_left():
    """Lightning leaves its (one-rank) process group initialised after a fit: destroyed after
    each test, so that the engines of other tests in this process see no torch.distributed."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def trainer(strategy, steps=8, callbacks=(), **kwargs):
    L.seed_everything(0, verbose=False)
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, strategy=strategy,
                     callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def ours(root, **options):
    return AsyncCkptModelParallelStrategy(root / "engine", process_group_backend="gloo",
                                          **options)


def stock():
    return ModelParallelStrategy(process_group_backend="gloo")


class HoldWriter(L.Callback):
    """Stops the writer for the whole training (SIGCONT at on_train_end or on_exception, before
    the teardown that waits for it): every save of the fit is in flight when ModelCheckpoint picks names,
    replaces last.ckpt and removes what top-k drops."""

    def on_train_start(self, trainer, pl_module):
        os.kill(trainer.strategy._engine._writer.pid, signal.SIGSTOP)

    def on_train_end(self, trainer, pl_module):
        os.kill(trainer.strategy._engine._writer.pid, signal.SIGCONT)

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


def layout(directory):
    return {name: os.readlink(directory / name) if os.path.islink(directory / name) else None
            for name in os.listdir(directory)}


def test_checkpoint_names_top_k_and_last_links_come_out_as_with_the_stock_strategy(tmp_path):
    def fit(root, strategy, hold=()):
        versioned = ModelCheckpoint(dirpath=root / "versioned", filename="test", save_top_k=-1,
                                    monitor="epoch")
        best = ModelCheckpoint(dirpath=root / "best", monitor="train_loss", save_top_k=2,
                               save_last="link")
        trainer(strategy, steps=8, callbacks=[*hold, versioned, best],
                limit_train_batches=2).fit(ShardedMLP())

    fit(tmp_path / "stock", stock())
    strategy = ours(tmp_path, slots=13)  # 12 saves, every one still in flight at the next
    with pytest.warns(RuntimeWarning, match="save_last=True"):  # a link made before the commit
        fit(tmp_path, strategy, hold=[HoldWriter()])
    for name in ("versioned", "best"):
        assert layout(tmp_path / name) == layout(tmp_path / "stock" / name), name
    assert sorted(os.listdir(tmp_path / "versioned")) == [
        "test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert read_manifest(LocalStorage(str(tmp_path / "engine"))).steps() == sorted(named_steps(
        tmp_path / "versioned", tmp_path / "best"))  # nothing kept that no directory names
    meta = torch.load(tmp_path / "best" / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta.keys() == torch.load(tmp_path / "stock" / "best" / "last.ckpt" / "meta.pt",
                                     weights_only=True).keys()


class Validated(ShardedMLP):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_stock_checkpoint_resumes_and_a_save_after_fit_is_there_when_it_returns(tmp_path):
    trainer(stock(), steps=4, callbacks=[ModelCheckpoint(dirpath=tmp_path / "stock",
                                                         save_last=True)]).fit(ShardedMLP())
    strategy = ours(tmp_path)
    run = trainer(strategy, steps=8, enable_checkpointing=False, limit_val_batches=2)
    model = Validated()
    run.fit(model, ckpt_path=tmp_path / "stock" / "last.ckpt")  # DCP: the stock loader
    assert run.global_step == 8
    saved = tmp_path / "saved.ckpt"
    run.save_checkpoint(saved)
    assert strategy._engine is None and read_pointer(str(saved)) is not None
    (trained,) = run.validate(model, verbose=False)
    model.net[0].weight.data.zero_()  # what the load must undo
    rng = torch.get_rng_state()
    (loaded,) = run.validate(model, ckpt_path=saved, verbose=False)
    assert loaded == trained  # the saved state, exactly
    assert torch.equal(torch.get_rng_state(), rng)  # validate leaves the RNG as it was

    with pytest.raises(PointerFileError, match="AsyncCkptModelParallelStrategy"):
        trainer(ours(tmp_path / "elsewhere"), steps=10).fit(ShardedMLP(), ckpt_path=saved)
    weights = tmp_path / "weights.ckpt"
    run.save_checkpoint(weights, weights_only=True)
    with pytest.raises(StateMismatchError, match="missing from the checkpoint: optimizer_0"):
        trainer(ours(tmp_path), steps=10).fit(ShardedMLP(), ckpt_path=weights)
    damage(str(tmp_path / "engine"), read_pointer(str(saved))[1])
    with pytest.raises(CorruptSnapshotError, match="Lightning asked for this checkpoint"):
        trainer(ours(tmp_path), steps=10).fit(ShardedMLP(), ckpt_path=saved)
    with pytest.raises(PointerFileError, match="not a checkpoint directory written by"):
        consolidate(tmp_path / "stock" / "last.ckpt", tmp_path / "out.pt")


def test_last_falls_back_past_a_damaged_snapshot(tmp_path):
    ckpts = tmp_path / "ckpts"
    run = trainer(ours(tmp_path), steps=6, callbacks=[
        ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_last=True, save_top_k=-1)])
    run.fit(ShardedMLP())
    damage(str(tmp_path / "engine"), read_pointer(str(ckpts / "last.ckpt"))[1])
    resumed = trainer(ours(tmp_path), steps=7, enable_checkpointing=False)
    with pytest.warns(RuntimeWarning, match="newest committed snapshot that verifies"):
        resumed.fit(ShardedMLP(), ckpt_path=ckpts / "last.ckpt")
    assert resumed.global_step == 7  # from the step-6 top-k save, which is whole


def test_what_the_strategy_refuses(tmp_path):
    with pytest.raises(UnsupportedOptionError, match="save_distributed_checkpoint"):
        AsyncCkptModelParallelStrategy(tmp_path, save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="keep_last"):
        AsyncCkptModelParallelStrategy(tmp_path, keep_last=3)
    with pytest.raises(UnsupportedOptionError, match="storage_options"):
        AsyncCkptModelParallelStrategy(tmp_path).save_checkpoint({}, tmp_path / "a.ckpt",
                                                                 storage_options={})
    assert not (tmp_path / "a.ckpt").exists()
    (tmp_path / "taken").touch()
    with pytest.raises(SystemExit):  # an existing output is never overwritten
        consolidate_main([str(tmp_path), "--output_file", str(tmp_path / "taken")])
