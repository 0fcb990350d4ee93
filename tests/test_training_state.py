"""The pieces of a training state beyond weights: AMP scaler, warm-up and one-cycle schedules, EMA.
Each is checked by restoring into fresh objects and training on: the continuation must be identical."""

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from async_ckpt import CheckpointEngine
from conftest import assert_same


def build(schedule: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if schedule == "warmup":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "ema": ema}


def run(state, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = state["model"](x).pow(2).mean()
        state["scaler"].scale(loss).backward()
        state["scaler"].step(state["optimizer"])
        state["scaler"].update()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
        state["ema"].update_parameters(state["model"])
        losses.append(loss.item())
    return losses


def snapshot_of(state):
    return copy.deepcopy({k: v.state_dict() for k, v in state.items()})


@pytest.mark.parametrize("schedule", ["warmup", "onecycle"])
def test_scaler_schedules_and_ema_continue_identically(ckpt_dir, schedule):
    state = build(schedule)
    run(state, 7)
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(7)
        engine.wait()
    expected_after = run(state, 9)  # the global RNG (dropout, inputs) continues from the snapshot
    expected_state = snapshot_of(state)
    assert state["scaler"].get_scale() > 2.0 ** 4  # the scale did grow, so restoring it matters

    fresh = build(schedule)
    torch.manual_seed(1234)
    with CheckpointEngine(ckpt_dir, fresh) as engine:
        assert engine.restore() == 7
    assert run(fresh, 9) == expected_after
    assert_same(expected_state, snapshot_of(fresh))


def test_torchdata_stateful_dataloader_is_an_ordinary_entry(ckpt_dir):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(0))

    loader = make()
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(3)]
    with CheckpointEngine(ckpt_dir, {"loader": loader}) as engine:
        engine.snapshot(3)
        engine.wait()
    rest = list(iterator)

    fresh = make()
    with CheckpointEngine(ckpt_dir, {"loader": fresh}) as engine:
        assert engine.restore() == 3
    resumed = list(fresh)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in rest]
    assert sorted(sum((b.tolist() for b in consumed + resumed), [])) == list(range(40))
