"""Moving between async_ckpt and PyTorch DCP checkpoints in one process: ``export --to-dcp`` and
``import-dcp`` (``async_ckpt/tools/dcp.py``) keep every tensor and value exact, and a DCP
checkpoint is untrusted input: crafted metadata, names, offsets, chunks and values get typed
errors, run no code and leave nothing written. (Sharded state at other world sizes, both ways:
tests/test_sharded.py.)"""

import os
import pickle
import random
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import CheckpointError, CorruptSnapshotError, UnsupportedFormatError
from async_ckpt.tools.cli import main
from async_ckpt.tools.dcp import MAX_METADATA_BYTES, METADATA_NAME, read_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def trained(seed=0):
    model, optimizer = model_and_optimizer(seed)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def dcp_dir(tmp_path):
    """A DCP checkpoint of a model, an optimizer (by parameter number, as torch keeps it), a
    list holding a tensor, and plain values."""
    model, optimizer = trained()
    path = tmp_path / "dcp"
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "extra": {"epoch": 4, "name": "run-1", "mixed": [torch.arange(3), 2.5]}},
             checkpoint_id=str(path))
    return path, model, optimizer


def test_export_to_dcp_loads_back_with_dcp_exactly(tmp_path, capsys):
    model, optimizer = trained()
    with CheckpointEngine(tmp_path / "ckpt", {"model": model, "optimizer": optimizer,
                                              "extra": {"epoch": 4}}) as engine:
        engine.snapshot(7, force=True)
    code, out, _ = run(capsys, "export", tmp_path / "ckpt", "--to-dcp", tmp_path / "out")
    assert code == 0 and "exported step 7 (all entries)" in out
    assert sorted(os.listdir(tmp_path / "out")) == [METADATA_NAME, "__0_0.distcp"]
    twin, twin_optimizer = model_and_optimizer(seed=1)
    target = {"model": twin.state_dict(), "extra": {"epoch": 0}}
    dcp.load(target, checkpoint_id=str(tmp_path / "out"))
    assert_same(target["model"], model.state_dict())
    assert target["extra"] == {"epoch": 4}
    assert_same(read_dcp(tmp_path / "out")["optimizer"], optimizer.state_dict())
    # one entry alone; an existing directory is never overwritten (nor removed by --force)
    code, _, _ = run(capsys, "export", tmp_path / "ckpt", "--only", "model", "--to-dcp",
                     tmp_path / "model")
    assert code == 0 and read_dcp(tmp_path / "model").keys() == model.state_dict().keys()
    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--to-dcp", tmp_path / "out", "--force")
    assert code == 2 and "exists" in err and os.listdir(tmp_path / "out")


def test_import_dcp_restores_exactly_into_the_registered_objects(dcp_dir, tmp_path, capsys):
    path, model, optimizer = dcp_dir
    code, _, err = run(capsys, "import-dcp", path, tmp_path / "ckpt", "--step", 11, "--as-dict",
                       "extras")
    assert code == 2 and "has no top-level extras; its entries: model, optimizer, extra" in err
    code, out, _ = run(capsys, "import-dcp", path, tmp_path / "ckpt", "--step", 11, "--as-dict",
                       "extra")
    assert code == 0 and "as step 11" in out and "entries model, optimizer, extra" in out
    twin, twin_optimizer = model_and_optimizer(seed=1)
    state = {"model": twin, "optimizer": twin_optimizer, "extra": {}}
    with CheckpointEngine(tmp_path / "ckpt", state) as engine:
        assert engine.restore() == 11
    assert_same(twin.state_dict(), model.state_dict())
    # DCP writes every dict key as a string: the optimizer's parameter numbers come back numbers
    assert_same(twin_optimizer.state_dict(), optimizer.state_dict())
    assert state["extra"]["epoch"] == 4 and state["extra"]["name"] == "run-1"
    assert_same(state["extra"]["mixed"], [torch.arange(3), 2.5])
    step, loaded = load(tmp_path / "ckpt")
    assert step == 11 and "__async_ckpt_rng__" not in loaded


def test_import_dcp_refuses_a_directory_that_holds_something(dcp_dir, tmp_path, capsys):
    path, _, _ = dcp_dir
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "import-dcp", path, tmp_path / "busy", "--step", 1)
    assert code == 2 and "not an empty directory" in err
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]


class Custom:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Custom) and other.value == self.value


def test_a_pickled_value_is_refused_unless_allowed(tmp_path, capsys):
    dcp.save({"extra": {"thing": Custom(3)}, "w": torch.ones(2)},
             checkpoint_id=str(tmp_path / "dcp"))
    code, _, err = run(capsys, "import-dcp", tmp_path / "dcp", tmp_path / "ckpt", "--step", 1)
    assert code == 2 and "'extra.thing'" in err and "--allow-pickle" in err
    assert not os.path.exists(tmp_path / "ckpt") or not os.listdir(tmp_path / "ckpt")
    assert read_dcp(tmp_path / "dcp", allow_pickle=True)["extra"]["thing"] == Custom(3)


# --- crafted checkpoints -------------------------------------------------------------------------

def edit_metadata(path, edit):
    with open(path / METADATA_NAME, "rb") as f:
        metadata = pickle.load(f)  # our own test file: trusted here
    edit(metadata)
    with open(path / METADATA_NAME, "wb") as f:
        pickle.dump(metadata, f)


def first(mapping, fqn):
    return next(v for k, v in mapping.items() if getattr(k, "fqn", k) == fqn)


class Sentinel:
    """Creating the sentinel file is what a crafted pickle would do, were it run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_metadata_naming_anything_but_dcp_classes_is_refused_unrun(dcp_dir, tmp_path, capsys):
    path, _, _ = dcp_dir
    sentinel = tmp_path / "ran"
    edit_metadata(path, lambda m: setattr(m, "planner_data", Sentinel(str(sentinel))))
    with pytest.raises(UnsupportedFormatError, match="io.open"):
        read_dcp(path)
    code, _, err = run(capsys, "import-dcp", path, tmp_path / "ckpt", "--step", 1)
    assert code == 1 and "would run code" in err
    assert not sentinel.exists()


def _truncate_data(path):
    with open(path / "__0_0.distcp", "r+b") as f:
        f.truncate(100)


def _escape(path):
    shutil.copy(path / "__0_0.distcp", path.parent / "outside.distcp")
    edit_metadata(path, lambda m: [setattr(i, "relative_path", "../outside.distcp")
                                   for i in m.storage_data.values()])


def _fifo_data(path):
    os.unlink(path / "__0_0.distcp")
    os.mkfifo(path / "__0_0.distcp")  # never opened for reading: it would hang


def _drop_chunk(path):
    edit_metadata(path, lambda m: first(m.state_dict_metadata, "model.0.weight").chunks.clear())


def _grow_tensor(path):
    def edit(m):
        meta = first(m.state_dict_metadata, "model.0.weight")
        meta.size = torch.Size([10, 6])
        meta.chunks[0].sizes = torch.Size([10, 6])
    edit_metadata(path, edit)


def _offset_not_a_shape(path):
    edit_metadata(path, lambda m: [object.__setattr__(i, "offset", 5) for i in m.storage_data
                                   if i.offset is not None])


def _chunk_without_sizes(path):  # a pickle's state may leave out any field of an object
    edit_metadata(path, lambda m: object.__delattr__(
        first(m.state_dict_metadata, "model.0.weight").chunks[0], "sizes"))


def _offset_past_end(path):
    edit_metadata(path, lambda m: setattr(first(m.storage_data, "model.2.bias"), "offset", 1 << 40))


def _collide(path):
    edit_metadata(path, lambda m: m.planner_data.update(
        {"model.2.bias": m.planner_data["model.0.weight"]}))


def _huge_metadata(path):
    with open(path / METADATA_NAME, "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used


def _transform(path):
    edit_metadata(path, lambda m: setattr(first(m.storage_data, "model.2.bias"),
                                          "transform_descriptors", ["zstd"]))


@pytest.mark.parametrize("craft, error, words", [
    (_truncate_data, CorruptSnapshotError, "truncated"),
    (_escape, CorruptSnapshotError, "../outside.distcp"),
    (_fifo_data, CorruptSnapshotError, "not a regular file"),
    (_drop_chunk, CorruptSnapshotError, "a piece is missing"),
    (_grow_tensor, CorruptSnapshotError, "does not hold"),
    (_offset_past_end, CorruptSnapshotError, "truncated"),
    (_offset_not_a_shape, CorruptSnapshotError, "malformed shape"),
    (_chunk_without_sizes, CorruptSnapshotError, "is not a chunk"),
    (_collide, CorruptSnapshotError, "have the path of"),
    (_huge_metadata, CorruptSnapshotError, "more than"),
    (_transform, UnsupportedFormatError, "DCP extension"),
], ids=lambda v: getattr(v, "__name__", "")[1:])
def test_a_crafted_checkpoint_gets_a_typed_error_and_nothing_is_written(dcp_dir, tmp_path, capsys,
                                                                         craft, error, words):
    path, _, _ = dcp_dir
    craft(path)
    with pytest.raises(error, match=words):
        read_dcp(path)
    code, _, err = run(capsys, "import-dcp", path, tmp_path / "ckpt", "--step", 1)
    assert code == 1 and err.startswith("async-ckpt: error:")
    assert not os.path.exists(tmp_path / "ckpt") or not os.listdir(tmp_path / "ckpt")


def test_random_damage_to_a_dcp_checkpoint_only_ever_gives_typed_errors(dcp_dir):
    """Byte flips, truncations and insertions in the metadata and the data file: each read gives
    the exact state or a CheckpointError, never another exception."""
    path, _, _ = dcp_dir
    pristine = {name: (path / name).read_bytes() for name in os.listdir(path)}
    expected = read_dcp(path)
    rng = random.Random(5)
    outcomes = set()
    for _ in range(150):
        name = rng.choice(sorted(pristine))
        data = bytearray(pristine[name])
        kind = rng.choice(("flip", "truncate", "insert"))
        at = rng.randrange(len(data))
        if kind == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del data[at:]
        else:
            data[at:at] = rng.randbytes(rng.randrange(1, 9))
        for other, original in pristine.items():
            (path / other).write_bytes(bytes(data) if other == name else original)
        try:
            got = read_dcp(path)
        except CheckpointError as e:  # EncodingError too: a value's pickle names a refused class
            outcomes.add(type(e).__name__)
            continue
        # read: a flipped byte may change a value or a tensor and stay well-formed (DCP keeps no
        # checksums), but never the structure
        outcomes.add("read")
        assert got.keys() == expected.keys() and got["model"].keys() == expected["model"].keys()
    assert "CorruptSnapshotError" in outcomes and "read" in outcomes
