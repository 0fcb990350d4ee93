"""Hostile and damaged checkpoint directories: one test (or a few) per class of hole found.

Each test crafts the directory an attacker would (checksums recomputed: they prove nothing) and
asserts the rule of docs/SECURITY.md: a typed error, or the data of a committed snapshot; nothing
deleted outside the directory; nothing loaded before everything was checked. The fuzzer
(``test_fuzz.py``) explores the same space at random; these pin each class down.
"""

import copy
import json
import logging
import os
import re
import shutil
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.tools import cli
from async_ckpt.tools.common import EXIT_DAMAGE
from async_ckpt.errors import (CheckpointError, CorruptSnapshotError, InsufficientMemoryError,
                               LayoutError, ManifestError, NoSnapshotError, SnapshotWriteError,
                               StateMismatchError)
from async_ckpt.format.manifest import read_manifest
from async_ckpt.storage.local import remove_entries
from fuzzing import build_pristine, diff, hang_guard, make_state, rewrite_shard, fix_manifest

STEP2 = "step2-shard"
RNG_PATH = ("tree", "entries", "__async_ckpt_rng__", "state")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_pristine(str(tmp_path_factory.mktemp("pristine") / "ckpt"))


@pytest.fixture
def root(pristine, tmp_path):
    """A fresh copy of the pristine checkpoint (steps 1 and 2), with a sentinel next to it."""
    path = tmp_path / "ckpt"
    path.mkdir()
    pristine.write(str(path))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "precious").write_bytes(b"not the checkpoint's")
    return str(path)


def assert_outside_intact(root):
    parent = os.path.dirname(root)
    assert os.path.isdir(root)
    with open(os.path.join(parent, "outside", "precious"), "rb") as f:
        assert f.read() == b"not the checkpoint's"


def manifest_doc(root):
    with open(os.path.join(root, "manifest.json"), "rb") as f:
        return json.load(f)


def write_manifest_doc(root, doc):
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(doc, f)


def edit_index(pristine, root, alias, edit):
    """Rewrite a shard's index with ``edit(index)`` applied, trailer and manifest fixed up."""
    shard = pristine.shards[alias]
    index = copy.deepcopy(shard.index)
    edit(index)
    data, digest = rewrite_shard(shard.prefix, json.dumps(index, separators=(",", ":")).encode())
    with open(os.path.join(root, shard.relpath), "wb") as f:
        f.write(data)
    write_manifest_doc(root, fix_manifest(manifest_doc(root), shard.dir, len(data), digest))


def rng_state(index):
    node = index
    for key in RNG_PATH:
        node = node[key]
    return node


def restore_quietly(root, caplog):
    """Restore into a fresh state with an engine; returns (step, state) or the typed error."""
    state = make_state(7)
    before = copy.deepcopy(state["model"].state_dict())
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        try:
            with hang_guard(20, "restore"):
                return engine.restore(), state
        except CheckpointError as e:
            assert diff(before, state["model"].state_dict()) is None, "loaded before failing"
            return e, state


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert isinstance(code, int) and "Traceback" not in err + out
    return code, out, err


# --- 1. deletion outside the directory --------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside", "ABS", ".", "", "step-00000000000000000001.0000000a/..",
                                  "step-00000000000000000001.0000000a\x00"])
def test_a_manifest_naming_a_path_outside_is_refused_and_nothing_is_deleted(root, capsys, name):
    doc = manifest_doc(root)
    doc["snapshots"][0]["dir"] = os.path.join(os.path.dirname(root), "outside") if name == "ABS" else name
    write_manifest_doc(root, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(root))
    code, _, err = run_cli(capsys, "gc", root, "--keep-last", "1")
    assert code != 0 and "ManifestError" not in err  # a one-line message, not a class dump
    with pytest.raises(ManifestError):
        CheckpointEngine(root, make_state(0), heartbeat_interval=None)
    assert_outside_intact(root)
    assert sorted(os.listdir(root)) == sorted(os.listdir(root))  # still listable
    assert len([n for n in os.listdir(root) if n.startswith("step-")]) == 2


@pytest.mark.parametrize("when", [-6.1e16, 1e308, float("nan")])
def test_a_commit_time_no_date_can_show_is_refused(root, capsys, when):
    doc = manifest_doc(root)
    doc["snapshots"][0]["committed_at"] = when
    write_manifest_doc(root, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(root))
    for command in ("ls", "inspect", "verify"):
        assert run_cli(capsys, command, root)[0] == 1


@pytest.mark.parametrize("target", ["nowhere", "manifest.json"])  # dangling; a link to itself
def test_a_dangling_manifest_link_is_an_error_not_a_directory_without_commits(root, target):
    """Taken for "no manifest", it made every committed snapshot a leftover to delete."""
    os.unlink(os.path.join(root, "manifest.json"))
    os.symlink(os.path.join(root if target == "manifest.json" else os.path.dirname(root), target),
               os.path.join(root, "manifest.json"))
    with pytest.raises(ManifestError):
        CheckpointEngine(root, make_state(0), heartbeat_interval=None)
    assert len([n for n in os.listdir(root) if n.startswith("step-")]) == 2


def test_a_shard_file_name_that_is_a_path_is_refused(root):
    doc = manifest_doc(root)
    doc["snapshots"][1]["shards"][0]["file"] = "../../outside/precious"
    write_manifest_doc(root, doc)
    with pytest.raises(ManifestError):
        load(root)
    assert_outside_intact(root)


def test_deletion_removes_only_our_names_and_never_follows_symlinks(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "precious").write_bytes(b"x")
    link = root / "step-00000000000000000005.0000abcd"
    link.symlink_to(outside)
    real = root / "step-00000000000000000006.0000abcd"
    real.mkdir()
    (real / "inner-link").symlink_to(outside)
    (root / "notes.txt").write_bytes(b"keep")
    remove_entries(str(root), [link.name, real.name, "notes.txt", "..", str(outside), "."])
    assert sorted(os.listdir(root)) == ["notes.txt"]
    assert (outside / "precious").read_bytes() == b"x"


# --- 2. interpreter crash from RNG states -----------------------------------------------------


def _crash_numpy(index):
    rng_state(index)["numpy"]["$tuple"][2] = 10**6  # the legacy generator's position


def _bad_python_index(index):
    rng_state(index)["python"]["$tuple"][1]["$tuple"][624] = 10**6


@pytest.mark.parametrize("edit", [_crash_numpy, _bad_python_index])
def test_a_crafted_rng_state_falls_back_and_never_reaches_the_generator(pristine, root, caplog, edit):
    edit_index(pristine, root, STEP2, edit)
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        step, state = restore_quietly(root, caplog)
    assert step == 1 and "falling back" in caplog.text
    assert diff(pristine.refs[1][1]["model"], state["model"].state_dict()) is None
    np.random.random(10)  # would read out of bounds (and crash) with the crafted position
    code = subprocess.run([sys.executable, "-c", "import async_ckpt, numpy as np; "
                           f"async_ckpt.load({root!r}); np.random.random(10)"]).returncode
    assert code == 0


# --- 3. memory bombs --------------------------------------------------------------------------

_BOMB = r"""
import resource, sys, zstandard
from async_ckpt.errors import CorruptSnapshotError
from async_ckpt.format.shard import _unzstd_into
# 1 GiB of zeros declared in the frame header, 8 KiB in the index: a decoder that trusts the
# frame allocates 1 GiB, which this address-space limit refuses (MemoryError, not a typed error).
writer = zstandard.ZstdCompressor().compressobj(size=1 << 30)
frame = b"".join(writer.compress(bytes(1 << 20)) for _ in range(1024)) + writer.flush()
resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
try:
    _unzstd_into(frame, 8192, memoryview(bytearray(8192)), "shard", "chunk")
except CorruptSnapshotError as e:
    print("refused", len(frame))
"""


def test_a_zstd_frame_declaring_more_than_its_chunk_is_refused_before_allocating():
    out = subprocess.run([sys.executable, "-c", _BOMB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("refused"), out.stderr


@pytest.mark.parametrize("frame", ["no-content-size", "trailing-bytes", "two-frames", "short",
                                   "empty-frame-after", "skippable-frame-after", "long"])
def test_a_zstd_frame_that_is_not_exactly_the_chunk_is_damage(frame):
    import struct
    import zstandard
    from async_ckpt.format.shard import _unzstd_into
    data = bytes(range(256)) * 32
    z = zstandard.ZstdCompressor()
    good = z.compress(data)
    stored = {"no-content-size": zstandard.ZstdCompressor(write_content_size=False).compress(data),
              "trailing-bytes": good + b"junk", "two-frames": good + good,
              "short": good[:-3], "empty-frame-after": good + z.compress(b""),
              "skippable-frame-after": good + b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"skip",
              "long": z.compress(data + b"x")}[frame]
    for target in (memoryview(bytearray(len(data))), None):  # a read, and verify's check
        _unzstd_into(good, len(data), target, "shard", "chunk")
        assert target is None or bytes(target) == data
        with pytest.raises(CorruptSnapshotError):
            _unzstd_into(stored, len(data), target, "shard", "chunk")


# --- 4. untyped exceptions, no fallback, hangs ------------------------------------------------


def _tensor_field(field, value):
    def edit(index):
        index["tensors"][0][field] = value
    return edit


INDEX_EDITS = {
    "dtype-is-a-list": _tensor_field("dtype", ["float32"]),
    "zero-stride-2**80-elements": lambda i: i["tensors"][0].update(shape=[2**80], stride=[0]),
    "storage-is-a-list": _tensor_field("storage", [0]),
    "negative-tensor-reference": lambda i: i["tree"]["entries"]["extra"]["entries"]["zeros"].update(
        state={"$tensor": -1}),
    "root-is-a-list": lambda i: i.update(tree=[]),
    "root-is-a-value": lambda i: i.update(tree={"kind": "value", "state": 1}),
    "tree-nested-deep": lambda i: i.update(tree=_deep_tree(200)),
    "size-overflow": lambda i: i["tree"]["entries"]["extra"]["entries"].update(
        size={"kind": "value", "state": {"$size": [2**80]}}),
    "replicas-not-a-list": lambda i: i.update(replicas=5),
    # found by the 12,000-case fuzz run: restored as a value, {} turned an int slot into a dict,
    # and then no intact snapshot could be restored into it
    "str-keyed-dict-as-a-value": lambda i: i["tree"]["entries"]["extra"]["entries"].update(
        big={"kind": "value", "state": {}}),
    "module-metadata-not-versions": lambda i: i["tree"]["entries"]["model"].update(
        metadata={"": 5}),
    # found by the fuzz run that checks verify against load: verify passed both
    "malformed-ndarray-value": lambda i: i["tree"]["entries"]["extra"]["entries"].update(
        array={"kind": "value", "state": {"$ndarray": []}}),
    # found by a reviewer: a view of a storage restore never reads passed verify
    "replica-of-a-rank-no-shard-holds": lambda i: i["tensors"][0].update(rank=7),
    "own-rank-storage-past-the-table": lambda i: i["tensors"][0].update(rank=0, storage=999),
}


def _deep_tree(depth):
    node = {"kind": "value", "state": 0}
    for _ in range(depth):
        node = {"kind": "dict", "entries": {"x": node}}
    return node


@pytest.mark.parametrize("case", list(INDEX_EDITS))
def test_index_damage_is_typed_and_falls_back_to_the_previous_snapshot(pristine, root, caplog, capsys,
                                                                       case):
    edit_index(pristine, root, STEP2, INDEX_EDITS[case])
    with pytest.raises(CorruptSnapshotError):
        load(root, step=2)
    step, state = load(root)
    assert step == 1 and diff(pristine.refs[1][1], state) is None
    step, _ = restore_quietly(root, caplog)
    assert step == 1
    for command in ("verify", "inspect", "ls"):
        code, out, _ = run_cli(capsys, command, root)
        if command == "verify":  # every chunk verifies, but verify refuses what restore refuses
            assert code == EXIT_DAMAGE and "step 2" in out, out
    assert_outside_intact(root)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink-to-dir", "missing"])
def test_a_shard_that_is_not_a_regular_file_is_damage_and_never_hangs(pristine, root, capsys, kind):
    path = os.path.join(root, pristine.shards[STEP2].relpath)
    os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-dir":
        os.symlink(os.path.join(os.path.dirname(root), "outside"), path)
    with hang_guard(20, kind):
        step, _ = load(root)
        assert step == 1
        code, _, _ = run_cli(capsys, "verify", root)
        assert code != 0
    assert_outside_intact(root)


def test_a_fifo_in_place_of_the_manifest_is_a_typed_error(root):
    os.unlink(os.path.join(root, "manifest.json"))
    os.mkfifo(os.path.join(root, "manifest.json"))
    with hang_guard(20, "fifo manifest"), pytest.raises(ManifestError):
        load(root)


def test_an_optimizer_state_torch_cannot_load_is_refused_before_loading_anything(pristine, root,
                                                                                  caplog):
    edit_index(pristine, root, STEP2, lambda i: i["tree"]["entries"]["optimizer"]["state"][
        "param_groups"][0].update(params=[[0], 1]))
    state = make_state(7)
    before = copy.deepcopy(state["model"].state_dict())
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(StateMismatchError, match="optimizer"):
            engine.restore()
    assert diff(before, state["model"].state_dict()) is None


@pytest.mark.parametrize("path", [("model",), ("optimizer",), ("scheduler",), ("gen",),
                                  ("nprng",), ("extra",), ("extra", "zeros")],
                         ids=lambda p: ".".join(p))
def test_a_plain_value_never_replaces_a_registered_object_tensor_or_dict(pristine, root, path):
    """Issue 28, finding 1: a saved node turned into {"kind": "value"} was assigned over the
    module, optimizer, generator, dict or tensor registered there. Now: refused by name."""
    def edit(index):
        node = index["tree"]
        for key in path[:-1]:
            node = node["entries"][key]
        node["entries"][path[-1]] = {"kind": "value", "state": "pwned"}

    edit_index(pristine, root, STEP2, edit)
    state = make_state(7)
    registered = dict(state)
    held, epoch = state["extra"]["zeros"], state["extra"]["epoch"]
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(StateMismatchError, match=rf"{'.'.join(path)} \(saved a plain value"):
            engine.restore()
    assert all(state[k] is v for k, v in registered.items())
    assert state["extra"]["zeros"] is held and state["extra"]["epoch"] == epoch


@pytest.mark.parametrize("edit", [{"a": 1}, {"optimizer": {"param_groups": []}}],
                         ids=["new-attribute", "replaces-its-optimizer"])
def test_a_scheduler_state_with_keys_of_its_own_is_refused(pristine, root, edit):
    """Found by the 10,000-case fuzz run: torch's schedulers load a state by updating their
    attributes with it, so a crafted one added attributes or replaced the scheduler's optimizer
    (the scheduler was unusable afterwards, the intact snapshot could not repair it)."""
    def change(index):
        index["tree"]["entries"]["scheduler"]["state"].update(edit)

    edit_index(pristine, root, STEP2, change)
    state = make_state(7)
    before = dict(vars(state["scheduler"]))
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(StateMismatchError, match="saved state has .*which the registered"):
            engine.restore()
    assert vars(state["scheduler"]) == before and state["scheduler"].optimizer is state["optimizer"]


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4", "uint1",
                                   "uint7", "int1", "int4"])
def test_a_tensor_of_a_dtype_torch_cannot_copy_is_damage(pristine, root, dtype):
    """Issue 28, finding 2: such a tensor loaded, then failed at its first use (an internal
    torch assertion). Now the reader refuses it, and the writer never writes one."""
    def edit(index):
        record = next(r for r in index["tensors"] if r["dtype"] == "int32")
        record["dtype"] = dtype

    edit_index(pristine, root, STEP2, edit)
    with pytest.raises(CorruptSnapshotError, match=f"unknown dtype '{dtype}'"):
        load(root, 2)
    assert load(root)[0] == 1  # the newest intact snapshot


def test_the_writer_refuses_a_tensor_of_a_dtype_torch_cannot_copy(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt", {"t": {"w": torch.empty(4, dtype=torch.uint4)}},
                          heartbeat_interval=None) as engine:
        with pytest.raises(LayoutError, match="torch.uint4 tensors cannot be saved"):
            engine.snapshot(1, force=True)


def test_an_optimizer_that_refuses_its_state_half_way_is_put_back(pristine, root):
    """torch's AdamW installs a loaded state, then fails converting its `step`: found by the
    10,000-case fuzz run. Every object loaded before the refusal is put back too."""
    edit_index(pristine, root, STEP2, lambda i: i["tree"]["entries"]["optimizer"]["state"][
        "state"]["$dict"][0][1].update(step={}))
    state = make_state(7)
    before = {k: copy.deepcopy(state[k].state_dict()) for k in ("model", "optimizer", "scheduler")}
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(StateMismatchError, match="nothing was loaded"):
            engine.restore()
    for key, value in before.items():
        assert diff(value, state[key].state_dict()) is None, key


def _deep_directories(top, depth=1100):
    """``depth`` nested directories under ``top``, a file at the bottom (made iteratively, with
    paths relative to the last one: the full path is longer than PATH_MAX allows)."""
    os.makedirs(top)
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_leftover_1100_directories_deep_neither_crashes_start_up_nor_the_tools(root, capsys):
    """Issue 28, finding 4: CheckpointEngine(), ls, gc and verify raised RecursionError
    (os.walk, shutil.rmtree). Now the walks are iterative: the leftover is counted and removed
    as far as paths allow, with a warning for what is left, and the tools exit as usual."""
    leftover = os.path.join(root, "step-00000000000000000099.0badf00d")
    _deep_directories(leftover)
    try:
        assert cli.main(["ls", root]) == 0
        assert cli.main(["verify", root]) == 0
        assert cli.main(["gc", root, "--dry-run"]) == 0
        with CheckpointEngine(root, make_state(7), heartbeat_interval=None) as engine:
            assert engine.restore() == 2
        capsys.readouterr()
        assert not os.path.exists(leftover)  # start-up removed the leftover, all 1,100 levels
        assert_outside_intact(root)
    finally:  # pytest's own clean-up of old temporary directories would recurse too deep
        remove_entries(root, [os.path.basename(leftover)])


def test_a_directory_where_the_heartbeat_belongs_is_warned_about_not_fatal(tmp_path, caplog):
    """Issue 28, finding 4: every snapshot() raised IsADirectoryError. A heartbeat is about
    liveness: the snapshot goes on, and the warning says what is in the way, once."""
    root = tmp_path / "ckpt"
    (root / "heartbeat.rank00000.json").mkdir(parents=True)
    with CheckpointEngine(root, make_state(7), heartbeat_interval=0.0) as engine:
        for step in range(3):
            engine.snapshot(step, force=True)
        engine.wait()
    assert read_manifest(LocalStorage(str(root))).steps() == [0, 1, 2]
    warned = [r for r in caplog.records if "cannot write the heartbeat" in r.getMessage()]
    assert len(warned) == 1


PLANTED_LOCK = """
import sys
from async_ckpt import CheckpointEngine
from async_ckpt.errors import CheckpointDirError
try:
    CheckpointEngine(sys.argv[1], {"x": {"n": 1}}, heartbeat_interval=None)
except CheckpointDirError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink to a device"])
def test_a_device_planted_as_the_lock_file_is_refused_without_being_opened(tmp_path, kind):
    """Issue 28, finding 6: a character device at ``.lock-rank00000`` was opened O_RDWR|O_CREAT
    (opening a device can act) and only then found not to be a file. Issue 40: not even an open
    that would fail (the exclusive create), and no check-then-open race: the trace shows the
    name opened only with O_PATH, then refused (a typed error). A copy of /dev/null's device
    numbers needs CAP_MKNOD (root here): skipped where mknod is refused."""
    root = tmp_path / "ckpt"
    root.mkdir()
    planted = root / ".lock-rank00000"
    if kind == "fifo":
        os.mkfifo(planted)
    else:
        device = planted if kind == "device" else tmp_path / "device"
        try:
            os.mknod(device, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD, which this process lacks")
        if device != planted:
            os.symlink(device, planted)
    trace = tmp_path / "trace.txt"
    done = subprocess.run([shutil.which("strace"), "-f", "--seccomp-bpf", "-e", "trace=openat",
                           "-o", str(trace), sys.executable, "-c", PLANTED_LOCK, str(root)],
                          capture_output=True, text=True, timeout=120)  # --seccomp-bpf: only
    # the traced calls stop the process
    assert "refused:" in done.stdout and "is not a regular file" in done.stdout, done.stderr[-2000:]
    opens = [line for line in trace.read_text().splitlines()
             if ".lock-rank00000" in line or str(tmp_path / "device") in line]
    assert opens and all("O_PATH" in line and "O_NOFOLLOW" in line for line in opens), opens
    assert not any(mode in line for line in opens for mode in ("O_RDWR", "O_WRONLY", "O_CREAT"))


def test_a_manifest_the_reader_would_refuse_is_never_written(root):
    """Issue 28, finding 5: with ``next_seq`` at the reader's bound (2**62), the next commit wrote
    2**62 + 1, which the reader refuses: every committed snapshot became unreachable. Now the
    writer reads back what it would write: that commit fails, the manifest stays readable."""
    doc = manifest_doc(root)
    doc["next_seq"] = 2**62
    write_manifest_doc(root, doc)
    state = make_state(7)
    with pytest.raises(SnapshotWriteError, match="would not read back"):
        with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
            engine.snapshot(3, force=True)
            engine.wait()
    assert read_manifest(LocalStorage(root)).steps() == [1, 2]
    with CheckpointEngine(root, make_state(7), heartbeat_interval=None) as engine:
        assert engine.restore() == 2


def test_a_rebuilt_manifest_never_names_a_snapshot_that_refers_to_itself(tmp_path):
    """Issue 28, finding 5: rebuilding a lost manifest from a shard whose reference names its own
    directory wrote a manifest the reader refuses. Such a snapshot is not complete: left out."""
    pristine = build_pristine(str(tmp_path / "pristine"), "incremental")
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    pristine.write(root)
    own = pristine.shards[STEP2].dir
    edit_index(pristine, root, STEP2, lambda i: [s["ref"].update(dir=own) for s in i["storages"]
                                                 if "ref" in s])
    os.unlink(os.path.join(root, "manifest.json"))
    with CheckpointEngine(root, make_state(7), heartbeat_interval=None) as engine:
        assert engine.restore() == 1
    assert read_manifest(LocalStorage(root)).steps() == [1]


# --- 5. all or nothing ------------------------------------------------------------------------


def test_a_malformed_rng_entry_loads_nothing_when_there_is_no_fallback(pristine, root, caplog):
    edit_index(pristine, root, STEP2, lambda i: rng_state(i).update(torch={"$tensor": 0}))
    state = make_state(7)
    before = copy.deepcopy(state["model"].state_dict())
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(CorruptSnapshotError):
            engine.restore(step=2)
    assert diff(before, state["model"].state_dict()) is None


# --- 6. "larger than this machine's memory" is not corruption ---------------------------------


def test_too_little_memory_is_its_own_error_and_does_not_fall_back(root, monkeypatch):
    import async_ckpt.read.memory as memory

    class Tiny:
        available = 1000

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: Tiny)
    state = make_state(7)
    before = copy.deepcopy(state["model"].state_dict())
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        with pytest.raises(InsufficientMemoryError):
            engine.restore()
    assert diff(before, state["model"].state_dict()) is None
    with pytest.raises(InsufficientMemoryError):
        load(root)


def test_an_allocation_that_fails_anyway_is_insufficient_memory_not_a_torch_error(root,
                                                                                 monkeypatch):
    """Memory checked as usable can be gone when allocated (another process took it): torch's
    allocator error becomes InsufficientMemoryError (issue 28), which is not damage."""
    real = torch.empty

    def failing(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 GB")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing)
    with pytest.raises(InsufficientMemoryError, match="failed: the memory is not there now"):
        load(root)


LIMITED_LOAD = """
import resource, sys, torch
from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import InsufficientMemoryError
from async_ckpt.read.memory import _proc_status
with CheckpointEngine(sys.argv[1], {"w": {"t": torch.ones(4 << 20)}}, heartbeat_interval=None) as e:
    e.snapshot(1, force=True)
room = 8 << 20  # a 16 MB tensor cannot be read within 8 MB more than the process has mapped now
resource.setrlimit(resource.RLIMIT_AS, (_proc_status()["VmSize"] + room, resource.RLIM_INFINITY))
try:
    load(sys.argv[1])
except InsufficientMemoryError as e:
    print("refused:", e)
"""


def test_a_read_is_bounded_by_the_process_limit_not_only_by_free_memory(tmp_path):
    """Issue 28: under ``ulimit -v`` a read the machine had memory for failed with an untyped
    MemoryError (or a torch allocation error). The address-space limit counts now."""
    done = subprocess.run([sys.executable, "-c", LIMITED_LOAD, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # usable: the 8 MB of room, less what the process mapped since the limit was set (what the
    # read needs counts a decoding scratch per read thread: it depends on the machine's cores)
    assert re.search(r"refused: restoring step 1 needs 0\.[0-9]+ GB of host memory, 0\.0[01] GB "
                     "is usable now", done.stdout), done.stdout


def test_every_snapshot_damaged_says_so(pristine, root):
    edit_index(pristine, root, STEP2, INDEX_EDITS["root-is-a-list"])
    edit_index(pristine, root, "step1-shard", INDEX_EDITS["root-is-a-list"])
    with pytest.raises(NoSnapshotError):
        load(root)


def test_inspect_says_which_file_and_entry_hold_a_value_the_walker_refuses(pristine, root, capsys):
    def mixed_tag(index):  # a tag node with a second key: neither a tag nor a plain mapping
        entry = next(iter(index["tree"]["entries"]))
        index["tree"]["entries"][entry] = {"kind": "value", "state": {"$float": "nan", "x": 1}}

    edit_index(pristine, root, STEP2, mixed_tag)
    code, out, err = run_cli(capsys, "inspect", root, "--step", "2")
    assert code == 1 and pristine.shards[STEP2].relpath.split("/")[-1] in err
    assert "malformed state tree near" in err


# --- misaligned mapped views (issue 40) -------------------------------------------------------

def _every_dtype_state() -> dict:
    """One tensor of every dtype a snapshot may hold (``tensors.DTYPES``), of known bytes, plus
    the stride-0 complex128 view that crashed export (``clone`` of a view 8 bytes off its
    16-byte alignment)."""
    from async_ckpt.tensors import DTYPES
    g = torch.Generator().manual_seed(40)
    state = {}
    for name, dtype in DTYPES.items():
        t = torch.empty(6, dtype=dtype)
        bytes_ = t.view(torch.uint8)
        bytes_.copy_(torch.randint(0, 2 if dtype == torch.bool else 256, bytes_.shape,
                                   dtype=torch.uint8, generator=g))
        state[name] = t
    state["expanded"] = torch.full((1,), 1 + 2j, dtype=torch.complex128).expand(1000346)
    return state


def _relaid_misaligned(root: str, misalignment: int) -> None:
    """Rewrite step 1's shard as an older reader's file (version 1: chunks back to back) in which
    every storage starts ``misalignment`` bytes past a multiple of 16 (a filler storage before
    each), manifest fixed up: what an old file, or a crafted one, may hold."""
    from async_ckpt.format.shard import ChunkEncoder, ShardReader, ShardWriter
    record = read_manifest(LocalStorage(root)).find(1)
    path = os.path.join(root, record.dir, record.shards[0].file)
    with ShardReader(path) as reader:
        index = reader.index
        contents = []
        for i, s in enumerate(index["storages"]):
            out = bytearray(s["nbytes"])
            reader.read_storage(i, out)
            contents.append(out)
    os.unlink(path)
    writer = ShardWriter(path, ChunkEncoder(None), version=1)
    offset, number = 16, {}
    for i, data in enumerate(contents):
        filler = (misalignment - offset) % 16 or 16
        writer.add_storage(memoryview(bytes(filler)), 1, False)
        number[i] = 2 * i + 1
        writer.add_storage(memoryview(data), 1, False)  # element size 1, as for a storage that
        # tensors of several dtypes view: the storage's own fields say nothing of alignment
        offset += filler + len(data)
    tensors = [dict(t, storage=None if t["storage"] is None else number[t["storage"]])
               for t in index["tensors"]]
    size, digest = writer.finish({k: index[k] for k in ("step", "rank", "world_size", "created",
                                                         "tree")} | {"tensors": tensors})
    write_manifest_doc(root, fix_manifest(manifest_doc(root), record.dir, size, digest))


@pytest.mark.parametrize("misalignment", range(1, 16))
def test_a_misaligned_storage_is_never_handed_to_torch_as_a_misaligned_view(tmp_path, misalignment):
    """Issue 40: a mapped view is as aligned as the file put it; torch's kernels assume a dtype's
    alignment (complex128: 16 bytes) and an export's ``clone`` died of SIGSEGV. Every dtype at
    every misalignment: ``load(mmap=True)`` gives aligned tensors, equal to what was saved, that
    clone. In-process on purpose: a crash kills the test run."""
    state = _every_dtype_state()
    root = str(tmp_path / "ckpt")
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    _relaid_misaligned(root, misalignment)
    for mmap in (True, False):
        step, loaded = load(root, mmap=mmap, verify=True)
        assert step == 1 and loaded.keys() == state.keys()
        for name, saved in state.items():
            got = loaded[name]
            assert got.dtype == saved.dtype and got.shape == saved.shape
            assert got.data_ptr() % got.element_size() == 0, (name, mmap)
            copy_ = got.clone()
            assert copy_.view(torch.uint8).equal(saved.clone().view(torch.uint8)), (name, mmap)


def test_the_misaligned_view_of_the_issue_exports_to_safetensors(tmp_path, capsys):
    """Issue 40 as reported: `async-ckpt export --to x.safetensors` of a snapshot holding a
    stride-0 complex128 view 8 bytes off its alignment died of SIGSEGV in the export's clone.
    Now the copy is made, and safetensors (which has no complex128) refuses it in one line."""
    state = {"x": torch.full((1,), 1 + 2j, dtype=torch.complex128).expand(1000346)}
    root = str(tmp_path / "ckpt")
    with CheckpointEngine(root, state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    _relaid_misaligned(root, 8)
    code, out, err = run_cli(capsys, "export", root, "--to", str(tmp_path / "x.safetensors"))
    assert code == 2 and err.count("\n") == 1 and "safetensors cannot hold" in err, err
    code, out, err = run_cli(capsys, "export", root, "--to", str(tmp_path / "x.pt"))
    assert code == 0 and torch.load(tmp_path / "x.pt")["x"].equal(state["x"])


def test_a_tensor_record_over_misaligned_memory_is_built_over_an_aligned_copy():
    """The last line of defence: whatever buffer a record views, the tensor built on it is
    aligned for its dtype (a copy of the bytes it views where the buffer is not)."""
    from async_ckpt.format.records import StoredTensor
    from async_ckpt.read.snapshot import _tensor_from_record
    backing = torch.arange(64, dtype=torch.uint8)
    buffer = backing[8:]  # 8 bytes off the allocation's 64-byte alignment
    record = StoredTensor(0, 16, "complex128", (3, 2), (0, 1))
    t = _tensor_from_record(record, {(0, 0): buffer}, 0, "shard", 0)
    assert t.data_ptr() % 16 == 0 and t.stride() == (0, 1)
    assert t.clone().view(torch.uint8).reshape(-1).equal(backing[24:56].repeat(3))


# --- hyper-parameters of the wrong type or structure (issue 40) --------------------------------

def _edit_step(root, step, edit):
    """Rewrite the shard of ``step`` (one rank) with ``edit(index)`` applied, trailer and
    manifest fixed up."""
    record = read_manifest(LocalStorage(root)).find(step)
    path = os.path.join(root, record.dir, record.shards[0].file)
    data = open(path, "rb").read()
    offset, length = struct.unpack("<QQ", data[-32:-16])
    index = json.loads(data[offset:offset + length])
    edit(index)
    data, digest = rewrite_shard(data[:offset], json.dumps(index, separators=(",", ":")).encode())
    with open(path, "wb") as f:
        f.write(data)
    write_manifest_doc(root, fix_manifest(manifest_doc(root), record.dir, len(data), digest))


def _training(optimizer: str, scheduler: str) -> dict:
    """A model, a torch optimizer and scheduler of the given kinds, after two steps."""
    from torch.optim import lr_scheduler as lrs
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2),
           "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[optimizer](model.parameters())
    sched = {"step": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
             "lambda": lambda o: lrs.LambdaLR(o, lambda epoch: 0.9 ** epoch),
             "onecycle": lambda o: lrs.OneCycleLR(o, max_lr=0.1, total_steps=20),
             "sequential": lambda o: lrs.SequentialLR(
                 o, [lrs.ConstantLR(o, factor=0.5, total_iters=2), lrs.ExponentialLR(o, 0.9)],
                 milestones=[2])}[scheduler](opt)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _step(state):
    state["model"](torch.ones(4, 3)).sum().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()


COMBINATIONS = [("adam", "step"), ("adamw-fused", "lambda"), ("sgd", "onecycle"),
                ("adam", "sequential")]


@pytest.mark.parametrize("optimizer,scheduler", COMBINATIONS)
def test_hyper_parameters_of_real_optimizers_and_schedulers_round_trip(tmp_path, optimizer,
                                                                       scheduler):
    """What the checks must let through: every saved group and scheduler state, into objects
    built alike; training continues exactly as if never interrupted."""
    state = _training(optimizer, scheduler)
    for _ in range(2):
        _step(state)
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(2, force=True)
    _step(state)
    again = _training(optimizer, scheduler)
    with CheckpointEngine(tmp_path / "ckpt", again, heartbeat_interval=None) as engine:
        assert engine.restore() == 2
    _step(again)
    assert diff(state["model"].state_dict(), again["model"].state_dict()) is None
    assert state["scheduler"].get_last_lr() == again["scheduler"].get_last_lr()


def test_an_optimizer_restores_without_the_scheduler_it_was_saved_with_and_with_one(tmp_path):
    """What a scheduler adds to its optimizer's groups (``initial_lr``, OneCycleLR's bounds) is
    not the optimizer's structure: an optimizer restores without it, and with it."""
    state = _training("sgd", "onecycle")
    _step(state)
    with CheckpointEngine(tmp_path / "a", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    with CheckpointEngine(tmp_path / "b", {"model": state["model"],
                                           "optimizer": state["optimizer"]},
                          heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    plain = _training("sgd", "onecycle")
    del plain["scheduler"]
    plain["optimizer"] = torch.optim.SGD(plain["model"].parameters(), lr=0.1, momentum=0.9)
    with CheckpointEngine(tmp_path / "a", plain, heartbeat_interval=None) as engine:
        assert engine.restore(strict=False) == 1
    assert plain["optimizer"].param_groups[0]["max_lr"] == 0.1
    full = _training("sgd", "onecycle")
    del full["scheduler"]
    with CheckpointEngine(tmp_path / "b", full, heartbeat_interval=None) as engine:
        assert engine.restore() == 1
    _step({**full, "scheduler": torch.optim.lr_scheduler.StepLR(full["optimizer"], 1)})


def test_an_optimizer_state_of_an_older_torch_without_newer_options_restores(tmp_path):
    """An option a later torch added (``decoupled_weight_decay``, ``fused``) is missing from a
    group saved by an older one: the optimizer's class fills it in, so it is not refused; one it
    does not fill in (``eps``) is (HOSTILE_HYPER_PARAMETERS)."""
    state = _training("adam", "step")
    _step(state)
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    def older(index):  # which also kept the steps as numbers
        for k in ("decoupled_weight_decay", "fused"):
            _group(index).pop(k)
        for n in range(2):
            _parameter_state(index, n)["step"] = 1.0

    _edit_step(str(tmp_path / "ckpt"), 1, older)
    again = _training("adam", "step")
    with CheckpointEngine(tmp_path / "ckpt", again, heartbeat_interval=None) as engine:
        assert engine.restore() == 1
    assert again["optimizer"].param_groups[0]["decoupled_weight_decay"] is False
    assert torch.is_tensor(next(iter(again["optimizer"].state.values()))["step"])
    _step(again)


def _group(index):
    return index["tree"]["entries"]["optimizer"]["state"]["param_groups"][0]


def _parameter_state(index, n=0):
    return index["tree"]["entries"]["optimizer"]["state"]["state"]["$dict"][n][1]


def _scheduler_state(index):
    return index["tree"]["entries"]["scheduler"]["state"]


HOSTILE_HYPER_PARAMETERS = {
    # name: (optimizer, scheduler, edit of the index, what the error names)
    "lr as a string": ("adam", "step", lambda i: _group(i).update(lr="0.01"),
                       r"param_groups\[0\]\.lr is a str"),
    "differentiable added to a fused AdamW": (
        "adamw-fused", "lambda", lambda i: _group(i).update(differentiable=True),
        r"param_groups\[0\]\.differentiable is True"),
    "fused turned on": ("adam", "step", lambda i: _group(i).update(fused=True),
                        r"param_groups\[0\]\.fused is True, the optimizer's None"),
    "foreach turned off": ("sgd", "onecycle", lambda i: _group(i).update(foreach=False),
                           r"param_groups\[0\]\.foreach is False"),
    "a key the optimizer lacks": ("sgd", "step", lambda i: _group(i).update(betas=[0.9, 0.99]),
                                  r"param_groups\[0\] has betas"),
    "a key the optimizer needs removed": ("adam", "step", lambda i: _group(i).pop("eps"),
                                          r"param_groups\[0\] lacks eps"),
    "betas of three": ("adam", "step",
                       lambda i: _group(i).update(betas={"$tuple": [0.9, 0.99, 0.5]}),
                       r"param_groups\[0\]\.betas is not a list of 2"),
    "a beta as a string": ("adam", "step", lambda i: _group(i).update(betas=["0.9", 0.99]),
                           r"param_groups\[0\]\.betas\[0\] is a str"),
    "weight decay as None": ("sgd", "step", lambda i: _group(i).update(weight_decay=None),
                             r"param_groups\[0\]\.weight_decay is None"),
    "maximize as a number": ("adam", "step", lambda i: _group(i).update(maximize=1),
                             r"param_groups\[0\]\.maximize is 1"),
    "a scheduler's bound that is not a number": (
        "sgd", "onecycle", lambda i: _group(i).update(max_lr="0.1"),
        r"param_groups\[0\]\.max_lr is a str"),
    "a scheduler's bound the optimizer lacks, not a number": (
        "adam", "step", lambda i: _group(i).update(max_lr=[1]), r"max_lr is a list, not a number"),
    "a parameter's step as a string": (
        "adam", "step", lambda i: _parameter_state(i, 1).update(step="3"),
        r"saved step of parameter 1 is a str, not a number"),
    "a parameter's step as a number where a fused AdamW keeps a tensor": (
        "adamw-fused", "lambda", lambda i: _parameter_state(i).update(step=1.0),
        r"saved step of parameter 0 is 1.0, not the tensor fused and capturable kernels keep"),
    "a moment as None": ("adam", "step", lambda i: _parameter_state(i).update(exp_avg=None),
                         r"saved exp_avg of parameter 0 is None, not a tensor of the parameter"),
    "a momentum buffer as a list": (
        "sgd", "step", lambda i: _parameter_state(i).update(momentum_buffer=[1.0]),
        r"saved momentum_buffer of parameter 0 is a list"),
    "a parameter's state of a kind no optimizer keeps": (
        "adam", "step", lambda i: _parameter_state(i).update(note={"a": 1}),
        r"saved note of parameter 0 is a dict, not a tensor, a number, None or a list of them"),
    "a scheduler's gamma as a string": ("adam", "step",
                                        lambda i: _scheduler_state(i).update(gamma="x"),
                                        r"saved gamma is a str"),
    "a lambda's state as a number": ("adam", "lambda",
                                     lambda i: _scheduler_state(i).update(lr_lambdas=[3]),
                                     r"saved lr_lambdas\[0\] is 3"),
    "a one-cycle phase's bound as a number": (
        "sgd", "onecycle", lambda i: _scheduler_state(i)["_schedule_phases"][0].update(start_lr=1),
        r"_schedule_phases\[0\]\.start_lr is 1"),
    "a sequence's inner scheduler with a key too many": (
        "adam", "sequential", lambda i: _scheduler_state(i)["_schedulers"][1].update(optimizer=1),
        r"_schedulers\[1\] has optimizer"),
    "a sequence of one scheduler": (
        "adam", "sequential", lambda i: _scheduler_state(i)["_schedulers"].pop(),
        r"_schedulers is not a list of 2"),
}


@pytest.mark.parametrize("case", HOSTILE_HYPER_PARAMETERS)
def test_hyper_parameters_of_another_type_or_structure_are_refused_before_loading(tmp_path, case):
    """Issue 40: ``lr`` as a string, or ``differentiable`` added to a fused Adam, restored without
    complaint and the next ``step()`` raised. The saved groups and scheduler states must now have
    the registered objects' keys and value types (and the same kernel options): a typed error
    naming the key, nothing loaded, training goes on."""
    optimizer, scheduler, edit, named = HOSTILE_HYPER_PARAMETERS[case]
    state = _training(optimizer, scheduler)
    _step(state)
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    _edit_step(str(tmp_path / "ckpt"), 1, edit)
    again = _training(optimizer, scheduler)
    before = copy.deepcopy((again["optimizer"].state_dict(), again["scheduler"].state_dict()))
    with CheckpointEngine(tmp_path / "ckpt", again, heartbeat_interval=None) as engine:
        with pytest.raises(StateMismatchError, match=named):
            engine.restore()
    assert diff(before, (again["optimizer"].state_dict(), again["scheduler"].state_dict())) is None
    _step(again)
