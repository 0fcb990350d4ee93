"""AsyncCkptTrainer (async_ckpt.integrations.transformers) with the real Hugging Face Trainer, on
a tiny GPT-2 built from a config (tests/programs/hf_trainer.py; nothing is downloaded).

A run killed with SIGKILL mid-epoch at a random step, or while a save is in flight, and resumed
with ``train(resume_from_checkpoint=True)`` logs the same loss, learning rate and gradient norm
at every step as an uninterrupted run, bit for bit; ``checkpoint-N`` exists only for committed
steps; a damaged newest snapshot falls back to the previous one (an explicit path raises);
``save_total_limit`` and ``load_best_model_at_end`` behave as with the stock Trainer."""

import glob
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import async_ckpt.integrations.transformers as hf  # noqa: E402
from async_ckpt import load  # noqa: E402
from async_ckpt.errors import IntegrationError, NoSnapshotError, PointerFileError  # noqa: E402
from async_ckpt.integrations.transformers import POINTER_NAME, AsyncCkptTrainer  # noqa: E402
from conftest import assert_same  # noqa: E402
from programs.hf_trainer import STEPS, THREADS, GlobalRNGTokenData, build_trainer  # noqa: E402
from test_resume import read_log  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "hf_trainer.py")


def run(output_dir, log, *extra, kill_when=None):
    """Run the program in its own session; with ``kill_when``, SIGKILL the session (the writer
    too) as soon as ``kill_when()`` holds. Returns the exit code."""
    process = subprocess.Popen([sys.executable, PROGRAM, "--output-dir", output_dir, "--log", log,
                                *extra], start_new_session=True, stdout=subprocess.DEVNULL)
    while kill_when is not None and process.poll() is None:
        if kill_when():
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    return process.wait(timeout=300)


def checkpoint_steps(output_dir):
    return sorted(int(name.split("-")[1]) for name in os.listdir(output_dir)
                  if name.startswith("checkpoint-"))


def snapshot_steps(output_dir):
    with open(os.path.join(hf.default_engine_dir(output_dir), "manifest.json")) as f:
        return sorted({r["step"] for r in json.load(f)["snapshots"]})


@pytest.fixture(scope="module", autouse=True)
def threads():
    """As many threads as the program uses: the reference run here must compute as it does."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run, in this process (as the program's main() runs it)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    output_dir, log = str(root / "out"), str(root / "loss.jsonl")
    train_in_process(output_dir, log=log)
    reference = {r["step"]: r for r in read_log(log)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    return output_dir, reference


@pytest.mark.slow
def test_killed_in_a_save_and_at_a_random_step_mid_epoch_resumes_bit_identical(tmp_path,
                                                                                uninterrupted,
                                                                                seeded_random):
    ref_dir, reference = uninterrupted
    output_dir, log = str(tmp_path / "out"), str(tmp_path / "loss.jsonl")
    # Killed while the save of step 20 is in flight: no checkpoint-20, nothing half-written.
    assert run(output_dir, log, "--freeze-writer-at", "20") == -signal.SIGKILL
    assert checkpoint_steps(output_dir) == snapshot_steps(output_dir) == [5, 10, 15]
    assert [n for n in os.listdir(output_dir) if n.startswith(".")] == []  # no temporaries

    # Resumed mid-epoch from checkpoint-15 (12 steps an epoch), killed at a random step once
    # that run committed its own checkpoint-20, in the same epoch.
    kill_after = seeded_random.randrange(20, 25)

    def after_checkpoint_20():
        logged = read_log(log)
        return logged[-1]["step"] >= kill_after and 20 in checkpoint_steps(output_dir)

    assert run(output_dir, log, kill_when=after_checkpoint_20) == -signal.SIGKILL, kill_after
    assert read_log(log)[20]["step"] == 16  # the second run started after checkpoint-15
    resumed_from = checkpoint_steps(output_dir)[-1]
    build_trainer(output_dir, log=log).train(resume_from_checkpoint=True)  # here: as the program

    records = read_log(log)
    assert {r["step"] for r in records} == set(reference)
    for r in records:  # replayed steps included
        assert r == reference[r["step"]], f"step {r['step']} differs (killed after {kill_after})"
    assert records[len(records) - (STEPS - resumed_from)]["step"] == resumed_from + 1
    (_, state), (_, expected) = (load(hf.default_engine_dir(d)) for d in (output_dir, ref_dir))
    del state["rng"], expected["rng"]  # set by the runs' last steps: the same, as the losses show
    assert_same(state, expected)
    assert checkpoint_steps(output_dir) == snapshot_steps(output_dir) == checkpoint_steps(ref_dir)


def train_in_process(output_dir, trainer_class=AsyncCkptTrainer, log=None, **arguments):
    trainer = build_trainer(output_dir, trainer_class, log, **arguments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer.train()
    return trainer


@pytest.mark.parametrize("seedable, staging", [(True, "eager"), (False, "eager"), (True, "lazy")],
                         ids=["seedable-sampler", "global-rng-sampler", "lazy-staging"])
def test_a_mid_epoch_resume_in_a_later_epoch_is_exact(tmp_path, seedable, staging):
    """accelerate's seedable sampler (the default) orders an epoch by its number, but its
    skipping loader does not pass the epoch on to the dataset; the other sampler draws the order
    from the global RNG at the epoch's start. Both are replayed; so with lazy staging."""
    settings = dict(accelerator_config={"use_seedable_sampler": seedable},
                    engine_options={"staging": staging})
    ref_dir, ref_log = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    train_in_process(ref_dir, log=ref_log, **settings)
    output_dir, log = str(tmp_path / "out"), str(tmp_path / "loss.jsonl")
    # step 1 of epoch 2's 12; its pointer names the reference run's snapshots, beside ref_dir
    shutil.copytree(os.path.join(ref_dir, "checkpoint-25"),
                    os.path.join(output_dir, "checkpoint-25"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn about: it is exact
        build_trainer(output_dir, log=log, **settings).train(resume_from_checkpoint=True)
    reference = {r["step"]: r for r in read_log(ref_log)}
    assert read_log(log) == [reference[step] for step in range(26, STEPS + 1)]


def test_a_damaged_newest_snapshot_falls_back_and_a_named_one_raises(tmp_path):
    output_dir = str(tmp_path / "out")
    train_in_process(output_dir, max_steps=10)
    assert checkpoint_steps(output_dir) == [5, 10]
    for path in glob.glob(os.path.join(hf.default_engine_dir(output_dir), f"step-{10:020d}.*",
                                       "*")):
        os.truncate(path, os.path.getsize(path) // 2)

    log = str(tmp_path / "loss.jsonl")
    with pytest.warns(RuntimeWarning, match="checkpoint-10") as caught:
        build_trainer(output_dir, log=log, max_steps=10).train(resume_from_checkpoint=True)
    assert [r["step"] for r in read_log(log)] == [6, 7, 8, 9, 10]  # from checkpoint-5
    assert len(caught) == 1  # and nothing about the data: it resumes exactly

    with pytest.raises(PointerFileError):  # the newest is whole again; corrupt its pointer
        with open(os.path.join(output_dir, "checkpoint-10", POINTER_NAME), "w") as f:
            f.write("{")
        build_trainer(output_dir, max_steps=10).train(
            resume_from_checkpoint=os.path.join(output_dir, "checkpoint-10"))
    for step in (5, 10):
        os.remove(os.path.join(output_dir, f"checkpoint-{step}", "trainer_state.json"))
    with pytest.raises(NoSnapshotError), pytest.warns(RuntimeWarning):
        build_trainer(output_dir, max_steps=10).train(resume_from_checkpoint=True)


def test_what_a_mid_epoch_resume_cannot_replay_is_warned_about(tmp_path):
    output_dir = str(tmp_path / "out")
    train_in_process(output_dir, max_steps=7)  # checkpoint-5, in the first epoch
    with pytest.warns(RuntimeWarning, match="fetching the first batch drew random numbers"):
        build_trainer(output_dir, data=GlobalRNGTokenData, max_steps=7).train(
            resume_from_checkpoint=True)
    with pytest.warns(RuntimeWarning, match="dataloader_num_workers=2"):
        build_trainer(output_dir, max_steps=7, dataloader_num_workers=2).train(
            resume_from_checkpoint=True)


def test_retention_the_best_model_and_the_listing_as_with_the_stock_trainer(tmp_path):
    settings = dict(max_steps=14, save_steps=2, save_total_limit=2, eval_strategy="steps",
                    eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                    greater_is_better=True)  # the worst loss: the best is an old checkpoint
    runs = {}
    for name, cls in (("stock", transformers.Trainer), ("async", AsyncCkptTrainer)):
        output_dir = str(tmp_path / name)
        trainer = build_trainer(output_dir, cls, **settings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            trainer.train()
        runs[name] = output_dir, trainer
    (stock_dir, stock), (async_dir, trained) = runs["stock"], runs["async"]
    best = os.path.basename(stock.state.best_model_checkpoint)
    assert best != "checkpoint-14" and checkpoint_steps(async_dir) == checkpoint_steps(stock_dir)
    # output_dir lists what the stock Trainer's does: the engine's directory is beside it
    assert sorted(os.listdir(async_dir)) == sorted(os.listdir(stock_dir))
    assert os.path.isdir(trained.async_ckpt_dir) and not trained.async_ckpt_dir.startswith(
        async_dir + os.sep)
    assert os.path.basename(trained.state.best_model_checkpoint) == best
    assert snapshot_steps(async_dir) == checkpoint_steps(async_dir)
    assert timeless(trained.state.log_history) == timeless(stock.state.log_history)
    assert_same(trained.model.state_dict(), stock.model.state_dict())  # the best model, loaded


def timeless(log_history):
    return [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
            for h in log_history]


def test_unsupported_settings_fall_back_to_the_trainers_own_checkpoints(tmp_path):
    output_dir = str(tmp_path / "out")
    with pytest.warns(RuntimeWarning, match="save_only_model"):
        trainer = build_trainer(output_dir, max_steps=5, save_only_model=True)
    trainer.train()
    assert trainer.async_ckpt_dir is None
    assert not os.path.exists(hf.default_engine_dir(output_dir))
    assert "model.safetensors" in os.listdir(os.path.join(output_dir, "checkpoint-5"))
    with pytest.raises(ValueError, match="save_total_limit"):
        AsyncCkptTrainer(model=trainer.model, args=trainer.args,
                         async_ckpt_options={"keep_last": 2})


def test_a_changed_trainer_is_refused_and_another_version_warned_about(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    hf._check_transformers()  # inside the range: silent
    monkeypatch.setattr(transformers, "__version__", "6.1.0")
    with pytest.warns(RuntimeWarning, match=">=5.25,<6"):
        hf._check_transformers()
    monkeypatch.delattr(transformers.Trainer, "_load_rng_state")
    with pytest.raises(IntegrationError, match="_load_rng_state"):
        hf._check_transformers()


def test_without_transformers_the_import_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "async_ckpt.integrations.transformers")
    with pytest.raises(IntegrationError, match=r"async_ckpt\[transformers\]"):
        importlib.import_module("async_ckpt.integrations.transformers")


def test_nothing_in_the_library_imports_the_integrations():
    from test_architecture import GRAPH

    importers = {m for m, imports in GRAPH.items() if not m.startswith("async_ckpt.integrations")
                 and any(i.startswith("async_ckpt.integrations") for i in imports)}
    assert importers == set()


def test_checkpoint_n_holds_the_stock_trainer_s_files_and_a_stock_trainer_resumes_from_it(
        tmp_path):
    """Each checkpoint-N the adapter writes holds the files the stock Trainer writes, with the
    same contents: from_pretrained, safetensors and torch.load read them without async_ckpt,
    and a stock Trainer resumes from one as from its own."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    settings = dict(max_steps=8, save_steps=4, accelerator_config={"use_seedable_sampler": True})
    for name, cls in (("stock", transformers.Trainer), ("async", AsyncCkptTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            build_trainer(str(tmp_path / name), cls, **settings).train()
    for step in (4, 8):
        stock, ours = tmp_path / "stock" / f"checkpoint-{step}", tmp_path / "async" / f"checkpoint-{step}"
        assert sorted(os.listdir(ours)) == sorted(os.listdir(stock) + [POINTER_NAME])
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert_same(without_arrays(torch.load(ours / name, weights_only=False)),
                        without_arrays(torch.load(stock / name, weights_only=False)), name)
        assert (torch.load(ours / "training_args.bin", weights_only=False).to_dict()
                == torch.load(stock / "training_args.bin", weights_only=False).to_dict()
                | {"output_dir": str(tmp_path / "async")})
        assert_same(dict(sorted(safetensors_torch.load_file(ours / "model.safetensors").items())),
                    dict(sorted(safetensors_torch.load_file(stock / "model.safetensors").items())))
        model = transformers.GPT2LMHeadModel.from_pretrained(str(ours))
        assert_same(model.state_dict(),
                    transformers.GPT2LMHeadModel.from_pretrained(str(stock)).state_dict())
    resumed = build_trainer(str(tmp_path / "resumed"), transformers.Trainer, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        resumed.train(resume_from_checkpoint=str(tmp_path / "async" / "checkpoint-4"))
    final = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "stock" / "checkpoint-8"))
    assert_same(resumed.model.state_dict(), final.state_dict())


def without_arrays(value):
    """``value`` with its numpy arrays as tensors (an RNG state), for ``assert_same``."""
    if isinstance(value, dict):
        return {k: without_arrays(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(without_arrays(v) for v in value)
    return torch.from_numpy(value) if type(value).__module__ == "numpy" and value.ndim else value
