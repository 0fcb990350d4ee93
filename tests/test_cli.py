"""The `async-ckpt` command line on real snapshots, intact and damaged: output and exit codes.

Most tests call ``main(argv)`` in-process; a few run the installed console script and
``python -m async_ckpt`` as subprocesses. Snapshots are written once per module by real engines
(steps 0 and 10 raw, 20 and 30 compressed) and copied into each test's tmp_path.
"""

import datetime
import enum
import io
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.tools import gc as gc_command
from async_ckpt.tools.cli import main
from async_ckpt.tools.common import EXIT_DAMAGE
from async_ckpt.errors import CheckpointDirError, NoSnapshotError
from async_ckpt.format.manifest import read_manifest
from conftest import assert_same, make_training_state, train_step

STEPS = [0, 10, 20, 30]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("template") / "ckpt")
    model, opt, sched = make_training_state(seed=3)
    state = {"model": model, "optimizer": opt, "scheduler": sched,
             "extra": {"epoch": 7, "name": "run-1", "mask": torch.tensor([True, False, True])}}
    for steps, compression in (([0, 10], None), ([20, 30], "zstd")):
        with CheckpointEngine(root, state, keep_last=10, compression=compression) as engine:
            for step in steps:
                train_step(model, opt, sched)
                engine.snapshot(step)
    return root


@pytest.fixture
def ckpt(template, tmp_path):
    """A private copy of the template checkpoint directory."""
    target = str(tmp_path / "ckpt")
    shutil.copytree(template, target)
    return target


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def shard_path(root, step):
    record = read_manifest(LocalStorage(root)).find(step)
    return os.path.join(root, record.dir, record.shards[0].file)


def chunk_offset(root, step, storage):
    from async_ckpt.format.shard import ShardReader
    with ShardReader(shard_path(root, step)) as reader:
        return reader.index["storages"][storage]["chunks"][0]["offset"]


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path, nbytes=100):
    os.truncate(path, os.path.getsize(path) - nbytes)


def add_leftovers(root):
    stray = os.path.join(root, "step-00000000000000000099.0badf00d")
    os.mkdir(stray)
    with open(os.path.join(stray, "rank-00000.ackpt"), "wb") as f:
        f.write(b"half a shard")
    with open(os.path.join(root, "manifest.json.tmp-4242"), "w") as f:
        f.write("{")
    return ["manifest.json.tmp-4242", "step-00000000000000000099.0badf00d"]


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("async-ckpt: error: "), err
    assert "Traceback" not in err
    return lines[0]


# --- ls ------------------------------------------------------------------------------------------


def test_ls_lists_committed_snapshots_in_commit_order_and_leftovers_apart(capsys, ckpt):
    add_leftovers(ckpt)
    code, out, err = run(capsys, "ls", ckpt)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "4 committed snapshots" in lines[0]
    rows = [line.split() for line in lines[2:6]]
    assert [int(r[0]) for r in rows] == STEPS
    assert all(r[-1] != "DAMAGED" for r in rows)
    assert lines[5].endswith("<- newest") and "<- newest" not in "".join(lines[2:5])
    leftover_section = out.split("leftovers of snapshots that never committed")[1]
    assert "step-00000000000000000099.0badf00d" in leftover_section and "step 99" in leftover_section
    assert "manifest.json.tmp-4242" in leftover_section
    assert "step-00000000000000000099" not in out.split("leftovers")[0]


def test_ls_json_matches_the_manifest(capsys, ckpt):
    add_leftovers(ckpt)
    code, out, _ = run(capsys, "ls", ckpt, "--json")
    assert code == 0
    doc = json.loads(out)
    manifest = read_manifest(LocalStorage(ckpt))
    assert doc["newest_step"] == 30 and doc["manifest"] is True
    assert [s["step"] for s in doc["snapshots"]] == STEPS
    for s, record in zip(doc["snapshots"], manifest.snapshots):
        assert (s["dir"], s["raw_bytes"], s["stored_bytes"], s["world_size"], s["committed_at"]) == (
            record.dir, record.raw_bytes, record.stored_bytes, record.world_size, record.committed_at)
        assert s["ratio"] == pytest.approx(record.raw_bytes / record.stored_bytes, rel=1e-3)
        assert s["problems"] == [] and s["newest"] == (s["step"] == 30)
    assert {(x["name"], x["kind"], x["step"]) for x in doc["leftovers"]} == {
        ("manifest.json.tmp-4242", "manifest-tmp", None),
        ("step-00000000000000000099.0badf00d", "snapshot", 99)}
    assert [x["bytes"] for x in doc["leftovers"] if x["kind"] == "snapshot"] == [12]


def test_ls_flags_missing_and_truncated_shards(capsys, ckpt):
    truncate(shard_path(ckpt, 10))
    os.unlink(shard_path(ckpt, 30))
    code, out, _ = run(capsys, "ls", ckpt)
    assert code == 1
    assert "step 30: step-00000000000000000030" in out and "is missing" in out
    assert "the manifest recorded" in out
    doc = json.loads(run(capsys, "ls", ckpt, "--json")[1])
    assert [bool(s["problems"]) for s in doc["snapshots"]] == [False, True, False, True]


def test_ls_of_a_directory_an_engine_opened_but_never_committed(capsys, tmp_path):
    root = str(tmp_path / "fresh")
    with CheckpointEngine(root, {"t": torch.zeros(2)}):
        pass
    code, out, _ = run(capsys, "ls", root)
    assert code == 1 and "no committed snapshot" in out  # as inspect, verify and export exit
    assert json.loads(run(capsys, "ls", root, "--json")[1])["snapshots"] == []


# --- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_tensors_values_and_totals_per_entry(capsys, ckpt):
    code, out, err = run(capsys, "inspect", ckpt)
    assert code == 0 and err == ""
    assert out.startswith("step 30 (newest)")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["model.0.weight"] == ["float32", "[32,", "32]", "4.1", "kB", "planes"]
    assert rows["model.0.bias"][:2] == ["float32", "[32]"]
    assert rows["optimizer.state.0.exp_avg_sq"][:3] == ["float32", "[32,", "32]"]
    assert rows["optimizer.state.0.step"][:2] == ["float32", "[]"]
    assert rows["optimizer.param_groups.0.lr"] == ["0.005"]  # StepLR halved it
    assert rows["optimizer.param_groups.0.betas"] == ["(0.9,", "0.999)"]
    assert rows["optimizer.param_groups.0.params"] == ["[0,", "1,", "2,", "3]"]
    assert rows["scheduler.gamma"] == ["0.5"]
    assert rows["extra.epoch"] == ["7"] and rows["extra.name"] == ["'run-1'"]
    assert rows["extra.mask"][:2] == ["bool", "[3]"]
    totals = out.split("totals per entry")[1]
    total_rows = {line.split()[0]: line.split()[1:] for line in totals.splitlines()[2:]}
    assert total_rows["model"][:2] == ["object", "4"]
    assert total_rows["optimizer"][:2] == ["object", "12"]
    assert total_rows["scheduler"][:2] == ["object", "0"]
    assert total_rows["extra"][:2] == ["dict", "1"]
    assert total_rows["extra"][-1] == "2"  # epoch and name


def test_inspect_an_older_step_shows_its_codec_and_reads_no_tensor_data(capsys, ckpt, monkeypatch):
    from async_ckpt.format.shard import ShardReader

    def refuse(*args, **kwargs):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(ShardReader, "read_storage", refuse)
    monkeypatch.setattr(ShardReader, "verify", refuse)
    flip_byte(shard_path(ckpt, 0), chunk_offset(ckpt, 0, 0))  # data damage: the index is intact
    code, out, _ = run(capsys, "inspect", ckpt, "--step", "0")
    assert code == 0 and out.startswith("step 0 in")
    weight = next(line for line in out.splitlines() if line.split()[:1] == ["model.0.weight"])
    assert weight.split()[-1] == "raw"


def test_inspect_reports_damaged_index_and_unknown_step(capsys, ckpt):
    truncate(shard_path(ckpt, 30))
    code, _, err = run(capsys, "inspect", ckpt)
    assert code == 1 and "async-ckpt verify" in one_error_line(err)
    code, _, err = run(capsys, "inspect", ckpt, "--step", "5")
    assert code == 2 and "committed steps: 0, 10, 20, 30" in one_error_line(err)


# --- verify --------------------------------------------------------------------------------------


def test_verify_intact_newest(capsys, ckpt):
    code, out, err = run(capsys, "verify", ckpt)
    assert code == 0 and err == ""  # no progress bar when stderr is not a terminal
    assert "step 30" in out and "DAMAGED" not in out
    assert "restore() would pick step 30" in out
    assert out.rstrip().endswith("intact: 1 of 1 snapshot asked for")


def test_verify_reports_every_damaged_chunk_and_the_fallback(capsys, ckpt):
    path = shard_path(ckpt, 30)
    flip_byte(path, chunk_offset(ckpt, 30, 0) + 3)
    flip_byte(path, chunk_offset(ckpt, 30, 2) + 1)
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1
    assert f"{path}: storage 0 chunk 0 fails its checksum" in out
    assert f"{path}: storage 2 chunk 0 fails its checksum" in out
    assert "step 20" in out and "checked to find what restore() would pick" in out
    assert "restore() would pick step 20" in out
    assert load(ckpt)[0] == 20  # the library agrees
    code, out, _ = run(capsys, "verify", ckpt, "--all")
    assert code == 1 and "DAMAGED: 1 of 4 snapshots" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  step")] == [
        "30", "20", "10", "0"]


def test_verify_a_named_intact_step_passes_while_the_newest_is_damaged(capsys, ckpt):
    truncate(shard_path(ckpt, 30))
    code, out, _ = run(capsys, "verify", ckpt, "--step", "10")
    assert code == 0
    assert "has" in out and "the manifest recorded" in out  # step 30 checked for the pick
    assert "restore() would pick step 20" in out
    code, out, _ = run(capsys, "verify", ckpt, "--step", "30")
    assert code == 1 and "DAMAGED" in out


def test_verify_missing_file_and_nothing_intact(capsys, ckpt):
    for step in STEPS:
        os.unlink(shard_path(ckpt, step))
    code, out, _ = run(capsys, "verify", ckpt, "--all")
    assert code == 1
    assert out.count("is missing; the snapshot is incomplete") == 4
    assert "restore() would find no intact snapshot" in out
    with pytest.raises(NoSnapshotError):
        load(ckpt)


def test_verify_reports_a_shard_of_an_unknown_format_version(capsys, ckpt):
    path = shard_path(ckpt, 30)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1 and "format version 99" in out
    assert "restore() would pick step 20" in out


def test_verify_shows_progress_only_on_a_terminal(capsys, ckpt, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["verify", ckpt, "--all"]) == 0
    assert "verifying" in terminal.getvalue()


# --- a damaged or foreign manifest, and bad invocations -----------------------------------------


def test_garbage_manifest_is_one_line_and_verify_checks_what_is_on_disk(capsys, ckpt):
    add_leftovers(ckpt)
    before = sorted(os.listdir(ckpt))
    with open(os.path.join(ckpt, "manifest.json"), "wb") as f:
        f.write(b"\x00garbage{")
    for argv in (["ls", ckpt], ["inspect", ckpt], ["gc", ckpt, "--keep-last", "1"],
                 ["export", ckpt, "--step", "30", "--to", os.path.join(ckpt, "..", "x.pt")]):
        code, out, err = run(capsys, *argv)
        assert code == 1, argv
        assert "manifest.json is not valid JSON" in one_error_line(err)
    assert sorted(os.listdir(ckpt)) == before  # gc removed nothing
    code, out, err = run(capsys, "verify", ckpt)
    assert code == 1 and "manifest.json is not valid JSON" in one_error_line(err)
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("  step")}
    assert set(rows) == {"0", "10", "20", "30", "99"}
    assert all("intact (1 shard file)" in rows[s] for s in ("0", "10", "20", "30"))
    assert "DAMAGED" in rows["99"]


def test_manifest_of_an_unknown_version(capsys, ckpt):
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["version"] = 4
    with open(path, "w") as f:
        json.dump(doc, f)
    for command in ("ls", "verify", "inspect", "gc"):
        code, _, err = run(capsys, command, ckpt)
        assert code == 1 and "manifest version 4" in one_error_line(err)


def test_usage_errors_exit_2_with_one_line(capsys, tmp_path, ckpt):
    not_ckpt = tmp_path / "empty"
    not_ckpt.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["ls", tmp_path / "missing"], "does not exist"),
        (["ls", a_file], "is not a directory"),
        (["verify", not_ckpt], "is not an async_ckpt checkpoint directory"),
        (["verify", ckpt, "--step", "11"], "step 11 is not committed"),
        (["export", ckpt, "--step", "11", "--to", tmp_path / "x.pt"], "step 11 is not committed"),
        (["export", ckpt, "--step", "30", "--to", tmp_path / "x.npz"], "must end in .pt or .safetensors"),
        (["export", ckpt, "--step", "30", "--to", tmp_path / "x.pt", "--only", "nope"],
         "entries: model, optimizer, scheduler, extra"),
        (["export", ckpt, "--step", "30", "--to", tmp_path / "no" / "x.pt"], "does not exist"),
        (["export", ckpt, "--step", "30", "--to", tmp_path / "x.safetensors", "--only", "scheduler"],
         "holds no tensors"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert message in one_error_line(err), argv
    assert not os.path.exists(tmp_path / "x.pt") and not os.path.exists(tmp_path / "x.safetensors")
    for argv in (["verify", ckpt, "--step", "3", "--all"], ["gc", ckpt, "--keep-last", "0"],
                 ["inspect", ckpt, "--step", "x"], ["frobnicate"], []):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "error:" in err and "Traceback" not in err, argv


@pytest.mark.parametrize("module, extra, argv", [
    ("tqdm", "cli", ["verify", "{ckpt}"]),
    ("tqdm", "cli", ["gc", "{ckpt}", "--keep-last", "1"]),
])
def test_a_command_whose_extra_is_missing_says_what_to_install(capsys, ckpt, tmp_path, monkeypatch,
                                                               module, extra, argv):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    before = sorted(os.listdir(ckpt))
    code, out, err = run(capsys, *[a.format(ckpt=ckpt, out=tmp_path) for a in argv])
    assert code == 2
    assert f"needs {module}, which is not installed: pip install 'async_ckpt[{extra}]'" in (
        one_error_line(err))
    assert sorted(os.listdir(ckpt)) == before and not os.path.exists(tmp_path / "x.safetensors")


def test_help_documents_every_command_and_the_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("ls", "inspect", "verify", "export", "gc", "compare-loss"):
        assert command in out
    assert "exit codes:" in out and "0  fine" in out and "1  damage" in out and "2  usage" in out
    code, out, _ = run(capsys, "gc", "--help")
    assert code == 0 and "--keep-last" in out and "--dry-run" in out and "exit codes:" in out


# --- export --------------------------------------------------------------------------------------


def test_export_pt_round_trips_everything_or_one_entry(capsys, ckpt, tmp_path):
    target = tmp_path / "all.pt"
    code, out, _ = run(capsys, "export", ckpt, "--step", 20, "--to", target)
    assert code == 0 and "exported step 20 (all entries)" in out
    expected = load(ckpt, 20)[1]
    assert_same(expected, torch.load(target, weights_only=False))

    model_file = tmp_path / "model.pt"
    assert run(capsys, "export", ckpt, "--step", 20, "--to", model_file, "--only", "model")[0] == 0
    model = make_training_state(seed=9)[0]
    model.load_state_dict(torch.load(model_file))  # a plain state_dict, loadable with weights_only
    assert_same(dict(expected["model"]), dict(model.state_dict()))

    code, _, err = run(capsys, "export", ckpt, "--step", 30, "--to", model_file, "--only", "model")
    assert code == 2 and "--force" in one_error_line(err)
    assert run(capsys, "export", ckpt, "--step", 30, "--to", model_file, "--only", "model",
               "--force")[0] == 0
    assert_same(dict(load(ckpt, 30)[1]["model"]), dict(torch.load(model_file)))


def test_export_safetensors_keys_are_key_paths(capsys, ckpt, tmp_path):
    target = tmp_path / "model.safetensors"
    code, out, _ = run(capsys, "export", ckpt, "--step", 30, "--to", target, "--only", "model")
    assert code == 0 and "4 tensors" in out
    model = make_training_state(seed=9)[0]
    model.load_state_dict(load_file(str(target)))
    assert_same(dict(load(ckpt, 30)[1]["model"]), dict(model.state_dict()))

    everything = tmp_path / "all.safetensors"
    code, out, _ = run(capsys, "export", ckpt, "--step", 30, "--to", everything)
    assert code == 0
    tensors = load_file(str(everything))
    state = load(ckpt, 30)[1]
    assert torch.equal(tensors["optimizer.state.2.exp_avg"], state["optimizer"]["state"][2]["exp_avg"])
    assert torch.equal(tensors["extra.mask"], state["extra"]["mask"])
    assert "optimizer.param_groups" in out and "scheduler.gamma" in out  # named as left out
    from safetensors import safe_open
    with safe_open(str(everything), "pt") as f:
        assert f.metadata()["async_ckpt.step"] == "30"


def test_export_shared_and_strided_tensors_to_safetensors(capsys, tmp_path):
    root = str(tmp_path / "tied")
    embedding = torch.nn.Embedding(6, 4)
    head = torch.nn.Linear(4, 6, bias=False)
    head.weight = embedding.weight  # tied
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    transposed = torch.randn(4, 6).t()
    with CheckpointEngine(root, {"model": model, "transposed": transposed}) as engine:
        engine.snapshot(1)
    code, out, _ = run(capsys, "inspect", root)
    assert code == 0 and "(shares storage with model.embedding.weight)" in out
    target = tmp_path / "tied.safetensors"
    assert run(capsys, "export", root, "--step", 1, "--to", target)[0] == 0
    tensors = load_file(str(target))
    assert torch.equal(tensors["model.head.weight"], embedding.weight.detach())
    assert torch.equal(tensors["model.embedding.weight"], embedding.weight.detach())
    assert torch.equal(tensors["transposed"], transposed)


def test_pickled_values_are_summarised_and_exported_only_on_request(capsys, tmp_path):
    root = str(tmp_path / "pickled")
    when = datetime.date(2024, 2, 29)  # no safe encoding: pickled under allow_pickle=True
    with CheckpointEngine(root, {"w": torch.ones(2), "meta": {"when": when}}, allow_pickle=True) as engine:
        engine.snapshot(0)
    code, out, _ = run(capsys, "inspect", root)
    assert code == 0 and "meta.when" in out and "pickled object" in out and "not decoded" in out
    target = tmp_path / "out.pt"
    code, _, err = run(capsys, "export", root, "--step", 0, "--to", target)
    assert code == 2 and "--allow-pickle" in one_error_line(err) and not target.exists()
    assert run(capsys, "export", root, "--step", 0, "--to", target, "--allow-pickle")[0] == 0
    assert torch.load(target, weights_only=False)["meta"]["when"] == when


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


def test_verify_passes_values_that_differ_only_once_unpickled_or_read(capsys, tmp_path):
    """verify rebuilds the state tree as restore does without unpickling or reading a tensor:
    values distinct in the snapshot (enum members as keys, a tuple of tensors as keys) must stay
    distinct there, or verify would call an intact snapshot damaged (and gc would refuse)."""
    root = str(tmp_path / "distinct")
    a, b = torch.zeros(2), torch.ones(2)
    state = {"w": torch.ones(2), "meta": {"by_colour": {Colour.RED: 1, Colour.BLUE: 2},
                                          "colours": {Colour.RED, Colour.BLUE},
                                          "by_tensor": {(a, b): "pair", (b, a): "reversed"}}}
    with CheckpointEngine(root, state, allow_pickle=True) as engine:
        engine.snapshot(0)
    assert load(root, allow_pickle=True)[1]["meta"]["by_colour"] == {Colour.RED: 1, Colour.BLUE: 2}
    code, out, _ = run(capsys, "verify", root)
    assert code == 0, out


def test_export_of_a_damaged_step_fails_and_leaves_no_file(capsys, ckpt, tmp_path):
    flip_byte(shard_path(ckpt, 30), chunk_offset(ckpt, 30, 1))
    target = tmp_path / "out.pt"
    code, _, err = run(capsys, "export", ckpt, "--step", 30, "--to", target)
    assert code == 1 and "fails its checksum" in one_error_line(err)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_export_never_writes_through_a_planted_link(capsys, ckpt, tmp_path):
    """The temporary file is made exclusively under a name nobody can guess, and renamed over
    the target: a link at the old, guessable temporary name or at the target is left alone or
    replaced, the file it points to is never written."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.pt"
    os.symlink(outside, out / f"model.pt.tmp-{os.getpid()}")
    os.symlink(outside, target)
    code, _, _ = run(capsys, "export", ckpt, "--only", "model", "--to", target, "--force")
    assert code == 0 and not target.is_symlink()
    assert outside.read_text() == "precious"
    assert torch.load(target, weights_only=True).keys() == load(ckpt)[1]["model"].keys()
    assert sorted(os.listdir(out)) == ["model.pt", f"model.pt.tmp-{os.getpid()}"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_export_bounds_the_copies_it_makes_before_making_them(capsys, tmp_path):
    """Issue 28: a stride-0 tensor of a few bytes expands to 256 GB when DCP wants it
    contiguous; the copy was attempted (62 s and 4.3 GB for 4 GB, an untyped error past
    memory). Now the memory is checked first: a typed error, nothing written."""
    state = {"w": {"e": torch.ones(1).expand(2**18, 2**18)}}
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--to-dcp", tmp_path / "dcp")
    assert code == 1 and "needs 274.88 GB of host memory" in one_error_line(err)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_safetensors_export_gathers_views_in_pieces_and_needs_no_package(capsys, tmp_path,
                                                                         monkeypatch):
    """Issue 40: an expanded, stride-0 tensor was made whole in memory, then copied again by
    safetensors (4.4 GB for a mask of 2^30 elements; tests/test_memory.py measures the fix).
    async_ckpt now writes the file itself, each view gathered a piece at a time, the largest
    elements first (each tensor aligned for its dtype), once the file fits on the disk: an
    expansion to 18 PB is refused in one line, nothing written."""
    model = {"mask": torch.tensor([True]).expand(3, 2**21), "w": torch.randn(5, 3).t(),
             "half": torch.arange(2, dtype=torch.bfloat16).expand(4, 2), "i": torch.arange(3)}
    state = {"model": model, "huge": {"e": torch.ones(1).expand(2**26, 2**26)}}
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    target = tmp_path / "m.safetensors"
    code, out, _ = run(capsys, "export", tmp_path / "ckpt", "--only", "model", "--to", target)
    assert code == 0 and "4 tensors" in out
    loaded = load_file(str(target))
    assert_same(dict(sorted(loaded.items())), {k: model[k].contiguous() for k in sorted(model)})
    header = json.loads(target.read_bytes()[8:8 + int.from_bytes(target.read_bytes()[:8], "little")])
    assert [header[k]["data_offsets"][0] % model[k].element_size() for k in model] == [0] * 4

    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--only", "huge", "--to",
                       tmp_path / "h.safetensors")
    assert code == 2 and "18014398.51 GB of tensor data" in one_error_line(err)
    assert "export to a .pt file" in one_error_line(err)
    assert not (tmp_path / "h.safetensors").exists()


@pytest.mark.parametrize("to", ["--to", "--to-dcp"])
def test_export_refuses_a_tensor_too_large_to_copy_whole_in_one_line(capsys, tmp_path, to):
    """Issue 40: a stride-0 tensor of shape [2^31, 2^31] is 2^64 bytes whole, past what torch's
    size arithmetic holds: its ``nbytes`` wrapped to 0, the memory check passed, and the copy
    failed with an untyped RuntimeError. Now: a typed one-line error, naming it, nothing
    written; the .pt export it advises keeps the view as it is."""
    state = {"model": {"e": torch.ones(1).expand(2**31, 2**31)}}
    with CheckpointEngine(tmp_path / "ckpt", state, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    target = tmp_path / ("m.safetensors" if to == "--to" else "dcp")
    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--only", "model", to, target)
    line = one_error_line(err)
    assert code == 2 and "[2147483648, 2147483648] of float32" in line
    assert "more than a tensor can hold" in line and "export to a .pt file" in line
    assert (to == "--to") == ("tensor e " in line)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    code, out, _ = run(capsys, "export", tmp_path / "ckpt", "--only", "model", "--to",
                       tmp_path / "m.pt")
    assert code == 0 and torch.load(tmp_path / "m.pt")["e"].stride() == (0, 0)


def test_a_deep_tree_of_long_keys_is_shown_and_exported_in_bounded_memory(capsys, tmp_path):
    """Issue 28: 95 levels of 20 KB keys over 20,000 leaves built a 1.9 MB path for every leaf
    (5.7 GB, then MemoryError). inspect now cuts shown paths; a safetensors export refuses key
    paths it could not use as keys anyway. (5,000 leaves here: uncut paths would still make
    9.5 GB, and lines longer than the bound below.)"""
    bottom = {str(j): j for j in range(5_000)}
    bottom["t"] = torch.ones(2)
    tree = bottom
    for level in range(95):
        tree = {"k" * 20_000 + str(level): tree}
    with CheckpointEngine(tmp_path / "ckpt", {"deep": tree}, heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    code, out, _ = run(capsys, "inspect", tmp_path / "ckpt")
    assert code == 0 and "deep.kkkk" in out and "\u2026" in out
    assert max(map(len, out.splitlines())) < 400 and len(out) < 5_001 * 400
    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--to", tmp_path / "x.safetensors")
    assert code == 2 and "longer than 4096 characters" in one_error_line(err)


def test_names_from_the_checkpoint_reach_the_terminal_escaped(capsys, tmp_path):
    """Issue 28, finding 7: an entry named with an escape sequence was printed as it is (it could
    clear the screen or retitle the terminal). Now control characters print as \\xNN."""
    name = "evil\x1b]0;owned\x07\x1b[2J"
    with CheckpointEngine(tmp_path / "ckpt", {name: {"t": torch.ones(2)}},
                          heartbeat_interval=None) as engine:
        engine.snapshot(1, force=True)
    code, out, _ = run(capsys, "inspect", tmp_path / "ckpt")
    assert code == 0 and "evil\\x1b]0;owned\\x07\\x1b[2J" in out and "\x1b" not in out
    code, _, err = run(capsys, "export", tmp_path / "ckpt", "--only", "\x1b[2Jnope", "--to",
                       tmp_path / "x.pt")
    assert code == 2 and "\x1b" not in err and "\\x1b[2Jnope" in one_error_line(err)


def test_a_command_prints_at_most_one_line_on_stderr(capsys, ckpt):
    """Issue 28, finding 7: a rebuilt manifest's warning came as a log line of its own beside
    the result, odd files added more. Now a command that succeeds says at most one warning line,
    one that fails only its error line."""
    os.unlink(os.path.join(ckpt, "manifest.json"))
    open(os.path.join(ckpt, "step-00000000000000000098.0badf00d"), "w").close()
    code, _, err = run(capsys, "gc", ckpt, "--dry-run")
    assert code == 0 and err.count("\n") <= 1
    code, _, err = run(capsys, "gc", ckpt)
    assert code == 0 and err.startswith("async-ckpt: warning:") and err.count("\n") == 1
    assert "was missing; rebuilt it" in err
    code, _, err = run(capsys, "export", ckpt, "--step", 999, "--to", os.path.join(ckpt, "x.pt"))
    assert code == 2 and err.count("\n") == 1


def test_verify_checks_memory_before_decoding(capsys, ckpt, monkeypatch):
    """Issue 28: verify had no memory check (64 chunks declaring 1 GiB each took 2.3 GB)."""
    import async_ckpt.read.memory as memory

    class Tiny:
        available = 1000

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: Tiny)
    code, _, err = run(capsys, "verify", ckpt)
    assert code == 1 and "of host memory, 0.00 GB is usable now" in one_error_line(err)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- gc ------------------------------------------------------------------------------------------


def test_gc_removes_only_leftovers_by_default(capsys, ckpt):
    names = add_leftovers(ckpt)
    code, out, _ = run(capsys, "gc", ckpt)
    assert code == 0 and "keeping 4 committed snapshots" in out
    assert all(name in out for name in names)
    assert not any(os.path.exists(os.path.join(ckpt, n)) for n in names)
    assert read_manifest(LocalStorage(ckpt)).steps() == STEPS
    assert run(capsys, "verify", ckpt, "--all")[0] == 0
    assert "nothing to remove" in run(capsys, "gc", ckpt)[1]


def test_gc_of_a_directory_that_lost_its_manifest_keeps_every_complete_snapshot(capsys, ckpt):
    os.unlink(os.path.join(ckpt, "manifest.json"))
    names = add_leftovers(ckpt)
    code, out, _ = run(capsys, "gc", ckpt, "--dry-run")
    assert code == 0 and "keeping 4 committed snapshots" in out
    assert not os.path.exists(os.path.join(ckpt, "manifest.json"))  # a dry run writes nothing
    code, out, _ = run(capsys, "gc", ckpt)
    assert code == 0 and read_manifest(LocalStorage(ckpt)).steps() == STEPS
    assert not any(os.path.exists(os.path.join(ckpt, n)) for n in names)
    assert run(capsys, "verify", ckpt, "--all")[0] == 0


def test_gc_dry_run_changes_nothing(capsys, ckpt):
    add_leftovers(ckpt)
    before = sorted(os.listdir(ckpt))
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        manifest_before = f.read()
    code, out, _ = run(capsys, "gc", ckpt, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would remove" in out and "dry run: nothing changed" in out
    assert out.count("beyond --keep-last 1") == 3
    assert sorted(os.listdir(ckpt)) == before
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        assert f.read() == manifest_before


def test_gc_keeps_the_newest_in_commit_order_and_commits_before_deleting(capsys, tmp_path, monkeypatch):
    root = str(tmp_path / "rewound")
    weights = torch.zeros(8)
    with CheckpointEngine(root, {"w": weights}, keep_last=10) as engine:
        for step in (50, 60, 40):  # a rewind: 40 is the newest
            weights.add_(1)
            engine.snapshot(step)
    dropped_dirs = [r.dir for r in read_manifest(LocalStorage(root)).snapshots[:1]]
    removed_after_commit = []

    def remove_after_commit(storage, names):
        committed = {r.dir for r in read_manifest(storage).snapshots}
        assert not committed & set(names)  # the manifest without them is already durable
        removed_after_commit.extend(names)
        return cli_remove_entries(storage, names)

    cli_remove_entries = gc_command.remove_entries
    monkeypatch.setattr(gc_command, "remove_entries", remove_after_commit)
    code, out, _ = run(capsys, "gc", root, "--keep-last", "2")
    assert code == 0 and "keeping 2 committed snapshots (steps 60, 40)" in out
    assert removed_after_commit == dropped_dirs
    assert not os.path.exists(os.path.join(root, dropped_dirs[0]))
    assert load(root)[0] == 40 and float(load(root)[1]["w"][0]) == 3.0
    code, out, _ = run(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and "keeping 1 committed snapshot (step 40)" in out
    assert read_manifest(LocalStorage(root)).steps() == [40] and len(removed_after_commit) == 2


def test_gc_refuses_while_an_engine_holds_the_directory(capsys, ckpt):
    with CheckpointEngine(ckpt, {"t": torch.zeros(2)}, keep_last=10):
        names = add_leftovers(ckpt)  # after the engine's own start-up clean-up
        for argv in (["gc", ckpt], ["gc", ckpt, "--dry-run"]):
            code, out, err = run(capsys, *argv)
            assert code == 1
            assert f"an engine is writing to {ckpt}; stop it first" in one_error_line(err)
        assert all(os.path.exists(os.path.join(ckpt, n)) for n in names)
        assert read_manifest(LocalStorage(ckpt)).steps() == STEPS
    assert run(capsys, "gc", ckpt)[0] == 0
    assert not any(os.path.exists(os.path.join(ckpt, n)) for n in names)


def test_gc_drops_committed_snapshots_only_if_a_kept_one_verifies(capsys, ckpt):
    flip_byte(shard_path(ckpt, 30), chunk_offset(ckpt, 30, 0))  # the right size: only checksums tell
    for argv in (["gc", ckpt, "--keep-last", "1", "--dry-run"], ["gc", ckpt, "--keep-last", "1"]):
        code, _, err = run(capsys, *argv)
        assert code == 1
        assert "refusing to drop committed snapshots" in one_error_line(err)
        assert "step 30: " in err and "fails its checksum" in err
    assert read_manifest(LocalStorage(ckpt)).steps() == STEPS
    code, out, _ = run(capsys, "gc", ckpt, "--keep-last", "2")  # keeps 20, which restores
    assert code == 0 and read_manifest(LocalStorage(ckpt)).steps() == [20, 30]
    assert load(ckpt)[0] == 20


# --- compare-loss --------------------------------------------------------------------------------


def write_log(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def test_compare_loss_identical_with_a_replayed_resume(capsys, tmp_path):
    a = write_log(tmp_path / "a.jsonl", [{"step": s, "loss": 1.0 / (s + 3), "lr": 0.1} for s in range(6)])
    crashed = [{"step": s, "loss": 1.0 / (s + 3), "lr": 0.1} for s in range(5)]
    crashed[3]["loss"] = 99.0  # written before the crash; the resumed run replays steps 3-4
    b = write_log(tmp_path / "b.jsonl", crashed + [{"step": s, "loss": 1.0 / (s + 3), "lr": 0.1}
                                                  for s in range(3, 6)])
    code, out, _ = run(capsys, "compare-loss", a, b)
    assert code == 0, out
    assert "2 replayed lines" in out and "bit-identical" in out and out.rstrip().endswith("IDENTICAL")


def test_compare_loss_compares_lr_when_asked(capsys, tmp_path):
    a = write_log(tmp_path / "a.jsonl", [{"step": s, "loss": 0.5, "lr": 0.1} for s in range(4)])
    b = write_log(tmp_path / "b.jsonl", [{"step": s, "loss": 0.5, "lr": 0.1 if s < 2 else 0.2}
                                         for s in range(4)])
    code, out, _ = run(capsys, "compare-loss", a, b)
    assert code == 0 and "note: lr differs first at step 2" in out
    code, out, _ = run(capsys, "compare-loss", "--lr", a, b)
    assert code == 1 and "lr differs first at step 2: A 0.1, B 0.2" in out
    assert out.rstrip().endswith("DIFFERENT")


def test_compare_loss_reports_first_and_largest_difference(capsys, tmp_path):
    base = [0.5, 0.25, 0.125, 0.0625, 0.03125]
    other = list(base)
    other[2] = 0.125 + 2 ** -40  # differs in the last bits only
    other[4] = 0.5
    a = write_log(tmp_path / "a.jsonl", [{"step": s, "loss": x} for s, x in enumerate(base)])
    b = write_log(tmp_path / "b.jsonl", [{"step": s, "loss": x} for s, x in enumerate(other)]
                  + [{"step": 9, "loss": 1.0}])
    code, out, _ = run(capsys, "compare-loss", a, b)
    assert code == 1
    assert f"first difference: step 2: A loss 0.125, B loss {0.125 + 2 ** -40!r}" in out
    assert f"largest absolute difference: {0.5 - 0.03125!r} at step 4" in out
    assert "only in A: none" in out and "only in B: 9" in out
    assert out.rstrip().endswith("DIFFERENT")


def test_compare_loss_exactness_of_zero_signs_nan_and_missing_steps(capsys, tmp_path):
    def compare(xs, ys):
        a = write_log(tmp_path / "a.jsonl", xs)
        b = write_log(tmp_path / "b.jsonl", ys)
        return run(capsys, "compare-loss", a, b)

    assert compare(['{"step": 0, "loss": NaN}'], ['{"step": 0, "loss": NaN}'])[0] == 0
    assert compare(['{"step": 0, "loss": 1}'], ['{"step": 0, "loss": 1.0}'])[0] == 0
    assert compare(['{"step": 0, "loss": 0.0}'], ['{"step": 0, "loss": -0.0}'])[0] == 1
    code, out, _ = compare(['{"step": 0, "loss": 1.5}'], ['{"step": 0, "loss": NaN}'])
    assert code == 1 and "largest absolute difference: nan at step 0" in out
    code, out, _ = compare([{"step": 0, "loss": 1.0}, {"step": 1, "loss": 1.0}], [{"step": 0, "loss": 1.0}])
    assert code == 1 and "only in A: 1" in out and "bit-identical on every common step" in out


def test_compare_loss_usage_errors_name_the_line(capsys, tmp_path):
    good = write_log(tmp_path / "good.jsonl", [{"step": 0, "loss": 1.0}])
    cases = [
        (['{"step": 0, "loss": 1.0}', "", '{"step": 1, "loss": '], "line 3: not valid JSON"),
        (['{"step": 0}'], 'line 1: "loss" must be a number'),
        (['{"step": "0", "loss": 1.0}'], 'line 1: "step" must be a non-negative integer'),
        (['{"step": true, "loss": 1.0}'], '"step" must be a non-negative integer'),
        (['[1, 2]'], "line 1: not a JSON object"),
        ([], "holds no loss records"),
    ]
    for lines, message in cases:
        bad = write_log(tmp_path / "bad.jsonl", lines)
        code, _, err = run(capsys, "compare-loss", good, bad)
        assert code == 2 and message in one_error_line(err), lines
    code, _, err = run(capsys, "compare-loss", good, tmp_path / "missing.jsonl")
    assert code == 2 and "does not exist" in one_error_line(err)


def test_compare_loss_tells_a_run_that_is_not_reproducible_from_a_resume_that_differs(capsys,
                                                                                       tmp_path):
    losses = [1.0 / (s + 3) for s in range(8)]
    a = write_log(tmp_path / "a.jsonl", [{"step": s, "loss": x} for s, x in enumerate(losses)])
    noisy = [{"step": s, "loss": x * (1 + 1e-7)} for s, x in enumerate(losses)]
    # B resumed from the snapshot of step 3: steps 4-5 logged again, differing after the resume
    wrong = [{"step": s, "loss": x} for s, x in enumerate(losses[:6])] + \
        [{"step": s, "loss": x + (s > 3)} for s, x in enumerate(losses) if s >= 4]
    b = write_log(tmp_path / "b.jsonl", wrong)
    code, out, _ = run(capsys, "compare-loss", a, b)
    assert code == 1 and "B resumed from step 3 (step 4 logged again)" in out
    assert "before the resume (B's steps up to 3, as first logged): bit-identical on every " \
        "common step" in out
    assert "result: RESUME DIFFERS: identical to A up to step 3" in out
    assert "different from step 4 on; a run that is not reproducible" in out

    # the same run, noisy from step 0: its difference precedes the resume
    n = write_log(tmp_path / "n.jsonl", noisy[:6] + [{"resumed_from": 2}] + noisy[3:])
    code, out, _ = run(capsys, "compare-loss", a, n)
    assert code == 3, out
    assert "B resumed from step 2 (its \"resumed_from\" line 7)" in out
    assert "first difference: step 0: A loss 0.3333333333333333, B loss 0.3333333666666667 " \
        "(relative difference 1e-07)" in out
    assert "result: NOT REPRODUCIBLE: B differs from A at step 0, before it resumed from " \
        "step 2" in out

    # a seamless log shows no resume point: only --resumed-from can tell
    seamless = write_log(tmp_path / "seamless.jsonl", noisy)
    code, out, _ = run(capsys, "compare-loss", a, seamless)
    assert code == 1 and "B tells no step it resumed from" in out
    assert out.rstrip().endswith("DIFFERENT")
    code, out, _ = run(capsys, "compare-loss", "--resumed-from", "2", a, seamless)
    assert code == 3 and "B resumed from step 2 (--resumed-from)" in out

    # a third log: do the uninterrupted runs agree with each other at all?
    code, out, _ = run(capsys, "compare-loss", a, b, seamless)
    assert code == 3, out
    assert "A and C (both uninterrupted): differ first at step 0: A loss 0.3333333333333333, " \
        "C loss 0.3333333666666667 (relative difference 1e-07)" in out
    assert "result: NOT REPRODUCIBLE: the two uninterrupted runs differ" in out
    twin = write_log(tmp_path / "twin.jsonl",
                     [{"step": s, "loss": x} for s, x in enumerate(losses)])
    code, out, _ = run(capsys, "compare-loss", a, b, twin)
    assert code == 1 and "A and C (both uninterrupted): bit-identical on every common step" in out
    assert "result: RESUME DIFFERS" in out and "pass a second uninterrupted run" not in out
    code, out, _ = run(capsys, "compare-loss", a, a, seamless)  # B matched A: fine, with a note
    assert code == 0 and "note: A and C differ" in out and out.rstrip().endswith("IDENTICAL")


def test_compare_loss_infers_the_first_resume_only(capsys, tmp_path):
    a = write_log(tmp_path / "a.jsonl", [{"step": s, "loss": float(s)} for s in range(6)])
    # restarted from scratch (nothing was committed), then resumed from step 2: no step precedes
    # the first resume, so it cannot tell
    restarts = [0, 1, 0, 1, 2, 3, 3, 4, 5]
    b = write_log(tmp_path / "b.jsonl", [{"step": s, "loss": float(s) + (i > 6)}
                                         for i, s in enumerate(restarts)])
    code, out, _ = run(capsys, "compare-loss", a, b)
    assert code == 1 and "B resumed from" not in out and "B tells no step it resumed from" in out
    code, _, err = run(capsys, "compare-loss", a,
                       write_log(tmp_path / "c.jsonl", [{"step": 9, "loss": 0.0}]),
                       write_log(tmp_path / "d.jsonl", [{"step": 7, "loss": 0.0}]))
    assert code == 2 and "have no step in common" in one_error_line(err)
    for bad in ('{"resumed_from": -1}', '{"resumed_from": "3"}'):
        code, _, err = run(capsys, "compare-loss", a, write_log(tmp_path / "bad.jsonl", [bad]))
        assert code == 2 and '"resumed_from" must be a non-negative integer' in one_error_line(err)


# --- as installed --------------------------------------------------------------------------------


def test_console_script_and_python_m(ckpt):
    # pip puts console scripts next to the interpreter it installs for (a venv's bin/, which is
    # on PATH only once the venv is activated)
    script = os.path.join(os.path.dirname(sys.executable), "async-ckpt")
    assert os.access(script, os.X_OK), f"pip install did not put the console script at {script}"
    result = subprocess.run([script, "ls", ckpt], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == ""
    assert "4 committed snapshots" in result.stdout

    flip_byte(shard_path(ckpt, 30), chunk_offset(ckpt, 30, 0))
    result = subprocess.run([sys.executable, "-m", "async_ckpt", "verify", ckpt],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "restore() would pick step 20" in result.stdout
    assert result.stderr == ""  # no progress bar off a terminal, no traceback

    result = subprocess.run([sys.executable, "-m", "async_ckpt", "ls", ckpt + "-missing"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("async-ckpt: error: ") and "Traceback" not in result.stderr


def test_a_ranks_own_root_lists_and_verifies_but_points_to_the_store(capsys, tmp_path):
    """The ranks shared no directory: DIR holds their own roots. ls and verify read one of them
    (its shards only, said so); DIR itself, and a restore from a root, point to the bucket."""
    from test_commit import write_shard
    from async_ckpt.write.commit import Attempt, Committer
    from async_ckpt.write.protocol import ShardFigures

    root = tmp_path / "ckpt" / "rank-00001"
    root.mkdir(parents=True)
    (tmp_path / "ckpt" / ".lock-rank00001").touch()
    committer = Committer(LocalStorage(str(root)), 2, keep_last=3, keep_every=None, commit_timeout=60,
                          send=lambda event: None, own_root=1)
    name = "step-00000000000000000007.0000abcd"
    committer.add(Attempt(job=0, step=7, dir=name, replicas=[], raw_bytes=64,
                          figures=ShardFigures(),
                          shard=write_shard(str(root), name, 1, 7, world_size=2,
                                            tensors=[_view_of_rank(0)])))
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "rank 1's own root" in out and "object store" in out
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and "step 7" in out and "rank 1's own root" in out
    code, _, err = run(capsys, "ls", str(tmp_path / "ckpt"))
    assert code == 2 and "rank-00001" in one_error_line(err) and "s3://" in err
    with pytest.raises(CheckpointDirError, match="object store"):
        load(str(root))


def _view_of_rank(rank: int) -> dict:
    """A tensor record viewing storage 0 of ``rank``'s shard (a replica it holds)."""
    return {"dtype": "uint8", "shape": [8], "stride": [1], "storage": 0, "offset": 0, "rank": rank}


def test_another_ranks_shard_that_cannot_be_opened_is_damage_reported_with_the_pick(capsys,
                                                                                  tmp_path):
    """Rank 0's tensors view rank 1's storage, and rank 1's header names a format version no
    reader knows (the header is outside the index checksum): verify reports the step damaged
    and what restore() picks; it once stopped at rank 1's error while checking rank 0's views."""
    from test_commit import write_shard
    from async_ckpt.storage.names import shard_file_name
    from async_ckpt.write.commit import Attempt, Committer
    from async_ckpt.write.protocol import ShardFigures

    root = tmp_path / "ckpt"
    root.mkdir()
    committer = Committer(LocalStorage(str(root)), 2, keep_last=3, keep_every=None,
                          commit_timeout=60, send=lambda event: None)
    for step, tensors in ((1, []), (2, [_view_of_rank(1)])):
        name = f"step-{step:020d}.0000abcd"
        committer.add(Attempt(job=step, step=step, dir=name, replicas=[], raw_bytes=64,
                              figures=ShardFigures(), shard=write_shard(
                                  str(root), name, 0, step, world_size=2, tensors=tensors)))
        write_shard(str(root), name, 1, step, world_size=2)
        committer.poll(trainer_gone=False)
    assert read_manifest(LocalStorage(str(root))).steps() == [1, 2]
    damaged = root / f"step-{2:020d}.0000abcd" / shard_file_name(1)
    data = bytearray(damaged.read_bytes())
    data[8:12] = struct.pack("<I", 99)  # the header: magic, then the format version
    damaged.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", "--all", str(root))
    assert code == EXIT_DAMAGE, out
    assert "step 2" in out and "DAMAGED" in out and "version 99" in out
    assert "restore() would pick step 1" in out


def test_ls_and_help_start_without_importing_torch(ckpt):
    """``ls``, ``compare-loss`` and ``--help`` start fast: nothing they import imports torch (2-3 s
    here); the commands that need it import it when they run."""
    program = ("import sys\nfrom async_ckpt.tools import cli\n"
               "assert cli.main(['ls', sys.argv[1]]) == 0\n"
               "assert 'torch' not in sys.modules, 'ls imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", program, ckpt], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
