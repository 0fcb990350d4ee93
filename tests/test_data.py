"""Data position for exact resume: async_ckpt.data's samplers and per-sample seeds.

A resumed run must train exactly the (epoch, batch) sequence the uninterrupted run trains after
the snapshot, whatever the loader prefetched, with any number of workers, at every epoch boundary.
"""

import json
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler

from async_ckpt import CheckpointEngine, load
from async_ckpt.data import (DistributedResumableSampler, EpochIndex, ResumableLoader,
                             ResumableSampler, sample_generator, sample_seed)
from async_ckpt.errors import StateMismatchError, UnsupportedFormatError

N, B, EPOCHS = 23, 4, 3  # 23 % 4 != 0: a short last batch, or one dropped


class Indices(Dataset):
    """Returns its index, so a batch shows which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)


class Augmented(Dataset):
    """Random augmentation drawn from sample_generator: the documented pattern."""

    seed = 11

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = sample_generator(self.seed, i.epoch, i)
        return float(i) + torch.rand(3, generator=g)


class Counting(ResumableSampler):
    """Counts the indices the loader drew in the current iteration (in the main process)."""

    drawn = 0

    def __iter__(self):
        self.drawn = 0
        for i in super().__iter__():
            self.drawn += 1
            yield i


def loader_for(sampler, dataset=None, **kw):
    drop_last = getattr(sampler, "drop_last_batch", sampler.drop_last)
    return DataLoader(dataset or Indices(sampler.dataset_len), batch_size=sampler.batch_size,
                      drop_last=drop_last, sampler=sampler, generator=torch.Generator(), **kw)


def train(sampler, num_epochs, state=None, dataset=None, **loader_kw):
    """The documented loop. Returns [(epoch, batch)] and the state after 0, 1, 2, ... batches."""
    if state is not None:
        sampler.load_state_dict(state)
    loader = loader_for(sampler, dataset, **loader_kw)
    batches, states = [], [sampler.state_dict()]
    for epoch in sampler.epochs(num_epochs):
        for batch in loader:
            batches.append((epoch, batch.tolist()))
            sampler.advance()
            states.append(sampler.state_dict())
    return batches, states


def expected_batches(sampler, num_epochs, drop_last):
    out = []
    for epoch in range(num_epochs):
        order = sampler.epoch_indices(epoch)
        for lo in range(0, len(order), sampler.batch_size):
            batch = order[lo:lo + sampler.batch_size]
            if len(batch) == sampler.batch_size or not drop_last:
                out.append((epoch, batch))
    return out


# --- order ---------------------------------------------------------------------------------------

def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = ResumableSampler(100, seed=3), ResumableSampler(100, seed=3)
    b.set_epoch(5)  # state elsewhere does not matter
    orders = [a.epoch_indices(e) for e in range(4)]
    assert orders == [b.epoch_indices(e) for e in range(4)]
    assert all(sorted(o) == list(range(100)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4
    assert ResumableSampler(100, seed=4).epoch_indices(0) != orders[0]
    # seed + epoch does not alias (DistributedSampler seeds randperm with seed + epoch).
    assert ResumableSampler(100, seed=4).epoch_indices(0) != orders[1]
    sequential = ResumableSampler(7, shuffle=False)
    assert [sequential.epoch_indices(e) for e in range(2)] == [list(range(7))] * 2


def test_order_is_pinned():
    # Independent of torch's randperm and of global RNGs: the order after a restart with another
    # torch version must be the same one. Changing these numbers breaks every saved position.
    s = ResumableSampler(10, seed=0)
    assert s.epoch_indices(0) == [3, 5, 9, 8, 1, 6, 2, 0, 4, 7]
    assert s.epoch_indices(1) == [2, 1, 9, 3, 0, 4, 8, 6, 7, 5]
    torch.manual_seed(123)
    assert ResumableSampler(10, seed=0).epoch_indices(1) == [2, 1, 9, 3, 0, 4, 8, 6, 7, 5]


def test_len_and_batches_follow_drop_last():
    keep, drop = ResumableSampler(N, batch_size=B), ResumableSampler(N, batch_size=B, drop_last=True)
    assert (keep.batches_per_epoch, drop.batches_per_epoch) == (6, 5)
    assert len(keep) == len(drop) == N
    for s in (keep, drop):
        s.advance(2)
        assert len(s) == N - 2 * B
        assert len(loader_for(s)) == s.batches_per_epoch - 2
    with pytest.raises(ValueError):
        ResumableSampler(3, batch_size=4, drop_last=True)  # no batch at all
    assert ResumableSampler(Indices(N)).dataset_len == N  # the dataset itself will do


# --- resume through a DataLoader ------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_with_prefetching_workers_continues_exactly(persistent, drop_last):
    kw = dict(num_workers=2, prefetch_factor=4, persistent_workers=persistent)
    make = lambda: ResumableSampler(N, seed=7, batch_size=B, drop_last=drop_last)  # noqa: E731
    reference, states = train(make(), EPOCHS, **kw)
    bpe = make().batches_per_epoch
    assert reference == expected_batches(make(), EPOCHS, drop_last)
    last_of_epoch0 = reference[bpe - 1][1]
    assert len(last_of_epoch0) == (B if drop_last else N % B)
    # 0; mid-epoch; before and after the last batch of epoch 0; mid epoch 2; after the final batch.
    for k in (0, 2, bpe - 1, bpe, 2 * bpe + 3, EPOCHS * bpe):
        resumed, _ = train(make(), EPOCHS, state=states[k], **kw)
        assert resumed == reference[k:], k
    assert states[bpe]["epoch"] == 1 and states[bpe]["consumed"] == 0
    assert train(make(), EPOCHS, state=states[bpe], **kw)[0][0] == (1, make().epoch_indices(1)[:B])
    assert states[-1]["epoch"] == EPOCHS and train(make(), EPOCHS, state=states[-1], **kw)[0] == []


def test_position_counts_consumed_batches_not_prefetched_ones():
    runs = {}
    for workers in (0, 2):
        sampler = Counting(N, seed=1, batch_size=B)
        loader = loader_for(sampler, num_workers=workers, **({"prefetch_factor": 4} if workers else {}))
        states, ahead = [], []
        for _ in sampler.epochs(2):
            for _ in loader:
                ahead.append(sampler.drawn - (sampler.consumed + 1) * B)
                sampler.advance()
                states.append(sampler.state_dict())
        runs[workers] = states, ahead
    assert runs[0][0] == runs[2][0]
    assert max(runs[2][1]) >= 4 * B  # the workers ran batches ahead of the loop
    assert max(runs[0][1]) <= 0


def test_set_epoch_loop_single_process_sequential():
    make = lambda: ResumableSampler(N, shuffle=False, batch_size=B)  # noqa: E731

    def run(state=None):
        sampler = make()
        if state is not None:
            sampler.load_state_dict(state)
        loader, out, states = loader_for(sampler), [], []
        for epoch in range(sampler.epoch, EPOCHS):
            sampler.set_epoch(epoch)
            for batch in loader:
                out.append((epoch, batch.tolist()))
                sampler.advance()
                states.append(sampler.state_dict())
        return out, states

    reference, states = run()
    assert reference[:2] == [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7])] and reference[5] == (0, [20, 21, 22])
    for k in (3, 6, 8, len(reference)):  # states[k - 1]: after k batches
        assert run(states[k - 1])[0] == reference[k:]


def test_snapshot_after_last_batch_does_not_depend_on_loader_exhaustion():
    """The stock RandomSampler draws one more randperm when its iterator runs dry: after the loop
    body of an epoch's last batch (no workers, full last batch). A generator state saved inside
    the loop is then one the uninterrupted run never continues from, and the resumed run shuffles
    the next epoch differently. Ours resumes the next epoch in its own order."""
    n = 16

    def stock(generator_state=None):
        g = torch.Generator()
        g.manual_seed(0) if generator_state is None else g.set_state(generator_state)
        loader = DataLoader(Indices(n), batch_size=B, sampler=RandomSampler(Indices(n), generator=g))
        return g, loader

    g, loader = stock()
    for i, _ in enumerate(loader):
        if i == n // B - 1:  # inside the loop, after the epoch's last batch
            saved = g.get_state()
    at_epoch_end = g.get_state()
    uninterrupted_next = [i for batch in loader for i in batch.tolist()]
    assert not torch.equal(saved, at_epoch_end)  # the extra randperm at exhaustion
    _, resumed_loader = stock(saved)
    assert [i for batch in resumed_loader for i in batch.tolist()] != uninterrupted_next  # the trap

    ours = ResumableSampler(n, seed=0, batch_size=B)
    loader = loader_for(ours)
    for epoch in ours.epochs(1):
        for batch in loader:
            ours.advance()
            if ours.consumed == 0:
                saved = ours.state_dict()
    uninterrupted_next = [i for batch in loader for i in batch.tolist()]
    resumed = ResumableSampler(n, seed=0, batch_size=B)
    resumed.load_state_dict(saved)
    assert [i for batch in loader_for(resumed) for i in batch.tolist()] == uninterrupted_next
    assert uninterrupted_next == ours.epoch_indices(1) != ours.epoch_indices(0)


def test_dataloader_iteration_draws_from_global_rng_unless_given_a_generator():
    """Why the docs tell users to give the loader its own generator: a resumed run starts one
    iteration more than the uninterrupted run, which would shift the restored global RNG."""
    sampler = ResumableSampler(8, batch_size=2)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(DataLoader(Indices(8), batch_size=2, sampler=sampler))
    assert not torch.equal(before, torch.get_rng_state())
    before = torch.get_rng_state()
    iter(loader_for(sampler))
    assert torch.equal(before, torch.get_rng_state())


# --- misuse -------------------------------------------------------------------------------------

def test_loader_with_more_batches_than_the_sampler_expects_raises():
    sampler = ResumableSampler(N, batch_size=8)  # 3 batches per epoch
    loader = DataLoader(Indices(N), batch_size=4, sampler=sampler)  # 6
    with pytest.raises(RuntimeError, match="batch_size"):
        for _ in sampler.epochs(1):
            for _ in loader:
                sampler.advance()
    with pytest.raises(ValueError):
        sampler.advance(0)
    fresh = ResumableSampler(N, batch_size=4)
    with pytest.raises(RuntimeError):
        fresh.advance(7)
    with pytest.raises(ValueError):  # no process group to ask
        DistributedResumableSampler(N)
    with pytest.raises(ValueError):
        DistributedResumableSampler(N, 2, 2)


def test_epoch_left_early_warns_and_moves_on():
    sampler = ResumableSampler(N, batch_size=B)
    seen = []
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        for epoch in sampler.epochs(2):
            seen.append(epoch)
            for i, _ in enumerate(loader_for(sampler)):
                sampler.advance()
                if i == 1:
                    break
    assert seen == [0, 1] and sampler.epoch == 2


def test_load_state_dict_refuses_other_settings():
    saved = ResumableSampler(N, seed=1, batch_size=B)
    saved.advance(2)
    state = saved.state_dict()
    for other in (dict(dataset_len=N + 1), dict(seed=2), dict(shuffle=False), dict(batch_size=B + 1),
                  dict(drop_last=True)):
        kw = {"dataset_len": N, "seed": 1, "batch_size": B, **other}
        sampler = ResumableSampler(kw.pop("dataset_len"), **kw)
        with pytest.raises(StateMismatchError, match=next(iter(other))):
            sampler.load_state_dict(state)
        assert (sampler.epoch, sampler.consumed) == (0, 0)
    sampler = ResumableSampler(N, seed=1, batch_size=B)
    for bad in ({**state, "consumed": 7}, {**state, "epoch": -1}, {**state, "consumed": "2"},
                {k: v for k, v in state.items() if k != "seed"}, {**state, "kind": "other"}, [1],
                {"epoch": 0}):
        with pytest.raises(StateMismatchError):
            sampler.load_state_dict(bad)
    with pytest.raises(UnsupportedFormatError):
        sampler.load_state_dict({**state, "version": 2})
    # A finished epoch saved by hand reads as the start of the next one.
    sampler.load_state_dict({**state, "consumed": 6})
    assert (sampler.epoch, sampler.consumed) == (1, 0)
    with pytest.raises(StateMismatchError):
        DistributedResumableSampler(N, 1, 0, seed=1, batch_size=B).load_state_dict(state)


# --- distributed ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,replicas", [(23, 2), (23, 3), (24, 3), (2, 3), (1, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_shards_like_distributed_sampler(n, replicas, drop_last):
    if drop_last and n < replicas:
        with pytest.raises(ValueError):
            DistributedResumableSampler(n, replicas, 0, drop_last=drop_last)
        return
    order = ResumableSampler(n, seed=5).epoch_indices(2)
    shards = []
    for rank in range(replicas):
        ours = DistributedResumableSampler(n, replicas, rank, seed=5, drop_last=drop_last)
        plain = DistributedResumableSampler(n, replicas, rank, shuffle=False, drop_last=drop_last)
        torchs = DistributedSampler(Indices(n), replicas, rank, shuffle=False, drop_last=drop_last)
        assert plain.epoch_indices(2) == list(torchs)  # identical without shuffling
        assert ours.epoch_indices(2) == [order[i] for i in torchs]  # same rule over our order
        assert len(ours) == len(torchs) == ours.num_samples
        shards.append(ours.epoch_indices(2))
    covered = [i for shard in shards for i in shard]
    if drop_last:  # cut to a multiple of replicas: no index twice
        assert len(set(covered)) == len(covered) == n - n % replicas
    else:  # padded: every index at least once
        assert set(covered) == set(range(n)) and len(covered) == -(-n // replicas) * replicas


def test_distributed_resume_per_rank():
    replicas, epochs = 3, 2
    make = lambda rank: DistributedResumableSampler(  # noqa: E731
        N, replicas, rank, seed=9, batch_size=3, drop_last_batch=True)
    for rank in range(replicas):
        reference, states = train(make(rank), epochs)
        assert reference == expected_batches(make(rank), epochs, drop_last=True)
        bpe = make(rank).batches_per_epoch
        for k in (1, bpe, bpe + 1, len(reference)):
            assert train(make(rank), epochs, state=states[k])[0] == reference[k:]
    # Ranks move in lockstep: a state may be restored on a rank with another number.
    _, states0 = train(make(0), epochs)
    assert train(make(1), epochs, state=states0[2])[0] == train(make(1), epochs)[0][2:]
    with pytest.raises(StateMismatchError, match="num_replicas"):
        DistributedResumableSampler(N, 2, 0, seed=9, batch_size=3,
                                    drop_last_batch=True).load_state_dict(states0[2])


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 6), drop_batch=st.booleans(),
       replicas=st.integers(0, 4), rank=st.integers(0, 3), drop_shard=st.booleans(),
       shuffle=st.booleans(), cut=st.floats(0, 1))
def test_resume_anywhere_yields_exactly_the_rest(n, batch, drop_batch, replicas, rank, drop_shard,
                                                  shuffle, cut):
    def make():
        if replicas == 0:
            return ResumableSampler(n, shuffle=shuffle, seed=n, batch_size=batch, drop_last=drop_batch)
        return DistributedResumableSampler(n, replicas, rank % replicas, shuffle=shuffle, seed=n,
                                           batch_size=batch, drop_last=drop_shard,
                                           drop_last_batch=drop_batch)

    def run(state=None):
        sampler = make()
        if state is not None:
            sampler.load_state_dict(state)
        out, states = [], [sampler.state_dict()]
        for epoch in sampler.epochs(3):
            for b in BatchSampler(sampler, batch, drop_batch):
                out.append((epoch, b))
                sampler.advance()
                states.append(sampler.state_dict())
        return out, states

    try:
        make()
    except ValueError:
        return  # no batch per epoch (or no sample per rank): refused at construction
    reference, states = run()
    assert len(reference) == 3 * make().batches_per_epoch
    k = round(cut * len(reference))
    assert run(states[k])[0] == reference[k:]


# --- per-sample randomness -----------------------------------------------------------------------

def test_sample_seed_is_pinned_and_sample_generator_uses_it():
    assert [sample_seed(0, 0, i) for i in range(3)] == [
        7829585396999503974, 7979298712366573054, 1421498605442222995]
    assert sample_seed(1, 2, 3) == 7931239962847916190
    assert sample_seed(-1, 2**40, 7) == 1797144852723151819
    assert sample_seed(0, 1, 0) != sample_seed(1, 0, 0) != sample_seed(0, 0, 1)
    assert all(0 <= sample_seed(s, e, i) < 2**63 for s in range(3) for e in range(3) for i in range(3))
    assert sample_seed(0, EpochIndex(5, epoch=1).epoch, EpochIndex(5, epoch=1)) == sample_seed(0, 1, 5)
    assert sample_generator(1, 2, 3).initial_seed() == 7931239962847916190
    draws = [torch.rand(4, generator=sample_generator(1, 2, 3)) for _ in range(2)]
    assert torch.equal(*draws)
    with pytest.raises(ValueError):
        sample_seed(2**200, 0, 0)


def test_epoch_index_is_an_int_that_keeps_its_epoch():
    i = EpochIndex(5, epoch=3)
    assert i == 5 and hash(i) == hash(5) and isinstance(i, int) and [0, 1, 2, 3, 4, 5, 6][i] == 5
    assert torch.arange(10)[i].item() == 5 and i + 1 == 6 and type(i + 1) is int
    j = pickle.loads(pickle.dumps(i))
    assert type(j) is EpochIndex and (int(j), j.epoch) == (5, 3)
    assert repr(i) == "EpochIndex(5, epoch=3)"
    epoch, index = i  # for datasets written for (epoch, index) pairs
    assert (epoch, index) == (3, 5) and type(index) is int
    collated = torch.utils.data.default_collate([i, EpochIndex(7, epoch=3)])
    assert torch.equal(collated, torch.tensor([5, 7]))
    sampler = ResumableSampler(6, seed=0, with_epoch=True)
    sampler.set_epoch(4)
    assert all(type(x) is EpochIndex and x.epoch == 4 for x in sampler)


def test_augmentation_is_identical_with_any_workers_and_after_resume():
    def run(state=None, **kw):
        sampler = ResumableSampler(N, seed=2, batch_size=B, with_epoch=True)
        if state is not None:
            sampler.load_state_dict(state)
        loader = loader_for(sampler, Augmented(N), **kw)
        out, states = [], []
        for _ in sampler.epochs(2):
            for batch in loader:
                out.append(batch)
                sampler.advance()
                states.append(sampler.state_dict())
        return out, states

    reference, states = run()
    workers, _ = run(num_workers=2, persistent_workers=True, prefetch_factor=4)
    resumed, _ = run(states[3], num_workers=2, persistent_workers=True)  # after 4 batches
    for got, start in ((workers, 0), (resumed, 4)):
        assert len(got) == len(reference) - start
        assert all(torch.equal(x, y) for x, y in zip(got, reference[start:]))
    # The draws change with the epoch (sample 0 in epoch 0 vs epoch 1).
    first = {e: torch.cat(reference[e * 6:(e + 1) * 6]) for e in range(2)}
    assert not torch.equal(first[0][first[0][:, 0].floor() == 0], first[1][first[1][:, 0].floor() == 0])


# --- with the engine -----------------------------------------------------------------------------

def test_state_is_plain_data():
    for sampler in (ResumableSampler(N, batch_size=B),
                    DistributedResumableSampler(N, 2, 1, batch_size=B)):
        sampler.advance()
        state = sampler.state_dict()
        assert all(type(v) in (int, bool, str) for v in state.values())
        assert json.loads(json.dumps(state)) == state


def test_round_trip_through_the_engine(ckpt_dir):
    make = lambda: ResumableSampler(N, seed=5, batch_size=B)  # noqa: E731
    reference, _ = train(make(), 2)
    sampler = make()
    loader, seen, step = loader_for(sampler), [], 0
    with CheckpointEngine(ckpt_dir, {"sampler": sampler}) as engine:
        for epoch in sampler.epochs(2):
            for batch in loader:
                seen.append((epoch, batch.tolist()))
                sampler.advance()
                engine.snapshot(step)
                step += 1
                if step == 8:  # 2 batches into epoch 1
                    break
            if step == 8:
                break
        engine.wait()
    saved = sampler.state_dict()
    assert load(ckpt_dir)[1]["sampler"] == saved == {**saved, "epoch": 1, "consumed": 2}

    restored = make()
    with CheckpointEngine(ckpt_dir, {"sampler": restored}) as engine:
        assert engine.restore() == 7
    assert restored.state_dict() == saved
    assert seen + train(restored, 2)[0] == reference

    other = ResumableSampler(N, seed=6, batch_size=B)
    with CheckpointEngine(ckpt_dir, {"sampler": other}) as engine:
        with pytest.raises(StateMismatchError, match="seed"):
            engine.restore()


# --- ResumableLoader, and loaders the engine cannot make exact -----------------------------------


class _Augmented(Dataset):
    """Augmentation drawn the natural way: from the global torch RNG of whoever loads the sample."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([float(i)]) + torch.rand(1)


def _batches(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        loader.advance()
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_loader_gives_the_same_batches_after_a_resume_and_spares_the_global_rng(workers):
    full = ResumableLoader(_Augmented(), batch_size=3, seed=5, num_workers=workers)
    reference = _batches(full, 4) + _batches(full, 4)  # two epochs of 4 batches
    first = ResumableLoader(_Augmented(), batch_size=3, seed=5, num_workers=workers)
    head = _batches(first, 2)
    resumed = ResumableLoader(_Augmented(), batch_size=3, seed=5, num_workers=workers)
    resumed.load_state_dict(first.state_dict())
    torch.manual_seed(123)  # the restored training RNG: iterating must not draw from it
    before = torch.get_rng_state()
    tail = _batches(resumed, 2) + _batches(resumed, 4)
    assert torch.equal(torch.get_rng_state(), before)
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)
    assert resumed.epoch == 2 and resumed.consumed == 0


def test_resumable_loader_owns_its_sampler_and_generator():
    with pytest.raises(ValueError, match="owns"):
        ResumableLoader(_Augmented(), batch_size=3, generator=torch.Generator())


@pytest.mark.parametrize("make", [lambda d: DataLoader(d, batch_size=2), lambda d: RandomSampler(d)])
def test_a_stock_loader_or_sampler_is_refused_with_the_right_advice(ckpt_dir, make):
    """When registered, not at the first snapshot after ``every`` steps (issue 26)."""
    from async_ckpt.errors import EncodingError
    state = {"t": torch.zeros(1), "data": {"train": make(_Augmented())}}
    for allow_pickle in (False, True):  # a pickled copy would restore nothing the loader reads
        with pytest.raises(EncodingError, match=r"'data\.train' is a .*ResumableLoader"):
            CheckpointEngine(ckpt_dir, state, allow_pickle=allow_pickle, heartbeat_interval=None)


def test_registered_loaders_that_cannot_resume_exactly_are_named_with_the_fix(ckpt_dir):
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(_Augmented(), batch_size=2, num_workers=2)
    with pytest.warns(RuntimeWarning) as caught:
        CheckpointEngine(ckpt_dir, {"data": {"loader": loader}}, heartbeat_interval=None).close()
    text = " ".join(str(w.message) for w in caught)
    assert "generator=torch.Generator()" in text and "seeded afresh" in text
    exact = ResumableLoader(_Augmented(), batch_size=2, num_workers=2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointEngine(ckpt_dir, {"loader": exact}, heartbeat_interval=None).close()


# --- the loader's draw after a restore -----------------------------------------------------------


def _restored_sampler(epoch, consumed):
    from async_ckpt.data import ResumableSampler

    sampler = ResumableSampler(24, seed=1, batch_size=4)
    state = sampler.state_dict()
    sampler.load_state_dict({**state, "epoch": epoch, "consumed": consumed})
    torch.manual_seed(123)  # what the engine restored
    sampler.after_restore()
    return sampler


@pytest.mark.parametrize("epoch,consumed,persistent,undone", [
    (1, 2, False, True),    # mid epoch: an uninterrupted run did not draw here
    (1, 0, False, False),   # an epoch's start: it did
    (1, 0, True, True),     # persistent workers draw only at the run's first iteration
    (0, 0, True, False),
])
def test_the_loaders_draw_is_undone_where_an_uninterrupted_run_did_not_draw(
        epoch, consumed, persistent, undone):
    from torch.utils.data import DataLoader

    sampler = _restored_sampler(epoch, consumed)
    restored = torch.get_rng_state()
    loader = DataLoader(list(range(24)), batch_size=4, sampler=sampler,
                        num_workers=1 if persistent else 0, persistent_workers=persistent)
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), restored) == undone


def test_other_draws_between_restore_and_iterating_are_left_and_said():
    from torch.utils.data import DataLoader

    sampler = _restored_sampler(1, 2)
    torch.rand(3)  # the user's own draw
    moved = torch.get_rng_state()
    with pytest.warns(RuntimeWarning, match="more than by the loader's own draw"):
        next(iter(DataLoader(list(range(24)), batch_size=4, sampler=sampler)))
    after_one_draw = torch.Generator()
    after_one_draw.set_state(moved)
    torch.empty((), dtype=torch.int64).random_(generator=after_one_draw)
    assert torch.equal(torch.get_rng_state(), after_one_draw.get_state())
