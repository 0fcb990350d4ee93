"""The pointer (async_ckpt/integrations/pointer.py): one format for every adapter, earlier
versions' pointers read as the same record, and a hostile file never gets past its checks."""

import json
import os
import random

import pytest

from async_ckpt.errors import PointerFileError
from async_ckpt.integrations.pointer import (MAX_POINTER_BYTES, POINTER_NAME, Pointer,
                                             pointer_file, read_pointer, read_pointer_file)


def test_a_pointer_reads_back_as_written(tmp_path):
    pointer = Pointer(12, "../engine", global_step=40, epoch=2)
    path = tmp_path / "last.ckpt"
    path.write_bytes(pointer.to_bytes())
    assert read_pointer_file(path) == pointer
    name, content = pointer_file(str(tmp_path / "engine"), str(tmp_path / "checkpoint-3"), 3)
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / name).write_bytes(content)
    assert read_pointer(str(tmp_path / "checkpoint-3")) == (str(tmp_path / "engine"), 3)


def test_the_pointers_of_earlier_versions_read_as_the_same_record(tmp_path):
    lightning = {"format": "async_ckpt.lightning", "version": 1, "step": 5, "directory": "e",
                 "global_step": 9, "epoch": None}
    (tmp_path / "old.ckpt").write_text(json.dumps(lightning))
    assert read_pointer_file(tmp_path / "old.ckpt") == Pointer(5, "e", 9, None)
    (tmp_path / POINTER_NAME).write_text(json.dumps({"format": 1, "step": 7, "directory": "e"}))
    assert read_pointer_file(tmp_path / POINTER_NAME) == Pointer(7, "e")
    (tmp_path / POINTER_NAME).write_text(json.dumps({"format": 1, "step": 7, "directory": "e",
                                                     "epoch": 1}))  # not what it wrote
    with pytest.raises(PointerFileError, match="not the fields"):
        read_pointer_file(tmp_path / POINTER_NAME)


def test_what_is_not_a_pointer_of_ours_names_nothing(tmp_path):
    (tmp_path / "theirs.ckpt").write_bytes(b"\x80\x02}q\x00.")  # a pickle: torch.save's, older
    os.mkfifo(tmp_path / "fifo.ckpt")  # would block a plain open()
    (tmp_path / "dir.ckpt").mkdir()  # Lightning's sharded checkpoints are directories
    for name in ("theirs.ckpt", "fifo.ckpt", "dir.ckpt", "missing.ckpt"):
        assert read_pointer_file(tmp_path / name) is None
    # but a checkpoint directory's async_ckpt.json is ours by its name: anything else there is
    # reported, not taken for a directory the framework wrote
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    assert read_pointer(str(checkpoint)) is None
    (checkpoint / POINTER_NAME).write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(PointerFileError, match="not an async_ckpt pointer"):
        read_pointer(str(checkpoint))


def test_a_damaged_pointer_raises_its_typed_error_whatever_the_damage(tmp_path):
    """Fuzzed: cut, flipped and grown copies of a valid pointer are a valid pointer, nothing of
    ours, or PointerFileError; never another exception, never a read past the bound."""
    good = Pointer(3, "engine", 10, 0).to_bytes()
    path = tmp_path / "p.ckpt"
    rng = random.Random(0)
    outcomes = set()
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            at = rng.randrange(len(data))
            kind = rng.randrange(3)
            if kind == 0:
                data[at] = rng.randrange(256)
            elif kind == 1:
                del data[at:]
            else:
                data[at:at] = rng.choice([b"9" * 30, b" " * MAX_POINTER_BYTES, b'"', b"-1"])
        path.write_bytes(bytes(data))
        try:
            found = read_pointer_file(path)
        except PointerFileError:
            outcomes.add("error")
            continue
        outcomes.add("none" if found is None else "pointer")
        assert found is None or (isinstance(found.step, int) and found.directory)
    assert outcomes == {"error", "none", "pointer"}
