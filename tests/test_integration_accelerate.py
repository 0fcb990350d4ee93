"""async_ckpt.integrations.accelerate with the real Accelerate, on CPU.

The loop of tests/programs/accelerate_loop.py (an MLP with dropout, a shuffled prepared stateful
loader), SIGKILLed at a random step and during a save, then resumed through the adapter, logs the
same loss at every step as an uninterrupted run, bit for bit; the same at two ranks under torchrun.
In-process: the prepared loader's one-batch look-ahead, the random state a resumed iteration
starts from, the end of an epoch, every prepared object back after restore(), a loader that is
not stateful (warned), fallback past a damaged snapshot, retention, the version checks.

save_state's layout: a snapshot's directory holds the files Accelerate's own save_state writes at
that instant, the same names and contents; a stock ``accelerator.load_state(dir)`` in a process
that never imports async_ckpt restores every prepared object and the RNGs bit for bit;
``accelerator.save_state()``/``load_state()`` go through the engine while it is open (automatic
naming, ``total_limit``); a run SIGKILLed during a save leaves no directory for that step.
"""

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from async_ckpt.storage.local import LocalStorage
from async_ckpt import load
from async_ckpt.errors import IntegrationError, InvalidArgumentError, PointerFileError
from async_ckpt.integrations.pointer import POINTER_NAME, read_pointer
from async_ckpt.integrations import accelerate as accelerate_ckpt
from conftest import assert_same
from test_resume import read_log, run_killed

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = os.path.join(HERE, "programs", "accelerate_loop.py")
EPOCHS, BATCHES = 4, 7  # accelerate_loop.py: 52 samples in batches of 8


@pytest.fixture(autouse=True)
def no_torchdata_noise():
    """torchdata 0.11 calls a deprecated torch function in every StatefulDataLoader."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield


# --- in-process: a small prepared training state ---------------------------------------------

def prepared(stateful=True, generator=False, workers=0, total_limit=None, samples=20,
             project_dir=None):
    """An Accelerator and the model, optimizer, scheduler and shuffled loader it prepared; with
    ``project_dir``, save_state's automatic checkpoint naming there."""
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
        project_config=ProjectConfiguration(total_limit=total_limit, project_dir=project_dir,
                                            automatic_checkpoint_naming=project_dir is not None))
    set_seed(0)
    dataset = TensorDataset(torch.arange(samples, dtype=torch.float32).unsqueeze(1))
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(3) if generator else None)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, opt, sched, loader))


def train(accelerator, model, opt, sched, batches, engine=None, first_step=0):
    """One step per batch (snapshotted when an engine is given); each batch's samples and loss."""
    record = []
    for step, (x,) in enumerate(batches, first_step):
        loss = model(x).square().mean()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        record.append((x.flatten().tolist(), loss.item()))
        if engine is not None:
            engine.snapshot(step)
    return record


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("generator,workers", [(False, 0), (True, 0), (False, 2)])
def test_a_restored_loader_continues_with_the_next_batch_and_the_same_random_draws(
        ckpt_dir, generator, workers):
    accelerator, model, opt, sched, loader = prepared(generator=generator, workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # workers: augmentation would differ
        engine = accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                        scheduler=sched, dataloader=loader, heartbeat_interval=None)
    with engine:
        batches = iter(loader)
        train(accelerator, model, opt, sched, take(batches, 2), engine)  # snapshot 1: 2 batches
        # The loader has fetched batch 3 already (its look-ahead): the snapshot must not count it.
        expected = train(accelerator, model, opt, sched, batches)
        expected += train(accelerator, model, opt, sched, loader)  # and a whole next epoch
        assert len(expected) == 3 + 5
        assert engine.restore() == 1 and engine.epoch == 0
        again = train(accelerator, model, opt, sched, loader)
        again += train(accelerator, model, opt, sched, loader)
    assert again == expected  # the same samples in the same order, the same dropout: same losses
    assert "__iter__" not in vars(loader.base_dataloader)  # close() gave it back


def test_a_snapshot_at_the_last_batch_of_an_epoch_resumes_at_the_next_epoch(ckpt_dir):
    accelerator, model, opt, sched, loader = prepared()
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader, keep_last=5,
                                heartbeat_interval=None) as engine:
        train(accelerator, model, opt, sched, loader, engine)  # steps 0-4, one epoch
        engine.snapshot(100)  # after the loop ended
        expected = train(accelerator, model, opt, sched, loader)
        assert engine.restore(2) == 2 and engine.epoch == 0  # mid-epoch, then replaced unused
        for step in (4, 100):
            assert engine.restore(step) == step and engine.epoch == 1
            assert train(accelerator, model, opt, sched, loader) == expected


class Counter:
    """An object given to register_for_checkpointing."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def test_restore_brings_back_every_prepared_object(ckpt_dir):
    accelerator, model, opt, sched, loader = prepared()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # as fp16 on a GPU has
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        assert {"model", "optimizer", "scheduler", "scaler", "custom_0", "dataloader",
                "accelerator"} == set(engine.state)
        counter.seen, accelerator.step = 7, 3
        train(accelerator, model, opt, sched, take(iter(loader), 2), engine)
        saved = {name: copy.deepcopy(obj.state_dict()) for name, obj in
                 [("model", model), ("optimizer", opt), ("scheduler", sched), ("custom", counter)]}
        train(accelerator, model, opt, sched, loader)
        counter.seen, accelerator.step = 99, 11
        accelerator.scaler.update(new_scale=2.0)
        engine.restore()
        for name, obj in [("model", model), ("optimizer", opt), ("scheduler", sched),
                          ("custom", counter)]:
            assert_same(obj.state_dict(), saved[name], name)
        assert accelerator.scaler.get_scale() == 1024.0 and accelerator.step == 3


def test_a_loader_that_is_not_stateful_warns_once_and_restarts_the_epoch(ckpt_dir):
    accelerator, model, opt, sched, loader = prepared(stateful=False)
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        train(accelerator, model, opt, sched, loader)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.snapshot(4)  # between epochs: nothing is lost
        with pytest.warns(RuntimeWarning, match="use_stateful_dataloader=True") as caught:
            train(accelerator, model, opt, sched, take(iter(loader), 3), engine, first_step=5)
        assert len(caught) == 1
    accelerator, model, opt, sched, loader = prepared(stateful=False)
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        with pytest.warns(RuntimeWarning, match="use_stateful_dataloader=True"):
            assert engine.restore() == 7
        assert engine.epoch == 1 and loader.iteration == 1
        assert len(list(loader)) == 5  # the whole epoch again


def test_a_damaged_newest_snapshot_falls_back_to_the_previous_one(ckpt_dir):
    accelerator, model, opt, sched, loader = prepared()
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        batches = iter(loader)
        train(accelerator, model, opt, sched, take(batches, 2), engine)
        at_1 = copy.deepcopy(model.state_dict())
        expected = train(accelerator, model, opt, sched, batches)
        train(accelerator, model, opt, sched, take(iter(loader), 1), engine, first_step=2)
    shard = _newest_shard(ckpt_dir)
    with open(shard, "r+b") as f:  # flip a byte in the middle of the newest shard
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    accelerator, model, opt, sched, loader = prepared()
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        with pytest.warns(RuntimeWarning, match="step 2"):
            assert engine.restore() == 1
        assert_same(model.state_dict(), at_1)
        assert train(accelerator, model, opt, sched, loader) == expected


def _newest_shard(ckpt_dir):
    from async_ckpt.format.manifest import read_manifest

    record = read_manifest(LocalStorage(ckpt_dir)).snapshots[-1]
    return os.path.join(ckpt_dir, record.dir, record.shards[0].file)


def test_retention_follows_total_limit_unless_keep_last_is_given(ckpt_dir, tmp_path):
    accelerator, model, opt, sched, loader = prepared(total_limit=2)
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model,
                                heartbeat_interval=None) as engine:
        for step in range(5):
            engine.snapshot(step)
        engine.wait()
        assert engine.committed_steps() == [3, 4]
    with accelerate_ckpt.engine(accelerator, str(tmp_path / "other"), model=model, keep_last=4,
                                heartbeat_interval=None) as engine:
        for step in range(5):
            engine.snapshot(step)
        engine.wait()
        assert engine.committed_steps() == [1, 2, 3, 4]


def test_what_it_refuses(ckpt_dir, monkeypatch):
    accelerator, model, opt, sched, loader = prepared()
    with pytest.raises(IntegrationError, match="accelerator.prepare"):
        accelerate_ckpt.engine(accelerator, ckpt_dir, dataloader=DataLoader(range(4)))
    with accelerate_ckpt.engine(accelerator, ckpt_dir, dataloader=loader, heartbeat_interval=None):
        with pytest.raises(IntegrationError, match="another open engine"):
            accelerate_ckpt.engine(accelerator, ckpt_dir + "-2", dataloader=loader)
    with monkeypatch.context() as patched:
        patched.setattr(Accelerator, "distributed_type", DistributedType.FSDP)
        with pytest.raises(IntegrationError, match="FSDP"):
            accelerate_ckpt.engine(accelerator, ckpt_dir, model=model)
    monkeypatch.setattr("accelerate.__version__", "1.15.0")
    with pytest.raises(IntegrationError, match=r"accelerate>=1\.16,<2"):
        accelerate_ckpt._check_accelerate()
    monkeypatch.setattr("accelerate.__version__", "2.0.0")
    with pytest.warns(RuntimeWarning, match="tested with"):
        accelerate_ckpt._check_accelerate()
    monkeypatch.setattr("accelerate.__version__", "1.16.0")
    monkeypatch.delattr(DataLoaderShard, "adjust_state_dict_for_prefetch")
    with pytest.raises(IntegrationError, match="adjust_state_dict_for_prefetch"):
        accelerate_ckpt._check_accelerate()


# --- save_state's layout ----------------------------------------------------------------------

# A process that knows nothing of async_ckpt prepares the same kinds of objects as prepared()
# (other values), runs Accelerate's own load_state(argv[1]) and saves what it then holds.
STOCK_LOAD = textwrap.dedent("""
    import random, sys, warnings
    import numpy as np, torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset
    warnings.filterwarnings("ignore", message=".*set_vital.*")

    class Counter:
        seen = 0
        def state_dict(self):
            return {"seen": self.seen}
        def load_state_dict(self, state):
            self.seen = state["seen"]

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.1)
    loader = DataLoader(TensorDataset(torch.zeros(20, 1)), batch_size=4, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    accelerator.load_state(sys.argv[1])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "scaler": accelerator.scaler.state_dict(),
                "custom": counter.state_dict(), "step": accelerator.step,
                "python": random.getstate(),
                "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "async_ckpt imported": any(m.startswith("async_ckpt") for m in sys.modules)},
               sys.argv[2])
""")


def held(accelerator, model, opt, sched, counter):
    """What STOCK_LOAD saves, here (the loader's state is in dl_state_dict.bin, the same bytes as
    Accelerate's, and held back by a loader until it iterates)."""
    return copy.deepcopy({
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "custom": counter.state_dict(), "step": accelerator.step,
        "python": random.getstate(), "numpy": comparable(np.random.get_state()),
        "torch": torch.get_rng_state(), "async_ckpt imported": False})


def comparable(numpy_state):
    """NumPy's global RNG state with its array as a tensor, for assert_same."""
    name, keys, *rest = numpy_state
    return (name, torch.from_numpy(keys.copy()), *rest)


def read_any(path):
    """A file of a save_state directory, as Accelerate reads it (safetensors by name: files
    order their tensors as they like)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return dict(sorted(load_file(path).items()))
    return torch.load(path, weights_only=False)


def test_a_snapshot_s_directory_is_save_state_s_and_stock_load_state_restores_it_bit_exact(
        ckpt_dir, tmp_path):
    accelerator, model, opt, sched, loader = prepared()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, dataloader=loader,
                                state_dir=str(tmp_path / "state-{step}"),
                                heartbeat_interval=None) as engine:
        batches = iter(loader)
        counter.seen, accelerator.step = 5, 2
        train(accelerator, model, opt, sched, take(batches, 3), engine)  # mid-epoch: step 2
        expected = held(accelerator, model, opt, sched, counter)
        stock = str(tmp_path / "stock")
        Accelerator.save_state(accelerator, stock)  # Accelerate's own, at the same instant
        train(accelerator, model, opt, sched, batches)  # the state moves on
        engine.wait()
    ours = str(tmp_path / "state-2")
    assert sorted(os.listdir(ours)) == sorted(os.listdir(stock) + [POINTER_NAME])
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "scaler.pt",
            "dl_state_dict.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= set(
        os.listdir(stock))
    for name in os.listdir(stock):
        ours_file, stock_file = os.path.join(ours, name), os.path.join(stock, name)
        if name in ("random_states_0.pkl", "scaler.pt", "dl_state_dict.bin"):  # Accelerate's
            with open(ours_file, "rb") as a, open(stock_file, "rb") as b:
                assert a.read() == b.read(), name
        else:  # made by the writer
            assert_same(read_any(ours_file), read_any(stock_file), name)
    assert read_pointer(ours) == (os.path.realpath(ckpt_dir), 2)
    out = str(tmp_path / "loaded.pt")
    subprocess.run([sys.executable, "-c", STOCK_LOAD, ours, out], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    loaded = torch.load(out, weights_only=False)
    loaded["numpy"] = comparable(loaded["numpy"])
    assert_same(loaded, expected)


def test_save_state_and_load_state_go_through_the_engine_with_automatic_naming(tmp_path):
    project = tmp_path / "project"
    accelerator, model, opt, sched, loader = prepared(total_limit=2, project_dir=str(project))
    checkpoints = project / "checkpoints"
    with accelerate_ckpt.engine(accelerator, str(tmp_path / "engine"), model=model,
                                optimizer=opt, scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:
        assert accelerator.save_state == engine.save_state
        batches = iter(loader)
        train(accelerator, model, opt, sched, take(batches, 2), engine)  # checkpoint_0, _1
        assert accelerator.save_state() == str(checkpoints / "checkpoint_2")  # step 2
        at_2 = held(accelerator, model, opt, sched, Counter())
        expected = train(accelerator, model, opt, sched, batches)
        engine.wait()
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]  # total_limit
        assert engine.committed_steps() == [1, 2]
        assert accelerator.project_configuration.iteration == 3
        replaced = checkpoints / "checkpoint_2" / "model.safetensors"
        os.unlink(replaced)  # replaced, not rewritten in place: it is the snapshot's data file
        replaced.write_bytes(b"not a file")  # and not read:
        accelerator.load_state()  # the newest, from its snapshot, loader and RNG exactly back
        assert_same(held(accelerator, model, opt, sched, Counter()), at_2)
        assert train(accelerator, model, opt, sched, loader) == expected
    assert "save_state" not in vars(accelerator) and "load_state" not in vars(accelerator)
    accelerator, model, opt, sched, loader = prepared(total_limit=2, project_dir=str(project))
    with accelerate_ckpt.engine(accelerator, str(tmp_path / "engine"), model=model,
                                optimizer=opt, scheduler=sched, dataloader=loader,
                                heartbeat_interval=None) as engine:  # a resumed run
        assert accelerator.project_configuration.iteration == 3  # past checkpoint_2
        accelerator.load_state()
        assert_same(held(accelerator, model, opt, sched, Counter()), at_2)


def test_without_every_prepared_object_there_is_no_save_state_directory(ckpt_dir, tmp_path):
    accelerator, model, opt, sched, loader = prepared(project_dir=str(tmp_path / "project"))
    with pytest.raises(IntegrationError, match="give them all as optimizer="):
        accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, scheduler=sched,
                               state_dir=str(tmp_path / "s-{step}"))
    with pytest.raises(InvalidArgumentError, match="only {step}"):
        accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, state_dir="{epoch}")
    with pytest.warns(RuntimeWarning, match="stays Accelerate's own: load_state"):
        engine = accelerate_ckpt.engine(accelerator, ckpt_dir, model=model,
                                        heartbeat_interval=None)
    with engine:
        assert "save_state" not in vars(accelerator)
        engine.snapshot(0)
        engine.wait()
    assert not os.path.exists(tmp_path / "project" / "checkpoints")


def test_save_state_hooks_write_their_files_and_may_take_a_model_out(ckpt_dir, tmp_path):
    accelerator, model, opt, sched, loader = prepared()

    def hook(models, weights, output_dir):
        assert models == [model]
        torch.save({"ours": weights[0]["0.weight"]}, os.path.join(output_dir, "by_hook.pt"))
        weights.pop()  # saved its own way: save_state writes no model.safetensors

    accelerator.register_save_state_pre_hook(hook)
    with accelerate_ckpt.engine(accelerator, ckpt_dir, model=model, optimizer=opt,
                                scheduler=sched, heartbeat_interval=None) as engine:
        path = accelerator.save_state(str(tmp_path / "saved"))
        engine.wait()
        Accelerator.save_state(accelerator, str(tmp_path / "stock"))
    assert sorted(os.listdir(path)) == sorted(os.listdir(tmp_path / "stock") + [POINTER_NAME])
    assert "by_hook.pt" in os.listdir(path) and "model.safetensors" not in os.listdir(path)
    assert_same(torch.load(os.path.join(path, "by_hook.pt")), {"ours": model[0].weight.data})


def test_a_pointer_is_read_only_from_a_small_regular_file(tmp_path):
    assert read_pointer(str(tmp_path)) is None  # no pointer: a directory of Accelerate's own
    pointer = tmp_path / POINTER_NAME
    os.mkfifo(pointer)  # would block a plain open()
    with pytest.raises(PointerFileError, match="not a regular file"):
        read_pointer(str(tmp_path))
    os.unlink(pointer)
    for content in [b"{" + b" " * 5000 + b"}", b'{"format": 1, "step": -1, "directory": "x"}',
                    b'{"format": 1, "step": 1, "directory": 5}', b"\xff"]:
        pointer.write_bytes(content)
        with pytest.raises(PointerFileError, match="pointer"):
            read_pointer(str(tmp_path))
    pointer.write_bytes(b'{"format": 1, "step": 7, "directory": "../ckpt"}')  # an older version's
    assert read_pointer(str(tmp_path)) == (str(tmp_path.parent / "ckpt"), 7)


# --- real processes, killed ------------------------------------------------------------------

def loop(ckpt, log, *extra):
    return [LOOP, "--ckpt-dir", ckpt, "--losses", log, "--epochs", str(EPOCHS), *extra]


def steps_of(log):
    return [r for r in read_log(log) if "step" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    ckpt, log = str(root / "ckpt"), str(root / "loss.jsonl")
    assert run_killed(loop(ckpt, log)) == 0
    assert [r["step"] for r in steps_of(log)] == list(range(EPOCHS * BATCHES))
    return ckpt, {r["step"]: r for r in steps_of(log)}


@pytest.mark.slow
def test_killed_at_a_random_step_and_during_a_save_it_resumes_bit_identical(tmp_path,
                                                                             uninterrupted,
                                                                             seeded_random):
    ref_ckpt, reference = uninterrupted
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    kill_at = seeded_random.randrange(2, 2 * BATCHES)
    frozen_at = 3 * BATCHES - 4  # mid-epoch, after the first resume
    context = f"(SIGKILL after step {kill_at}; writer frozen at {frozen_at})"
    assert run_killed(loop(ckpt, log), kill_after_step=kill_at, log=log) == -signal.SIGKILL, context
    assert run_killed(loop(ckpt, log, "--freeze-writer-at", str(frozen_at))) == -signal.SIGKILL
    # Step frozen_at was staged, never written: nothing of it is restorable, the step before is.
    assert load(ckpt)[0] == frozen_at - 1, context
    assert run_killed(loop(ckpt, log)) == 0, context

    records = steps_of(log)
    assert {r["step"] for r in records} == set(reference), context
    for r in records:  # replayed steps included
        assert r == reference[r["step"]], f"step {r['step']} differs after a resume {context}"
    restored = [r["restored"] for r in read_log(log) if "restored" in r]
    assert restored[-1] == frozen_at - 1 and restored[-1] % BATCHES, context  # mid-epoch
    step, state = load(ckpt)
    assert step == load(ref_ckpt)[0] == EPOCHS * BATCHES - 1
    assert_same(load(ref_ckpt)[1], state)


@pytest.mark.slow
def test_two_ranks_under_torchrun_resume_bit_identical_after_a_kill_during_a_save(tmp_path):
    def torchrun(run, *extra):
        env = {**os.environ, "TORCH_GLOO_LAZY_INIT": "1"}  # gloo after a torchrun restart
        with open(tmp_path / f"{run}.out", "wb") as out:
            return subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=2", "--max-restarts=1", LOOP, "--ckpt-dir",
                 str(tmp_path / run), "--losses", str(tmp_path / f"{run}.jsonl"), "--epochs", "3",
                 *extra], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300).returncode

    assert torchrun("reference") == 0, (tmp_path / "reference.out").read_text()[-3000:]
    # Each rank freezes its writer before snapshot(6), then kills itself and its writer;
    # torchrun restarts both ranks, which resume from step 5 (epoch 1 of 4 batches per rank).
    assert torchrun("killed", "--freeze-writer-at", "6") == 0, \
        (tmp_path / "killed.out").read_text()[-3000:]
    for rank in range(2):
        reference = {r["step"]: r for r in steps_of(str(tmp_path / f"reference.jsonl.rank-{rank}"))}
        log = str(tmp_path / f"killed.jsonl.rank-{rank}")
        assert sorted(reference) == list(range(12))
        assert [r["restored"] for r in read_log(log) if "restored" in r] == [5]
        records = steps_of(log)
        assert len(records) == 12 + 1  # step 6 twice: 5 was committed, 6 staged, never written
        for r in records:
            assert r == reference[r["step"]], f"rank {rank}: step {r['step']} differs"
        assert_same(load(str(tmp_path / "killed"), rank=rank)[1],
                    load(str(tmp_path / "reference"), rank=rank)[1])


@pytest.mark.slow
def test_killed_during_a_save_it_leaves_no_directory_for_that_step(tmp_path):
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    template = str(tmp_path / "state" / "step_{step}")
    argv = [LOOP, "--ckpt-dir", ckpt, "--losses", log, "--epochs", "1", "--freeze-writer-at",
            "4", "--state-dir", template]
    assert run_killed(argv) == -signal.SIGKILL  # snapshot(4) staged, never written
    assert load(ckpt)[0] == 3
    assert sorted(os.listdir(tmp_path / "state")) == [f"step_{s}" for s in range(4)]
    assert read_pointer(template.format(step=3)) == (os.path.realpath(ckpt), 3)
