"""Incremental snapshots (``incremental=True``): what did not change since a committed snapshot
is neither staged nor written again, every change torch can see is caught, the full snapshot
every ``full_every`` catches what it cannot, and references are followed, kept alive by retention
and refused when they point anywhere but at a committed snapshot's stored bytes."""

import copy
import json
import os
import shutil

import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import CorruptSnapshotError, DistributedSetupError, NoSnapshotError
from async_ckpt.format.manifest import read_manifest
from async_ckpt.format.shard import ShardReader
from async_ckpt.tools.cli import main as cli
from async_ckpt.train.capture import Planner, capture
from async_ckpt.train.incremental import ChangeTracker
from conftest import assert_same
from fuzzing import fix_manifest
from test_format import rewrite_index, split_file

BASE = 256  # the frozen base: 256 x 256 float32, 256 KiB


def lora_state(seed=0):
    """A frozen base layer, a small trainable adapter and its AdamW state, after one step."""
    torch.manual_seed(seed)
    state = {"base": torch.nn.Linear(BASE, BASE).requires_grad_(False),
             "adapter": torch.nn.Sequential(torch.nn.Linear(BASE, 4, bias=False),
                                            torch.nn.Linear(4, BASE, bias=False))}
    state["opt"] = torch.optim.AdamW(state["adapter"].parameters(), lr=1e-2)
    train(state)
    return state


def train(state, foreach=None):
    if foreach is not None:
        state["opt"].defaults["foreach"] = foreach
        for group in state["opt"].param_groups:
            group["foreach"] = foreach
    x = torch.randn(8, BASE)
    (state["base"](x) + state["adapter"](x)).pow(2).mean().backward()
    state["opt"].step()
    state["opt"].zero_grad()


def engine(directory, state, **options):
    options = {"mode": "sync", "heartbeat_interval": None, "incremental": True, "keep_last": 10,
               **options}
    return CheckpointEngine(directory, state, **options)


def plain(state):
    return {k: v.state_dict() for k, v in state.items()}


def loaded(directory, step=None):
    return load(directory, step)[1]


def shard_path(directory, step):
    record = read_manifest(LocalStorage(directory)).find(step)
    return os.path.join(directory, record.dir, record.shards[0].file)


def references(directory, step):
    with ShardReader(shard_path(directory, step)) as reader:
        return [s["ref"]["dir"] for s in reader.index["storages"] if "ref" in s]


def test_only_what_changed_is_staged_and_written(ckpt_dir):
    state = lora_state()
    base_bytes = (BASE * BASE + BASE) * 4
    with engine(ckpt_dir, state) as e:
        for step in range(3):
            train(state)
            e.snapshot(step)
        full, *incremental = e.stats()["snapshots"]
    assert full["staged_bytes"] > base_bytes and full["stored_bytes"] > base_bytes
    for figures in incremental:
        assert figures["staged_bytes"] < base_bytes / 4
        assert figures["stored_bytes"] < base_bytes / 4
        assert figures["referred_bytes"] == base_bytes
    assert os.path.getsize(shard_path(ckpt_dir, 2)) < base_bytes / 4
    first = read_manifest(LocalStorage(ckpt_dir)).find(0).dir
    assert references(ckpt_dir, 1) == references(ckpt_dir, 2) == [first, first]  # weight, bias
    assert_same(plain(state), {k: v for k, v in loaded(ckpt_dir).items()})


def test_bit_exact_after_many_incremental_snapshots_and_retention(ckpt_dir):
    state = lora_state()
    with engine(ckpt_dir, state, keep_last=1, full_every=4) as e:
        for step in range(6):
            train(state)
            e.snapshot(step)
    manifest = read_manifest(LocalStorage(ckpt_dir))
    # Step 4 was the full one; step 5 refers to it, so retention keeps it, and nothing older.
    assert manifest.steps() == [4, 5] and manifest.snapshots[1].refers == (manifest.snapshots[0].dir,)
    assert sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-")) == [
        s.dir for s in manifest.snapshots]
    fresh = lora_state(seed=1)
    with engine(ckpt_dir, fresh) as e:
        assert e.restore() == 5
    for key in state:
        assert_same(plain(state)[key], plain(fresh)[key], key)


def _in_place(state):
    state["base"].weight.mul_(0.5)


def _no_grad_copy(state):
    with torch.no_grad():
        state["base"].bias.copy_(torch.randn(BASE))


def _data_assignment(state):
    state["base"].weight.data = torch.randn(BASE, BASE)


def _module_load_state_dict(state):
    state["base"].load_state_dict(torch.nn.Linear(BASE, BASE).state_dict())


def _optimizer_load_state_dict(state):
    saved = copy.deepcopy(state["opt"].state_dict())
    for s in saved["state"].values():
        s["exp_avg"] = s["exp_avg"] + 1
    state["opt"].load_state_dict(saved)


CHANGES = {"in-place op": _in_place, "no_grad copy_": _no_grad_copy,
           ".data assignment": _data_assignment,
           "module load_state_dict": _module_load_state_dict,
           "optimizer load_state_dict": _optimizer_load_state_dict,
           "AdamW step (foreach)": lambda state: train(state, foreach=True),
           "AdamW step (for loop)": lambda state: train(state, foreach=False)}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_every_change_torch_can_see_is_written(ckpt_dir, change):
    state = lora_state()
    with engine(ckpt_dir, state, full_every=100) as e:
        e.snapshot(0)
        e.snapshot(1)  # nothing changed: everything but the RNG state is a reference
        change(state)
        e.snapshot(2)
    assert references(ckpt_dir, 1)
    assert_same(plain(state), loaded(ckpt_dir, 2))


def _numpy_view(state):
    state["base"].weight.numpy()[:] = 7.0


def _data_in_place(state):
    state["base"].weight.data.fill_(7.0)


@pytest.mark.parametrize("change", [_numpy_view, _data_in_place], ids=["numpy view", ".data in place"])
def test_a_write_the_version_counter_cannot_see_is_caught_by_the_next_full_snapshot(ckpt_dir, change):
    state = lora_state()
    with engine(ckpt_dir, state, full_every=3) as e:
        e.snapshot(0)  # full
        before = state["base"].weight.clone()
        change(state)
        e.snapshot(1)  # incremental: misses it (documented in README, "Incremental snapshots")
        e.snapshot(2)  # incremental: misses it
        e.snapshot(3)  # full: the safety net
        e.snapshot(4)  # incremental again, referring to step 3's bytes
    assert torch.equal(loaded(ckpt_dir, 1)["base"]["weight"], before)
    assert torch.equal(loaded(ckpt_dir, 2)["base"]["weight"], before)
    assert references(ckpt_dir, 3) == []
    for step in (3, 4):
        assert (loaded(ckpt_dir, step)["base"]["weight"] == 7.0).all()


class AppState:
    """A registered object that holds the model, as DCP users write it."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])


@pytest.mark.parametrize("wrapped", [False, True], ids=["module", "AppState"])
def test_trainable_parameters_are_always_written_even_when_changed_through_data(ckpt_dir, wrapped):
    state = lora_state()
    registered = {**state, "adapter": AppState(state["adapter"])} if wrapped else state
    with engine(ckpt_dir, registered, full_every=100) as e:
        e.snapshot(0)
        state["adapter"][0].weight.data.add_(1.0)  # an old-style optimizer or EMA update
        state["base"].weight.data.add_(1.0)  # frozen: not seen until the next full snapshot
        e.snapshot(1)
    saved = loaded(ckpt_dir, 1)
    adapter = saved["adapter"]["model"] if wrapped else saved["adapter"]
    assert torch.equal(adapter["0.weight"], state["adapter"][0].weight)
    assert not torch.equal(saved["base"]["weight"], state["base"].weight)  # as documented
    assert references(ckpt_dir, 1)  # the frozen base is still referred to


def test_the_snapshot_after_a_restore_is_full(ckpt_dir):
    state = lora_state()
    with engine(ckpt_dir, state) as e:
        e.snapshot(0)
        e.snapshot(1)
        assert e.restore() == 1
        e.snapshot(2)
        e.snapshot(3)
    assert references(ckpt_dir, 1) and not references(ckpt_dir, 2) and references(ckpt_dir, 3)


def test_only_a_committed_holder_is_referred_to():
    """In async mode the snapshot holding the bytes may still be in flight (and fail): until it
    commits, the bytes are staged and written again; a new snapshot of the same step (which
    replaces the old one in the manifest) never refers to it."""
    state = {"w": torch.ones(1000)}
    captured = capture(state)
    plan, sources = Planner().plan(captured.tensors)
    tracker = ChangeTracker(full_every=10)
    assert tracker.unchanged(plan, sources, captured.tensors, 0, 0, "d0") == {}
    assert tracker.unchanged(plan, sources, captured.tensors, 1, 1, "d1") == {}  # 0 in flight
    tracker.committed(0)
    assert tracker.unchanged(plan, sources, captured.tensors, 2, 2, "d2") == {0: "d0"}
    assert tracker.unchanged(plan, sources, captured.tensors, 3, 0, "d0b") == {}  # same step
    state["w"].add_(1)
    captured = capture(state)
    assert tracker.unchanged(plan, sources, captured.tensors, 4, 4, "d4") == {}


def test_a_freed_storage_at_the_same_address_is_a_change():
    tracker = ChangeTracker(full_every=10)
    for job in range(4):
        state = {"w": torch.full((4096,), float(job))}  # the previous one is freed first
        captured = capture(state)
        plan, sources = Planner().plan(captured.tensors)
        assert tracker.unchanged(plan, sources, captured.tensors, job, job, f"d{job}") == {}
        tracker.committed(job)
        del state, captured, sources


def test_several_ranks_are_refused_at_construction(ckpt_dir):
    with pytest.raises(DistributedSetupError):
        CheckpointEngine(ckpt_dir, {"w": torch.ones(3)}, incremental=True, rank=0, world_size=2)
    with pytest.raises(ValueError):
        CheckpointEngine(ckpt_dir, {"w": torch.ones(3)}, incremental=True, full_every=0)


# --- damage and hostile references --------------------------------------------------------------


@pytest.fixture
def chain(ckpt_dir):
    """Steps 0 (full), 1 (refers to 0), 2 (full), 3 (refers to 2); returns the live state."""
    state = lora_state()
    with engine(ckpt_dir, state, full_every=2) as e:
        for step in range(4):
            train(state)
            e.snapshot(step)
            if step == 1:
                at_1 = copy.deepcopy(plain(state))
    assert [bool(references(ckpt_dir, s)) for s in range(4)] == [False, True, False, True]
    return at_1


def _flip_base_chunk(ckpt_dir, step):
    path = shard_path(ckpt_dir, step)
    with ShardReader(path) as reader:
        offset = next(s["chunks"][0]["offset"] for s in reader.index["storages"]
                      if s["nbytes"] == BASE * BASE * 4)
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _remove_dir(ckpt_dir, step):
    shutil.rmtree(os.path.join(ckpt_dir, read_manifest(LocalStorage(ckpt_dir)).find(step).dir))


def _fixed_manifest(ckpt_dir, step):
    """The manifest document with step's shard size and index checksum as they are on disk now
    (taken from the trailer: the index itself may be hostile)."""
    manifest, path = read_manifest(LocalStorage(ckpt_dir)), shard_path(ckpt_dir, step)
    with open(path, "rb") as f:
        data = f.read()
    digest = split_file(data)[3][2]
    return fix_manifest(json.loads(manifest.to_bytes()), manifest.find(step).dir, len(data),
                        f"{digest:016x}")


def _replace_shard(ckpt_dir, step):
    """The target's shard replaced by an older one, its manifest entry made to match."""
    target, older = shard_path(ckpt_dir, step), shard_path(ckpt_dir, 0)
    with ShardReader(older) as reader:
        index = copy.deepcopy(reader.index)
    index["step"] = step
    rewrite_index(older, target, index)
    doc = _fixed_manifest(ckpt_dir, step)
    with open(os.path.join(ckpt_dir, "manifest.json"), "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("damage, fallback", [(_flip_base_chunk, 1), (_remove_dir, 1),
                                               (_replace_shard, 2)],
                         ids=["damaged", "missing", "replaced"])
def test_a_bad_target_is_damage_of_the_referencing_snapshot(chain, ckpt_dir, capsys, damage,
                                                            fallback):
    damage(ckpt_dir, 2)
    assert load(ckpt_dir)[0] == fallback  # a replaced step 2 is whole, only step 3 is not
    if fallback == 1:  # step 1 refers to step 0, which is intact
        assert_same(chain, loaded(ckpt_dir))
    with pytest.raises(CorruptSnapshotError):
        load(ckpt_dir, 3)
    assert cli(["verify", ckpt_dir, "--step", "3"]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def _edit_reference(ckpt_dir, step, edit, refers=None):
    """Rewrite step's shard with ``edit(ref)`` applied to its first reference; the manifest
    fixed up (and its ``refers`` replaced when given)."""
    path = shard_path(ckpt_dir, step)
    with ShardReader(path) as reader:
        index = copy.deepcopy(reader.index)
    edit(next(s["ref"] for s in index["storages"] if "ref" in s))
    rewrite_index(path, path, index)
    doc = _fixed_manifest(ckpt_dir, step)
    if refers is not None:
        next(s for s in doc["snapshots"] if s["step"] == step)["refers"] = refers
    with open(os.path.join(ckpt_dir, "manifest.json"), "w") as f:
        json.dump(doc, f)


def _dir(ckpt_dir, step):
    return read_manifest(LocalStorage(ckpt_dir)).find(step).dir


def _index_xxh3(ckpt_dir, step):
    return read_manifest(LocalStorage(ckpt_dir)).find(step).shards[0].index_xxh3


# name -> (the step whose shard is edited, the edit)
HOSTILE = {
    "path traversal": (3, lambda d: _edit_reference(d, 3, lambda r: r.update(dir="../../outside"))),
    "shard path": (3, lambda d: _edit_reference(d, 3, lambda r: r.update(file="../rank-00000.ackpt"))),
    "not in the manifest": (3, lambda d: _edit_reference(
        d, 3, lambda r: r.update(dir="step-00000000000000000002.0badf00d"),
        refers=["step-00000000000000000002.0badf00d"])),
    "not in refers": (3, lambda d: _edit_reference(
        d, 3, lambda r: r.update(dir=_dir(d, 0), index_xxh3=_index_xxh3(d, 0)))),
    "a later snapshot": (1, lambda d: _edit_reference(
        d, 1, lambda r: r.update(dir=_dir(d, 2), index_xxh3=_index_xxh3(d, 2)),
        refers=[_dir(d, 2)])),
    "a reference": (3, lambda d: _edit_reference(
        d, 3, lambda r: r.update(dir=_dir(d, 1), index_xxh3=_index_xxh3(d, 1)),
        refers=[_dir(d, 1)])),
    "another storage": (3, lambda d: _edit_reference(d, 3, lambda r: r.update(storage=r["storage"] + 1))),
}


@pytest.mark.parametrize("edited, hostile", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_reference_is_refused_and_restore_falls_back(chain, ckpt_dir, tmp_path, edited,
                                                               hostile):
    hostile(ckpt_dir)
    with pytest.raises(CorruptSnapshotError):
        load(ckpt_dir, edited)
    assert load(ckpt_dir)[0] == (2 if edited == 3 else 3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_reference_to_a_reference_is_refused(chain, ckpt_dir):
    HOSTILE["a reference"][1](ckpt_dir)
    with pytest.raises(CorruptSnapshotError, match="does not hold its bytes"):
        load(ckpt_dir, 3)


def test_every_snapshot_referring_to_a_damaged_one_says_so(chain, ckpt_dir):
    for step in (0, 2):
        _remove_dir(ckpt_dir, step)
    with pytest.raises(NoSnapshotError):
        load(ckpt_dir)


# --- the tools ----------------------------------------------------------------------------------


def test_gc_keeps_what_kept_snapshots_refer_to(chain, ckpt_dir, capsys):
    assert cli(["gc", ckpt_dir, "--keep-last", "1"]) == 0
    manifest = read_manifest(LocalStorage(ckpt_dir))
    assert manifest.steps() == [2, 3]
    assert sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-")) == [
        s.dir for s in manifest.snapshots]
    assert cli(["verify", ckpt_dir, "--all"]) == 0
    assert load(ckpt_dir)[0] == 3


def test_inspect_shows_where_referred_storages_are(chain, ckpt_dir, capsys):
    assert cli(["inspect", ckpt_dir, "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "referred to in earlier snapshots" in out
    assert f"in {_dir(ckpt_dir, 0)}" in out  # the frozen base's rows name the holding snapshot


def test_a_reference_that_also_holds_chunks_is_damage(chain, ckpt_dir):
    path = shard_path(ckpt_dir, 1)
    with ShardReader(path) as reader:
        index = copy.deepcopy(reader.index)
    next(s for s in index["storages"] if "ref" in s)["chunks"] = []
    rewrite_index(path, path, index)
    doc = _fixed_manifest(ckpt_dir, 1)
    with open(os.path.join(ckpt_dir, "manifest.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(CorruptSnapshotError, match="holds no chunks"):
        load(ckpt_dir, 1)


def test_export_resolves_references(chain, ckpt_dir, tmp_path, capsys):
    target = str(tmp_path / "out.pt")
    assert cli(["export", ckpt_dir, "--step", "1", "--to", target]) == 0
    assert_same(chain, {k: v for k, v in torch.load(target).items() if k in chain})


def test_an_old_manifest_and_old_shards_stay_readable(ckpt_dir):
    """Without references the manifest stays version 1 (shards that store bytes are version 5
    since issue 40, references or not: their storages are aligned)."""
    state = lora_state()
    with engine(ckpt_dir, state, incremental=False) as e:
        e.snapshot(0)
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        assert json.load(f)["version"] == 1
    with ShardReader(shard_path(ckpt_dir, 0)) as reader:
        assert reader.version in (5, 7)  # 7: written with direct I/O, aligned for it
        assert not any("ref" in s for s in reader.index["storages"])
    with engine(ckpt_dir, state) as e:  # an incremental engine continues the same directory
        e.snapshot(1)
        e.snapshot(2)
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        assert json.load(f)["version"] == 2
    with ShardReader(shard_path(ckpt_dir, 2)) as reader:
        assert reader.version in (5, 7) and any("ref" in s for s in reader.index["storages"])
    assert_same(plain(state), loaded(ckpt_dir))
