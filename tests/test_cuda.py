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


def test_many_small_tensors_views_and_low_precision_dtypes_round_trip(ckpt_dir):
    """Hundreds of small regions (one side-stream copy each), non-contiguous views sharing a
    storage, and every 16- and 8-bit float dtype this torch has."""
    torch.manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16] + [getattr(torch, n) for n in (
        "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    state = {f"t{i}": torch.randn(17 + i, device="cuda").to(dtypes[i % len(dtypes)])
             for i in range(300)}
    base = torch.randn(64, 48, device="cuda")
    state.update(base=base, transposed=base.t(), strided=base[::3, 5:40:2])
    expected = {k: v.cpu() for k, v in state.items()}
    with CheckpointEngine(ckpt_dir, {"s": state}) as engine:
        engine.snapshot(0)
        for v in state.values():
            v.zero_()  # queued right after the snapshot: must not reach it
        engine.wait()
    restored = load(ckpt_dir)[1]["s"]
    for key, value in expected.items():
        assert restored[key].dtype == value.dtype and bit_equal(restored[key], value), key
    assert restored["transposed"].untyped_storage().data_ptr() == \
        restored["base"].untyped_storage().data_ptr()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_tensor_on_the_second_device_is_staged_from_it_and_restored_onto_it(ckpt_dir):
    state = {"a": torch.randn(1 << 20, device="cuda:0"), "b": torch.randn(1 << 20, device="cuda:1")}
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointEngine(ckpt_dir, {"s": state}) as engine:
        engine.snapshot(0)
        state["b"].mul_(2)
        engine.wait()
        engine.restore()
    assert state["b"].device == torch.device("cuda:1")
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_cuda_rng_of_every_device_is_restored(ckpt_dir):
    weights = torch.randn(1024, device="cuda")
    with CheckpointEngine(ckpt_dir, {"w": weights}) as engine:
        engine.snapshot(0)
        engine.wait()
        expected = [torch.rand(16, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
        engine.restore()
        again = [torch.rand(16, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(expected, again))


def test_restore_onto_the_device_reads_into_a_pinned_slot_and_is_bit_exact(ckpt_dir):
    """A fresh engine (no slot yet) restoring a model and fused AdamW on the device: the read
    goes into a page-locked slot; the values land bit for bit, on the device, in the tensors
    the model and optimizer held."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024)).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for _ in range(2):
        model(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    expected = [t.clone() for t in list(model.parameters())
                + [s for p in model.parameters() for s in opt.state[p].values()]]
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        engine.snapshot(1)
    homes = [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            for s in opt.state[p].values():
                s.zero_()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        assert engine.restore() == 1
        assert any(slot.pinned for slot in engine._pool.slots)
        assert engine.stats()["pin_failures"] == 0
    got = list(model.parameters()) + [s for p in model.parameters() for s in opt.state[p].values()]
    assert all(a.device == b.device and torch.equal(a, b) for a, b in zip(got, expected))
    assert [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()] == homes


def test_lazy_staging_overlaps_a_real_step_and_compiled_steps_between_snapshots(ckpt_dir):
    """Lazy snapshots every step of a torch.compile'd model: each copy runs on the side stream
    while the next forward and backward run on the compute stream, the optimizer's step waits
    for it, and every committed snapshot is the state at its snapshot() call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    x = torch.randn(256, 512, device="cuda")
    expected = {}
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}, staging="lazy",
                          keep_last=4) as engine:
        for step in range(4):
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            expected[step] = {k: v.cpu() for k, v in model.state_dict().items()}
            engine.snapshot(step)
        engine.wait()
        assert engine.stats()["failed"] == 0
    for step, state in expected.items():
        assert_same(load(ckpt_dir, step=step)[1]["model"], state)


def test_a_cuda_graph_replay_between_snapshots_is_in_the_next_snapshot(ckpt_dir):
    w = torch.randn(4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w.add_(1)  # warm-up on a side stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.mul_(2)
    with CheckpointEngine(ckpt_dir, {"w": w}, keep_last=2) as engine:
        engine.snapshot(0)
        graph.replay()
        expected = w.cpu()
        engine.snapshot(1)
        engine.wait()
    assert bit_equal(load(ckpt_dir, step=1)[1]["w"], expected)


def _sharded_under_nccl(rank: int, world_size: int, ckpt_dir: str, store_path: str) -> None:
    """One rank of a DTensor sharded over one device per rank under NCCL: saved, zeroed,
    restored onto its device bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            store=dist.FileStore(store_path, world_size))
    try:
        mesh = init_device_mesh("cuda", (world_size,))
        torch.manual_seed(0)  # the same full tensor on every rank
        full = torch.randn(64, 32, device="cuda")
        sharded = distribute_tensor(full.clone(), mesh, [Shard(0)])
        with CheckpointEngine(ckpt_dir, {"s": {"w": sharded}}) as engine:
            engine.snapshot(0)
            engine.wait()
            sharded.to_local().zero_()
            assert engine.restore() == 0
        assert sharded.to_local().device == torch.device("cuda", rank)
        assert torch.equal(sharded.full_tensor(), full)
    finally:
        dist.destroy_process_group()


def test_the_sharded_path_with_nccl_on_one_device(ckpt_dir, tmp_path):
    """World size 1 (two devices: the next test)."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    _sharded_under_nccl(0, 1, str(ckpt_dir), str(tmp_path / "store"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_sharded_path_with_nccl_on_two_devices(ckpt_dir, tmp_path):
    """Two ranks, one device each, a DTensor sharded across them under NCCL: each rank stages
    its piece from its own device and restores it there, bit for bit."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    mp.spawn(_sharded_under_nccl, args=(2, str(ckpt_dir), str(tmp_path / "store")), nprocs=2)


def test_a_cuda_source_freed_while_its_copy_is_queued_keeps_its_memory_until_the_copy_ran():
    """The side stream's copy waits behind the compute stream's queued work; a source freed
    meanwhile is not handed to the next allocation (which the compute stream writes at once)
    before the copy has read it."""
    from async_ckpt.train.capture import Planner
    from async_ckpt.train.staging import StagingPool

    pool = StagingPool(1)
    try:
        source = torch.randn(16 << 20, device="cuda")
        expected = source.cpu().view(torch.uint8)
        plan, sources = Planner().plan([source])
        slot = pool.free_slot()
        pool.fit(slot, plan, pin=True)
        assert slot.pinned  # else the copy is synchronous, and there is no race to lose
        torch.cuda._sleep(100_000_000)  # the compute stream stays busy: the copy waits
        copy = pool.start(plan, sources, slot)
        del source, sources
        torch.empty(16 << 20, device="cuda").fill_(7.0)  # queued before the copy can run
        copy.wait()
        region = plan.regions[0]
        assert torch.equal(slot.tensor[region.offset:region.offset + region.nbytes], expected)
    finally:
        pool.close()
