"""torchtitan's checkpointing on async_ckpt (async_ckpt/integrations/torchtitan.py), driven through
torchtitan's own ``CheckpointManager`` API and containers (``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``) as its trainer drives them.

Proves, in one process: the config refuses what the manager cannot do when it is built; saves
follow torchtitan's policy (interval, last step model-only in ``export_dtype``, ``keep_latest_k``)
and a model-only last checkpoint refuses a full resume as torchtitan's does; a DCP checkpoint
torchtitan's manager wrote loads through ``initial_load_path`` (model only, or everything) and
our export loads with torchtitan's manager, exactly. Under torchrun (tests/programs/
torchtitan_job.py, FSDP2 on CPU ranks): 2 ranks SIGKILLed mid-run resume bit-exact; torchtitan's
DCP checkpoints in the folder import exactly; the export keeps every rank's data position; 4 ranks
restore the 2-rank snapshot, import torchtitan's 2-rank DCP checkpoint and load our export with
torchtitan's ``"async"`` manager exactly with ``exclude_from_loading=["dataloader"]``; without
it the 2-rank checkpoints are refused by name (in one process). torchtitan is an optional extra
(not in ``test``: .ci/run tests it in an environment of its own); everything here skips without
it."""

import json
import os

import pytest
import torch

pytest.importorskip("torchtitan")

from async_ckpt.storage.local import LocalStorage  # noqa: E402
from async_ckpt import load  # noqa: E402
from async_ckpt.errors import (CheckpointDirError, InvalidArgumentError, NoSnapshotError,  # noqa: E402
                               StateMismatchError, UnsupportedOptionError,
                               WorldSizeMismatchError)
from async_ckpt.format.manifest import read_manifest  # noqa: E402
from async_ckpt.integrations.torchtitan import AsyncCkptCheckpointManager, export_dcp  # noqa: E402
from programs.torchtitan_job import IMPORT_AT, STEPS, Job, ours, same, torchtitans  # noqa: E402
from test_distributed import read_log, torchrun  # noqa: E402
from test_sharded import wait_torchrun  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "programs", "torchtitan_job.py")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                                        "ignore:To get the last learning rate",
                                        "ignore:.set_vital. is deprecated")


@pytest.mark.parametrize("options, error, words", [
    ({"last_save_in_hf": True}, UnsupportedOptionError, "Hugging Face"),
    ({"folder": "s3://bucket/ckpt"}, UnsupportedOptionError, "remote"),
    ({"engine_options": {"keep_last": 4}}, UnsupportedOptionError, "keep_last"),
    ({"engine_options": {"slots": 0}}, InvalidArgumentError, "slots"),
    ({"engine_options": {"no_such_option": 1}}, InvalidArgumentError, "no_such_option"),
    ({"async_mode": "sometimes"}, InvalidArgumentError, "async_mode"),
])
def test_the_config_refuses_what_the_manager_cannot_do_when_it_is_built(options, error, words):
    with pytest.raises(error, match=words):
        AsyncCkptCheckpointManager.Config(enable=True, **options)


def test_saves_follow_torchtitans_policy_and_a_model_only_last_save_refuses_a_resume(tmp_path):
    job = Job()
    with pytest.raises(InvalidArgumentError, match="exclude_from_loading names optimiser"):
        job.manager(ours(exclude_from_loading=["optimiser"]), str(tmp_path))
    checkpointer = job.manager(ours(async_mode="async", last_save_model_only=True,
                                    export_dtype="bfloat16"), str(tmp_path))
    assert checkpointer.save(1) is False and checkpointer.save_future is None  # not at interval
    job.train(checkpointer)
    assert checkpointer.save_future is None  # the last save is committed when it returns
    checkpointer.close()
    folder = str(tmp_path / "ckpt")
    assert read_manifest(LocalStorage(folder)).steps() == [10, 12]  # keep_latest_k=2 of 2, 4, ..., 12
    step, last = load(folder)
    assert step == STEPS and set(last) == {"model"}
    assert {t.dtype for t in last["model"].values()} == {torch.bfloat16}
    assert set(load(folder, 10)[1]) == {"model", "optimizer", "lr_scheduler", "dataloader",
                                         "train_state"}

    resumed = Job(seed=1)
    checkpointer = resumed.manager(ours(), str(tmp_path))
    with pytest.raises(StateMismatchError, match="missing from the checkpoint"):
        checkpointer.load()  # as torchtitan's own manager fails on its model-only last save
    with pytest.raises(NoSnapshotError, match="load_step=11"):
        checkpointer.load(step=11)
    assert checkpointer.load(step=10) and resumed.train_state.step == 10
    # an asynchronous save is in flight until maybe_wait_for_saving()
    resumed.train_state.step = 0
    assert checkpointer.save(2) and checkpointer.save_future is not None
    checkpointer.maybe_wait_for_saving()
    assert checkpointer.save_future is None and 2 in checkpointer.engine.committed_steps()
    checkpointer.close()


def test_torchtitans_dcp_checkpoint_loads_through_initial_load_path_and_ours_exports_back(
        tmp_path):
    titan = Job()
    stock = titan.manager(torchtitans(async_mode="disabled"), str(tmp_path / "titan"))
    titan.train(stock)
    stock.close()
    saved, dcp = titan.full_state(), str(tmp_path / "titan" / "ckpt" / f"step-{STEPS}")

    model_only = Job(seed=1)  # other weights: what loads shows
    checkpointer = model_only.manager(ours(initial_load_path=dcp), str(tmp_path / "a"))
    assert checkpointer.load()
    assert same(saved["model"], model_only.full_state()["model"])
    assert model_only.train_state.step == 0 and model_only.lr_schedulers.state_dict() == {
        "last_epoch": 0}
    checkpointer.close()

    everything = Job(seed=1)
    checkpointer = everything.manager(ours(initial_load_path=dcp, initial_load_model_only=False),
                                      str(tmp_path / "b"))
    assert checkpointer.load()
    assert same(saved, everything.full_state())
    assert everything.dataloader.state_dict() == titan.dataloader.state_dict()
    everything.train_state.step = STEPS + 1
    checkpointer.save(STEPS + 1, last_step=True)  # a full last save: keep it resumable
    checkpointer.close()
    assert not os.path.exists(tmp_path / "b" / ".ckpt.import")  # the scratch import is gone

    # an async_ckpt directory as initial_load_path; a path that is neither is refused
    again = Job(seed=1)
    checkpointer = again.manager(ours(initial_load_path=str(tmp_path / "b" / "ckpt")),
                                 str(tmp_path / "c"))
    assert checkpointer.load() and same(saved["model"], again.full_state()["model"])
    checkpointer.close()
    checkpointer = again.manager(ours(initial_load_path=str(tmp_path)), str(tmp_path / "d"))
    with pytest.raises(CheckpointDirError, match="neither a DCP checkpoint"):
        checkpointer.load()
    checkpointer.close()

    # ours as DCP: torchtitan's manager finds it in its folder and loads it
    os.makedirs(tmp_path / "e" / "ckpt")
    assert export_dcp(tmp_path / "b" / "ckpt", tmp_path / "e" / "ckpt" / "step-13") == STEPS + 1
    exported = Job(seed=1)
    stock = exported.manager(torchtitans(async_mode="disabled"), str(tmp_path / "e"))
    assert stock.load()
    assert exported.train_state.step == STEPS + 1
    assert same(saved["model"], exported.full_state()["model"])
    assert exported.dataloader.state_dict() == titan.dataloader.state_dict()
    stock.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_with_pinned_mem_stages_from_the_gpu_into_pinned_memory(tmp_path):
    job = Job(device="cuda")
    checkpointer = job.manager(ours(async_mode="async_with_pinned_mem", last_save_model_only=False),
                               str(tmp_path))
    job.train(checkpointer)
    checkpointer.close()
    saved = job.full_state()
    stats = checkpointer.engine.stats()
    assert stats["pin_failures"] == 0 and stats["committed"] == STEPS // 2
    resumed = Job(seed=1, device="cuda")
    checkpointer = resumed.manager(ours(async_mode="async_with_pinned_mem"), str(tmp_path))
    assert checkpointer.load() and same(saved, resumed.full_state())
    assert resumed.model[0].weight.is_cuda
    checkpointer.close()


# --- under torchrun ------------------------------------------------------------------------------

def run_phase(root, nproc, phase, restarts=0, timeout=240):
    log = os.path.join(root, f"{phase}.txt")
    wait_torchrun(torchrun(PROGRAM, nproc, "--root", root, "--phase", phase,
                           max_restarts=restarts, output=log), log, timeout)
    with open(os.path.join(root, f"{phase}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torchtitan"))
    return root, run_phase(root, 2, "train", restarts=1)


@pytest.mark.slow
def test_two_ranks_killed_mid_run_resume_bit_exact_and_dcp_moves_both_ways(trained):
    root, found = trained
    for rank, r in enumerate(found):
        reference = {int(step): loss for step, loss in r["losses"].items()}
        logged = read_log(os.path.join(root, "run"), rank)
        attempts = {line["attempt"] for line in logged}
        assert attempts == {0, 1}, "rank 1 was not killed, or the job was not restarted"
        assert r["loaded"] and r["resumed_from"] in (4, 6)  # the newest committed before the kill
        assert all(line["loss"] == reference[line["step"]] for line in logged), rank
        assert {line["step"] for line in logged} == set(reference)
        assert r["same_final_state"] and r["same_loader_state"], rank
        # torchtitan's own DCP step-6 in the folder, imported: training goes on exactly alike
        assert r["imported_at"] == IMPORT_AT
        assert {int(s): v for s, v in r["losses_after_import"].items()} == {
            s: v for s, v in reference.items() if s > IMPORT_AT}
        assert r["export_loads_exactly"] and r["export_keeps_loader"], rank
    assert read_manifest(LocalStorage(os.path.join(root, "run", "ckpt"))).steps() == [10, 12]  # keep_latest_k
    # the folder with torchtitan's checkpoints: ours kept 2, its DCP directories all stay
    reference_folder = os.path.join(root, "reference", "ckpt")
    assert read_manifest(LocalStorage(reference_folder)).steps() == [10, 12]
    assert {f"step-{s}" for s in range(2, STEPS + 1, 2)} <= set(os.listdir(reference_folder))


@pytest.mark.slow
def test_the_data_loaders_positions_cannot_follow_another_world_size(trained):
    """Refused by name, nothing loaded, unless excluded from loading: the 2-rank snapshot and
    torchtitan's 2-rank DCP checkpoint in one process."""
    root, _ = trained
    job = Job(seed=1)
    before = job.full_state()["model"]
    dcp = os.path.join(root, "reference", "ckpt", f"step-{STEPS}")
    for config, base_folder in ((ours(), os.path.join(root, "run")),
                                (ours(initial_load_path=dcp, initial_load_model_only=False,
                                      folder="imported"), root)):
        checkpointer = job.manager(config, base_folder)
        with pytest.raises(WorldSizeMismatchError, match="exclude_from_loading"):
            checkpointer.load()
        checkpointer.close()
        assert job.train_state.step == 0 and same(before, job.full_state()["model"])


@pytest.mark.slow
def test_four_ranks_reshard_the_two_rank_checkpoints_exactly(trained):
    root, _ = trained
    for r in run_phase(root, 4, "reshard"):
        assert r["resharded_exactly"]  # our 2-rank snapshot on 4 ranks
        assert r["import_reshards_exactly"]  # torchtitan's 2-rank DCP through ours on 4 ranks
        assert r["export_reshards_exactly"]  # our export through torchtitan's "async" manager
