"""The DeepSpeed adapter (async_ckpt.integrations.deepspeed), with the real DeepSpeed on CPU.

ZeRO stages 1, 2 and 3 on two ranks (one torchrun program, all three stages side by side): a job
SIGKILLed with a save staged that one rank never wrote leaves ``latest`` naming the save before,
and none of the killed save's files, though rank 0's part of it was durable; resumed with
``load_checkpoint``, it trains on bit for bit as an uninterrupted run (losses, fp32 masters, Adam
moments; dropout draws from the RNG saved with it), and the ``zero_to_fp32.py`` DeepSpeed copied
beside the checkpoints consolidates it into exactly the loaded parameters. On one rank, in this
process: what a save writes, when, and what loading refuses.
"""

import fractions
import glob
import importlib.util
import json
import os
import pickle
import shutil
import signal
import socket
import zipfile

import pytest
import torch

pytest.importorskip("deepspeed")

from async_ckpt.errors import (CorruptSnapshotError, EncodingError,  # noqa: E402
                               IntegrationError, InvalidArgumentError, PointerFileError)
from async_ckpt.integrations.deepspeed import (DEEPSPEED_PICKLED, install,  # noqa: E402
                                               read_record)
from test_distributed import torchrun  # noqa: E402
from test_sharded import wait_torchrun  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "deepspeed_zero.py")
_spec = importlib.util.spec_from_file_location("deepspeed_zero", PROGRAM)
program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(program)  # its engines, steps and settings (no torchrun needed)


@pytest.mark.slow
def test_zero_1_2_3_killed_mid_save_resume_bit_exact(tmp_path):
    root = str(tmp_path)
    killed = torchrun(PROGRAM, 2, "--phase", "kill", "--root", root,
                      output=os.path.join(root, "kill.txt"))
    assert killed.wait(timeout=240) != 0  # every rank SIGKILLed itself
    with open(os.path.join(root, "kill.txt"), errors="replace") as f:
        assert "not killed" not in f.read()
    last = f"global_step{program.SAVED}"
    for stage in program.STAGES:
        save_dir = os.path.join(root, f"zero{stage}")
        with open(os.path.join(save_dir, "latest")) as f:
            assert f.read() == f"global_step{program.SAVED - program.EVERY}"
        assert glob.glob(os.path.join(save_dir, "async_ckpt", "step-*", "rank-00000.ackpt"))
        assert not os.path.exists(os.path.join(save_dir, last)), "a file of an uncommitted save"
    found = _wait_json(root)
    for rank, stages in enumerate(found):
        for stage, result in stages.items():
            where = f"ZeRO-{stage} rank {rank}"
            assert result["start"] == program.SAVED - program.EVERY, where
            assert result["losses_equal"], f"{where}: {result['resumed']} != {result['expected']}"
            assert result["state_equal"], where
            assert result["zero_to_fp32_equal"] in ((True,) if rank == 0 else (None,)), where


def _wait_json(root):
    out = os.path.join(root, "resume.json")
    log = os.path.join(root, "resume.txt")
    wait_torchrun(torchrun(PROGRAM, 2, "--phase", "resume", "--root", root, "--out", out, output=log), log)
    with open(out) as f:
        return json.load(f)


# --- one rank, in this process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    """torch.distributed of one process, as DeepSpeed needs it; taken down afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            patch.setenv(name, value)
        program.deepspeed.init_distributed(dist_backend="gloo")
        yield
        torch.distributed.destroy_process_group()


@pytest.fixture
def engine(one_rank):
    engine = program.make(2)
    program.train_step(engine)
    yield engine
    engine.destroy()


def test_files_appear_once_committed_and_latest_after_them(tmp_path, engine):
    """While the writer is stopped, a returned save has left nothing DeepSpeed would read; once
    committed, the tag's files are DeepSpeed files (``torch.load`` reads them, unpickling only
    DeepSpeed's objects) keeping a record of their snapshot, and ``latest`` names the tag."""
    ours = install(engine, tmp_path / "async_ckpt")
    writer = ours.engine.stats()["writer_pid"]
    os.kill(writer, signal.SIGSTOP)
    try:
        engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
        assert not os.path.exists(tmp_path / "global_step1")
        assert not os.path.exists(tmp_path / "latest")
    finally:
        os.kill(writer, signal.SIGCONT)
    ours.wait()
    assert (tmp_path / "latest").read_text() == "global_step1"
    files = sorted(os.listdir(tmp_path / "global_step1"))
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for name in files:
        record = read_record(str(tmp_path / "global_step1" / name))
        assert (record.step, record.rank, record.entry) == (0, 0, f"global_step1/{name}")
    with torch.serialization.safe_globals([c for c in DEEPSPEED_PICKLED if isinstance(c, type)]):
        with pytest.raises(pickle.UnpicklingError, match="pickle.loads"):  # nothing else unpickles
            torch.load(tmp_path / "global_step1" / files[1], weights_only=True)
        states = torch.load(tmp_path / "global_step1" / files[0], weights_only=True)
    assert states["epoch"] == 3 and states["global_steps"] == 1
    assert ours.load(str(tmp_path / "global_step1" / files[0]))["epoch"] == 3
    engine.save_16bit_model(str(tmp_path))  # through the same engine: there once committed
    ours.wait()
    weights = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in engine.module.state_dict().items())
    ours.close()
    assert "save_checkpoint" not in vars(engine) and engine.checkpoint_engine is not ours


def test_what_could_not_be_loaded_back_is_refused_at_the_save(tmp_path, engine):
    ours = install(engine, tmp_path / "async_ckpt")
    with pytest.raises(EncodingError, match=r"client.*names .*Fraction"):
        engine.save_checkpoint(str(tmp_path), client_state={"client": fractions.Fraction(1, 3)})
    with pytest.raises(IntegrationError, match="install"):  # DeepSpeed would write latest itself
        type(engine).save_checkpoint(engine, str(tmp_path))
    with pytest.raises(IntegrationError, match="already"):
        install(engine, tmp_path / "other")
    ours.close()
    with pytest.raises(InvalidArgumentError, match="every"):
        install(engine, tmp_path / "async_ckpt", every=2)


def test_files_without_a_snapshot_load_unpickling_deepspeed_s_objects_only(tmp_path, engine):
    """DeepSpeed's own files load (its objects unpickled by name); a file of a snapshot that
    retention dropped holds a nested pickle, loaded only with allow_pickle=True; a record that
    names another directory, or is damaged, is refused."""
    stock = tmp_path / "stock"
    engine.save_checkpoint(str(stock))  # DeepSpeed's own engine: torch.save
    ours = install(engine, tmp_path / "async_ckpt", keep_last=1)
    optim = "global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert ours.load(str(stock / optim))["optimizer_state_dict"]["zero_stage"] == 2
    engine.save_checkpoint(str(tmp_path), tag="first")
    engine.save_checkpoint(str(tmp_path), tag="second")
    ours.wait()
    dropped = str(tmp_path / "first" / optim.split("/")[1])
    with pytest.raises(EncodingError, match="allow_pickle=True"):
        ours.load(dropped)
    shutil.copytree(tmp_path / "second", tmp_path / "moved" / "second")
    with pytest.raises(PointerFileError, match="not into"):
        ours.load(str(tmp_path / "moved" / "second" / "mp_rank_00_model_states.pt"))
    damaged = tmp_path / "damaged.pt"
    with zipfile.ZipFile(damaged, "w") as z:
        z.writestr("archive/.data/async_ckpt", b'{"format": "async_ckpt.deepspeed", "step": -1}')
    with pytest.raises(PointerFileError, match="damaged"):
        ours.load(str(damaged))
    shutil.copy(stock / optim, tmp_path / "replacement")  # a re-save of the tag, killed midway
    os.replace(tmp_path / "replacement", tmp_path / "second" / optim.split("/")[1])
    with pytest.raises(CorruptSnapshotError, match="different saves"):
        engine.load_checkpoint(str(tmp_path), tag="second")
    ours.close()
    trusting = install(engine, tmp_path / "async_ckpt", allow_pickle=True)
    assert trusting.load(dropped)["optimizer_state_dict"]["zero_stage"] == 2
    trusting.close()
