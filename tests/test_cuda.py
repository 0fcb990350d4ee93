"""CUDA paths: pinned staging slots, side-stream device-to-host copies, restore onto the device.
Skipped on machines without a CUDA device."""

import time

import pytest
import torch

from async_ckpt import CheckpointEngine, load
from conftest import assert_same, bit_equal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_snapshot_is_an_image_even_when_kernels_modify_the_state_right_after(ckpt_dir):
    weights = torch.randn(64 << 20, device="cuda")  # 256 MB
    expected = weights.cpu()
    with CheckpointEngine(ckpt_dir, {"w": weights}) as engine:
        engine.snapshot(0)
        weights.mul_(-1.0)  # queued on the current stream right after snapshot() returned
        engine.wait()
        assert all(slot.pinned for slot in engine._pool.slots if slot.tensor is not None)
    assert bit_equal(load(ckpt_dir)[1]["w"], expected)


def test_model_and_optimizer_on_gpu_restore_onto_the_gpu(ckpt_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        engine.snapshot(1)
        engine.wait()
    fresh = torch.nn.Linear(256, 256).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with CheckpointEngine(ckpt_dir, {"model": fresh, "optimizer": fresh_opt}) as engine:
        assert engine.restore() == 1
    assert fresh.weight.is_cuda
    assert_same({k: v.cpu() for k, v in model.state_dict().items()},
                {k: v.cpu() for k, v in fresh.state_dict().items()})
    assert fresh_opt.state[fresh.weight]["exp_avg"].is_cuda


def test_report_device_to_host_bandwidth_and_blocking_time(ckpt_dir):
    """Not a pass/fail threshold: prints the figures the core-engine issue asks for."""
    weights = torch.randn(256 << 20, device="cuda")  # 1 GiB
    with CheckpointEngine(ckpt_dir, {"w": weights}, keep_last=1) as engine:
        for step in range(4):
            engine.snapshot(step)
            engine.wait()
        records = engine.stats()["snapshots"][1:]
    pinned = torch.empty(weights.numel(), dtype=torch.float32, pin_memory=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    pinned.copy_(weights, non_blocking=True)
    torch.cuda.synchronize()
    floor = time.perf_counter() - t
    nbytes = weights.numel() * 4
    staging = sorted(r["staging_s"] for r in records)[len(records) // 2]
    blocking = sorted(r["blocking_s"] for r in records)[len(records) // 2]
    print(f"\nD2H into pinned slot: {nbytes / staging / 1e9:.1f} GB/s; plain pinned copy_: "
          f"{nbytes / floor / 1e9:.1f} GB/s; median blocking {blocking * 1e3:.1f} ms "
          f"({blocking / floor:.2f}x the copy)")
    assert staging > 0 and blocking >= staging


def test_lazy_staging_on_cuda_fences_the_step_and_commits_the_image(ckpt_dir):
    """The device-to-host copy of a lazy snapshot runs on the side stream while the compute
    stream runs the next forward and backward (queued right after snapshot()); the optimizer's
    step waits for it (the fence); the snapshot is the state at the snapshot() call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.BatchNorm1d(4096)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8192, 4096, device="cuda")
    model(x).sum().backward()
    opt.step()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}, staging="lazy") as engine:
        engine.snapshot(0)
        staged = engine._staging
        model(x).sum().backward()  # batch-norm statistics change: they were copied at once
        assert staged is not None
        opt.step()  # the fence: the copy is done before the weights change
        assert all(e.query() for e in staged.copy._events)
        engine.wait()
        assert all(slot.pinned for slot in engine._pool.slots if slot.tensor is not None)
    assert_same(load(ckpt_dir)[1]["model"], expected)
