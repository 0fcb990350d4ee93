"""Lazy staging: snapshot() returns once the copy has started, and every write path the engine
knows of waits for the copy first (optimizers' step, load_state_dict of registered objects, the
next snapshot, wait/restore/close, fence()); a write that bypasses them fails that snapshot, and
never commits a torn one. The copy thread is held at a gate, so each test decides exactly when
the copy runs, without sleeping."""

import copy
import random
import threading

import pytest
import torch

from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import LayoutError, SnapshotWriteError, StagingRaceError
from async_ckpt.train import staging
from async_ckpt.train.capture import Source
from conftest import assert_same, make_training_state, train_step


@pytest.fixture
def gate(monkeypatch):
    """Copies on the copy thread (not those made inline) wait until ``gate.open()``;
    ``gate.open_when_waited()``
    opens it as soon as the training thread waits for a copy (a fence was reached)."""

    class Gate:
        def __init__(self):
            self.opened, self.waited = threading.Event(), threading.Event()

        def open(self):
            self.opened.set()

        def open_when_waited(self):
            threading.Thread(target=lambda: (self.waited.wait(), self.opened.set()),
                             daemon=True).start()

    g = Gate()
    real_copy, real_wait = staging._copy_pieces, staging.Copy.wait

    def held_copy(slot, regions, digests):
        if threading.current_thread().name.startswith("async_ckpt-stage"):  # not inline copies
            g.opened.wait(timeout=60)  # only a failing test waits that long: it fails, not hangs
        return real_copy(slot, regions, digests)

    def noted_wait(self):
        g.waited.set()
        return real_wait(self)

    monkeypatch.setattr(staging, "_copy_pieces", held_copy)
    monkeypatch.setattr(staging.Copy, "wait", noted_wait)
    return g


def snapshot_of(model, opt, sched):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def saved(ckpt_dir, step):
    found, state = load(ckpt_dir, step)
    assert found == step
    return {"model": state["model"], "optimizer": state["optimizer"]}


def test_snapshot_returns_before_the_copy_and_the_step_waits_for_it(ckpt_dir, gate):
    model, opt, sched = make_training_state()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt, "scheduler": sched},
                          staging="lazy") as engine:
        expected = snapshot_of(model, opt, sched)
        engine.snapshot(0)  # the copy is held at the gate: snapshot() returned all the same
        assert not gate.waited.is_set()
        gate.open_when_waited()
        train_step(model, opt, sched)  # the optimizer's step waits for the copy first
        assert gate.waited.is_set()
        engine.wait()
        assert engine.stats()["snapshots"][-1]["staging_s"] > 0
    assert_same(saved(ckpt_dir, 0), expected)


@pytest.mark.parametrize("write", ["load_state_dict of the module", "load_state_dict of the optimizer",
                                   "an optimizer that was not registered", "restore()",
                                   "the next snapshot()", "fence()"])
def test_every_fenced_write_waits_for_the_copy(ckpt_dir, gate, write):
    model, opt, sched = make_training_state()
    other, other_opt, _ = make_training_state(seed=9)
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt},
                          staging="lazy", keep_last=5) as engine:
        expected = snapshot_of(model, opt, sched)
        engine.snapshot(0)
        gate.open_when_waited()
        if write == "load_state_dict of the module":
            model.load_state_dict(other.state_dict())
        elif write == "load_state_dict of the optimizer":
            opt.load_state_dict(other_opt.state_dict())
        elif write == "an optimizer that was not registered":
            stray = torch.optim.SGD(model.parameters(), lr=1.0)
            model(torch.randn(2, 32)).sum().backward()
            stray.step()
        elif write == "restore()":
            engine.restore()
        elif write == "the next snapshot()":
            train_step(model, opt)
            engine.snapshot(1)
            gate.open()
        else:
            engine.fence()
            with torch.no_grad():
                model[0].weight.add_(1.0)
        assert gate.waited.is_set()
        engine.wait()
    assert_same(saved(ckpt_dir, 0), expected)


def the_next_snapshot_is_whole(engine, ckpt_dir, model, opt, sched):
    """After one failed snapshot (of step 0): the snapshot of step 1 commits the state as it is,
    and only it is committed."""
    expected = snapshot_of(model, opt, sched)
    engine.snapshot(1)
    engine.wait()
    assert engine.committed_steps() == [1] and engine.stats()["failed"] == 1
    assert_same(saved(ckpt_dir, 1), expected)


def test_a_write_no_fence_saw_fails_that_snapshot_only(ckpt_dir, gate):
    model, opt, sched = make_training_state()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt},
                          staging="lazy", keep_last=5) as engine:
        engine.snapshot(0)
        with torch.no_grad():
            model[2].bias.add_(1.0)  # no fence: the copy has not even started
        gate.open()
        with pytest.raises(StagingRaceError, match=r"model\[.2\.bias.\].*engine\.fence\(\)"):
            engine.wait()
        the_next_snapshot_is_whole(engine, ckpt_dir, model, opt, sched)


def test_a_copy_that_fails_fails_that_snapshot_only(ckpt_dir, gate):
    """A storage resized in place under the copy (as FSDP does to unsharded parameters): the
    copy thread's error fails that snapshot with a typed error at the next call, from neither
    the optimizer's step nor a hang, and the next snapshot is whole."""
    model, opt, sched = make_training_state()
    extra = {"buffer": torch.ones(1000)}
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt, "extra": extra},
                          staging="lazy", keep_last=5) as engine:
        engine.snapshot(0)
        extra["buffer"].untyped_storage().resize_(8)  # the copy has not started
        gate.open()
        train_step(model, opt, sched)  # the step's fence sees the failure and does not raise it
        with pytest.raises(SnapshotWriteError, match="step 0 was not saved: copying") as raised:
            engine.snapshot(1)
        assert isinstance(raised.value.__cause__, LayoutError)
        assert extra["buffer"].untyped_storage().nbytes() == 8  # not grown back by the copy
        extra["buffer"] = torch.ones(1000)
        the_next_snapshot_is_whole(engine, ckpt_dir, model, opt, sched)


def test_edits_at_random_moments_never_commit_a_torn_image(ckpt_dir, monkeypatch):
    """Seeded random moments: the copy thread is held after a random number of regions (or not
    at all), then a random write runs. Fenced ones (``load_state_dict``, an optimizer that was not
    registered, ``fence()`` then ``p.add_()``) wait for the copy; ``p.add_()`` under ``no_grad``
    without a fence fails that snapshot. Every committed step is the state its ``snapshot()``
    returned with, bit for bit."""
    rng = random.Random(20261204)
    held = {"at": None, "regions": 0}
    reached, release = threading.Event(), threading.Event()
    real_view, real_wait = Source.view, staging.Copy.wait

    def held_view(source):
        if threading.current_thread().name.startswith("async_ckpt-stage"):
            if held["regions"] == held["at"]:
                reached.set()
                release.wait(timeout=60)  # only a failing test waits that long
            held["regions"] += 1
        return real_view(source)

    def released_wait(copy):  # a fence lets the held copy go on, then waits for it
        release.set()
        return real_wait(copy)

    monkeypatch.setattr(Source, "view", held_view)
    monkeypatch.setattr(staging.Copy, "wait", released_wait)
    model, opt, sched = make_training_state()
    other, other_opt, _ = make_training_state(seed=9)
    stray = torch.optim.SGD(model.parameters(), lr=0.5)
    expected, raced = {}, []
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt, "scheduler": sched},
                          staging="lazy", keep_last=40) as engine:
        engine.snapshot(0)  # not held: counts the regions
        engine.fence()
        expected[0], regions = snapshot_of(model, opt, sched), held["regions"]
        for step in range(1, 30):
            train_step(model, opt, sched)
            held["at"], held["regions"] = rng.randrange(regions + 1), 0
            reached.clear()
            release.clear()
            engine.snapshot(step)
            expected[step] = snapshot_of(model, opt, sched)
            if held["at"] < regions:
                assert reached.wait(timeout=60)  # the copy stopped where it was told
            write = rng.choice(["unfenced add_", "fence, then add_", "load_state_dict",
                                "an optimizer that was not registered", "none"])
            if write == "unfenced add_":
                with torch.no_grad():
                    model[rng.choice([0, 2])].weight.add_(0.25)
                release.set()
                raced.append(step)
                with pytest.raises(StagingRaceError, match=f"step {step} was not saved"):
                    engine.wait()
            elif write == "fence, then add_":
                engine.fence()
                with torch.no_grad():
                    model[0].bias.add_(0.25)
            elif write == "load_state_dict":
                if rng.random() < 0.5:
                    model.load_state_dict(other.state_dict())
                else:
                    opt.load_state_dict(other_opt.state_dict())
            elif write == "an optimizer that was not registered":
                model(torch.randn(2, 32)).sum().backward()
                stray.step()
                stray.zero_grad()
        engine.wait()
        assert engine.committed_steps() == [s for s in range(30) if s not in raced]
        assert raced and len(raced) < 29  # both outcomes were drawn
    for step in range(30):
        if step not in raced:
            assert_same(saved(ckpt_dir, step), expected[step])


def test_lazy_snapshots_commit_what_eager_ones_do(ckpt_dir, tmp_path, monkeypatch):
    """The same training, eager and lazy, commits the same bytes at every step, each read back
    verified. A lazy copy checksums what it copies, and the writer's job carries those
    checksums, which it takes instead of reading the slot again for them (an eager copy blocks
    training, so it makes none)."""
    from async_ckpt.write.client import WriterClient

    results, jobs = {}, []
    real_submit = WriterClient.submit
    monkeypatch.setattr(WriterClient, "submit",
                        lambda self, job: (jobs.append(job), real_submit(self, job))[1])
    for staging_kind in ("eager", "lazy"):
        model, opt, sched = make_training_state(seed=3)
        directory = str(tmp_path / staging_kind)
        torch.manual_seed(11)
        with CheckpointEngine(directory, {"model": model, "optimizer": opt, "scheduler": sched},
                              staging=staging_kind, keep_last=10) as engine:
            for step in range(6):
                train_step(model, opt, sched)
                engine.snapshot(step)
        results[staging_kind] = [load(directory, step, verify=True)[1] for step in range(6)]
    assert_same(results["lazy"], results["eager"])
    made = [job.checksums is not None and None not in job.checksums for job in jobs]
    assert made == [False] * 6 + [True] * 6


def test_staging_is_an_option_checked_at_construction(ckpt_dir):
    with pytest.raises(ValueError, match="staging"):
        CheckpointEngine(ckpt_dir, {}, staging="later")


def test_module_buffers_are_copied_before_snapshot_returns(ckpt_dir, gate):
    """The forward pass updates batch-norm statistics in place, before any fence: they are
    staged at once, the parameters lazily."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}, staging="lazy") as engine:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        expected = copy.deepcopy(model.state_dict())
        engine.snapshot(0)
        gate.open_when_waited()
        model(torch.randn(4, 8)).sum().backward()  # the next forward: running stats change
        opt.step()
        engine.wait()
        assert engine.committed_steps() == [0]
    assert_same(load(ckpt_dir)[1]["model"], dict(expected))
