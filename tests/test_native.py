"""A committed snapshot in torch's own file format (format/native.py): what torch.load reads,
written by the writer without torch, for every dtype a snapshot may hold, views and shared
storages, the values of the tag scheme, an incremental snapshot's referred bytes, and a record
that a crafted file cannot turn against its reader."""

import io
import os
import zipfile

import pytest
import torch

from async_ckpt import CheckpointEngine, Derived, Marker
from async_ckpt.errors import InvalidArgumentError, SnapshotWriteError
from async_ckpt.format.manifest import read_manifest
from async_ckpt.format.references import References
from async_ckpt.format.native import ALIGNMENT, MAX_RECORD_BYTES, write_committed
from async_ckpt.format.records import ITEMSIZES
from async_ckpt.storage.local import LocalStorage
from async_ckpt.tensors import DTYPES
from conftest import assert_same


def as_file(directory, step=None, derived=Derived("torch", record=b"note")) -> bytes:
    """The committed snapshot ``step`` (default the newest) of ``directory`` as ``derived``."""
    storage = LocalStorage(str(directory))
    manifest = read_manifest(storage)
    record = manifest.snapshots[-1] if step is None else manifest.find(step)
    out = io.BytesIO()
    with References(storage, manifest.snapshots) as references:
        write_committed(out, references, record, 0, derived)
    return out.getvalue()


def snapshot(directory, state, **options):
    with CheckpointEngine(str(directory), {}, **options) as engine:
        engine.snapshot(0, state=state, force=True)


def test_itemsizes_are_torch_s_for_every_dtype_a_snapshot_may_hold():
    assert ITEMSIZES == {name: dtype.itemsize for name, dtype in DTYPES.items()}


def test_every_dtype_view_and_value_loads_with_weights_only(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    state = {
        "dtypes": {name: torch.zeros(5, dtype=dtype).view(torch.uint8).random_(0, 2)
                   .view(dtype) if dtype.itemsize == 1 else torch.ones(5, dtype=dtype)
                   for name, dtype in DTYPES.items() if not name.startswith("bits")},
        "views": [base[3:7], base[::5], base.view(4, 6).t(), base.view(2, 12)[1]],
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "values": {"tuple": (1, 2.5, "x"), "set": {1, 2}, "big": 2**70, "nan": float("nan"),
                   "bytes": b"\x00\xff", "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
                   "device": torch.device("cpu"), "none": None, "keys": {1: "a", (2, 3): "b"}},
    }
    snapshot(tmp_path / "ckpt", state)
    data = as_file(tmp_path / "ckpt")
    (tmp_path / "x.pt").write_bytes(data)
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "x.pt", weights_only=True, mmap=mmap)
        assert_same(loaded, state)
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    views = loaded["views"]  # tensors that shared a storage share it again
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None  # every entry's CRC-32 is right
        for info in archive.infolist():
            if "/data/" in info.filename:
                assert (info.header_offset + 30 + len(info.filename) + len(info.extra)) \
                    % ALIGNMENT == 0


def test_the_engine_s_rng_entry_is_left_out_and_a_module_state_keeps_its_metadata(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    with CheckpointEngine(str(tmp_path / "ckpt"), {"model": model}) as engine:
        engine.snapshot(0)
    loaded = torch.load(io.BytesIO(as_file(tmp_path / "ckpt")), weights_only=True)
    assert list(loaded) == ["model"]
    assert_same(dict(loaded["model"]), dict(model.state_dict()))
    assert loaded["model"]._metadata == model.state_dict()._metadata


def test_a_pickled_value_loads_only_when_pickles_are_allowed(tmp_path):
    snapshot(tmp_path / "ckpt", {"path": {"p": os.path.join("a", "b")}, "obj": [complex(1, 2)]},
             allow_pickle=True)
    (tmp_path / "x.pt").write_bytes(as_file(tmp_path / "ckpt"))
    with pytest.raises(Exception, match="weights_only"):
        torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.load(tmp_path / "x.pt", weights_only=False)["obj"] == [complex(1, 2)]


def test_an_incremental_snapshot_s_file_holds_the_bytes_it_refers_to(tmp_path):
    frozen, trained = torch.randn(1000), torch.randn(10)
    with CheckpointEngine(str(tmp_path / "ckpt"), {"frozen": frozen, "trained": trained},
                          incremental=True, keep_last=5) as engine:
        engine.snapshot(0)
        engine.wait()
        trained.add_(1)
        engine.snapshot(1)
    storage = LocalStorage(str(tmp_path / "ckpt"))
    assert read_manifest(storage).find(1).refers  # the frozen tensor's bytes are in step 0's
    loaded = torch.load(io.BytesIO(as_file(tmp_path / "ckpt", 1)), weights_only=True)
    assert_same(loaded, {"frozen": frozen, "trained": trained})


def test_a_marker_writes_the_file_once_committed_with_its_record(tmp_path):
    target = tmp_path / "out" / "model.ckpt"
    with CheckpointEngine(str(tmp_path / "ckpt"), {}) as engine:
        engine.snapshot(0, state={"w": torch.ones(3)}, force=True,
                        markers=[Marker(str(target), Derived("torch", record=b"the record"))])
        engine.wait()
        assert_same(torch.load(target, weights_only=True), {"w": torch.ones(3)})
        with open(target, "rb") as f:
            assert Marker.record_in(f) == b"the record"


def test_a_record_is_read_from_a_crafted_file_boundedly(tmp_path):
    def archive(entries) -> io.BytesIO:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for name, data, method in entries:
                z.writestr(zipfile.ZipInfo(name), data, compress_type=method)
        out.seek(0)
        return out

    stored, deflated = zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED
    assert Marker.record_in(archive([("a/.data/async_ckpt", b"x", stored)])) == b"x"
    assert Marker.record_in(archive([("a/data.pkl", b"x", stored)])) is None  # torch.save's
    too_long = b"x" * (MAX_RECORD_BYTES + 1)
    assert Marker.record_in(archive([("a/.data/async_ckpt", too_long, stored)])) is None
    bomb = b"\0" * (64 << 20)  # compressed: refused unread, never inflated
    assert Marker.record_in(archive([("a/.data/async_ckpt", bomb, deflated)])) is None
    assert Marker.record_in(io.BytesIO(b"PK\x03\x04 not a zip")) is None
    cut = archive([("a/.data/async_ckpt", b"x", stored)]).getvalue()[:-10]
    assert Marker.record_in(io.BytesIO(cut)) is None


def test_an_entry_as_safetensors_is_contiguous_and_leaves_tied_weights_out(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    shared = torch.randn(6, 4)
    weights = {"embed": shared, "head": shared, "t": torch.randn(3, 5).t(), "b": torch.arange(4.),
               "half": torch.ones(2, 3, dtype=torch.bfloat16), "cut": torch.arange(10)[2:7]}
    snapshot(tmp_path / "ckpt", {"model": weights, "optimizer": {"lr": 0.1}})
    (tmp_path / "m.safetensors").write_bytes(
        as_file(tmp_path / "ckpt", derived=Derived("safetensors", "model")))
    loaded = safetensors_torch.load_file(tmp_path / "m.safetensors")
    assert set(loaded) == set(weights) - {"head"}  # the same bytes as "embed": tied
    assert_same(dict(sorted(loaded.items())),  # stored largest elements first: aligned
                {k: weights[k].contiguous() for k in sorted(weights) if k != "head"})
    with safetensors_torch.safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what from_pretrained asks for


def test_a_file_the_format_cannot_hold_fails_the_marker_with_a_typed_error(tmp_path):
    with CheckpointEngine(str(tmp_path / "ckpt"), {}) as engine:
        engine.snapshot(0, state={"model": {"w": torch.ones(2)}, "optimizer": {"lr": 0.1}},
                        force=True, markers=[Marker(str(tmp_path / "o.safetensors"),
                                                    Derived("safetensors", "optimizer"))])
        with pytest.raises(SnapshotWriteError, match="not a dict of tensors"):
            engine.wait()
        assert engine.committed_steps() == [0]  # the snapshot itself stays committed
    assert not (tmp_path / "o.safetensors").exists()
    with pytest.raises(InvalidArgumentError):
        Derived("pickle")
