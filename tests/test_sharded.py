"""Sharded training state (DTensor) under torchrun with gloo on CPU.

Proves: FSDP2, tensor-parallel and 2-D (FSDP x TP) model + AdamW state saved at 4 ranks restores
at 1, 2 and 3 ranks and into another layout with the full state bit-identical to what was saved,
and trains on exactly as a DCP-resharded load of the same state does (tests/programs/sharded.py);
restoring 4 -> 2 ranks holds at most 1.3x the rank's own state above its baseline; a damaged piece
on one rank makes every rank fall back together; a rank SIGKILLed while writing never commits that
step, and the job restarted by torchrun resumes bit-identical (examples/train_fsdp.py). Each
scenario is one torchrun launch. (The README's block: tests/test_readme.py.)
"""

import json
import os
import shutil

import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import load
from async_ckpt.errors import CorruptSnapshotError
from async_ckpt.format.manifest import read_manifest
from async_ckpt.tools.cli import main as cli
from async_ckpt.tools.common import EXIT_DAMAGE
from fuzzing import parse_shard, rewrite_shard
from test_distributed import kill_everything, kill_rank_1_mid_write, read_log, torchrun

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "programs", "sharded.py")
TRAIN = os.path.join(HERE, os.pardir, "examples", "train_fsdp.py")
LAYOUTS = ("fsdp", "tp", "2d")
# saved layout -> the layouts it is restored into on every world size
PAIRS = ("fsdp:fsdp", "tp:tp", "2d:2d", "fsdp:2d", "2d:fsdp", "2d:tp")


def run_program(root, nproc, *args, output):
    out, log = os.path.join(root, f"{output}.json"), os.path.join(root, f"{output}.txt")
    wait_torchrun(torchrun(PROGRAM, nproc, "--root", root, "--out", out, *args, output=log), log)
    with open(out) as f:
        return json.load(f)


def wait_torchrun(process, log, timeout=240):
    """Wait for a torchrun ``process`` (killing all of it on a timeout); fail with the end of its
    ``log`` when it exits with an error."""
    try:
        code = process.wait(timeout=timeout)
    except BaseException:
        kill_everything(process)
        raise
    if code:
        with open(log, errors="replace") as f:
            pytest.fail(f"torchrun exited with {code}:\n" + "".join(f.readlines()[-40:]))


def rewrite_index(ckpt, directory, rank, edit):
    """Rewrite ``rank``'s shard of ``directory`` with ``edit(index)`` applied, its trailer and
    the manifest's record of it fixed up (so the edit reaches the parsers)."""
    path = os.path.join(ckpt, directory, f"rank-{rank:05d}.ackpt")
    with open(path, "rb") as f:
        data = f.read()
    index, offset = parse_shard(data)
    edit(index)
    data, digest = rewrite_shard(data[:offset], json.dumps(index, separators=(",", ":")).encode())
    with open(path, "wb") as f:
        f.write(data)
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    for record in manifest["snapshots"]:
        if record["dir"] == directory:
            record["stored_bytes"] += len(data) - record["shards"][rank]["bytes"]
            record["shards"][rank].update(bytes=len(data), index_xxh3=digest)
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def damage_first_chunk(ckpt, directory, rank):
    path = os.path.join(ckpt, directory, f"rank-{rank:05d}.ackpt")
    with open(path, "rb") as f:
        index, _ = parse_shard(f.read())
    offset = index["storages"][0]["chunks"][0]["offset"]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The three layouts and a larger FSDP2 state, each saved at 4 ranks."""
    root = str(tmp_path_factory.mktemp("sharded"))
    run_program(root, 4, "--phase", "save", "--layouts", *LAYOUTS, "big", output="save")
    return root


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_saved_at_4_ranks_restores_bit_exact_on_any_world_size_and_layout(saved, nproc):
    extra = ()
    if nproc == 2:
        damaged = os.path.join(saved, "damaged")
        shutil.copytree(os.path.join(saved, "fsdp", "ckpt"), damaged)
        damage_first_chunk(damaged, read_manifest(LocalStorage(damaged)).snapshots[-1].dir, rank=3)
        extra = ("--memory", "big", "--damaged", damaged)
    found = run_program(saved, nproc, "--phase", "restore", "--pairs", *PAIRS, *extra,
                        output=f"restore-{nproc}")
    for rank, results in enumerate(found):
        for pair in PAIRS:
            r = results[pair]
            assert r["restored"] == 3, (rank, pair)
            assert r["exact"], f"{pair} at {nproc} ranks: the full state differs from the saved one"
            assert r["dcp_exact"], (rank, pair)  # the reference run itself is what was saved
            assert r["same_losses_as_dcp"], (rank, pair, r["losses"])
        if nproc == 2:
            growth, own = results["memory"]["peak_growth"], results["memory"]["own_bytes"]
            assert own > 20e6 and growth <= 1.3 * own, results["memory"]
            # step 3's piece on saved rank 3 is damaged: every rank falls back to step 2 alike
            assert results["damaged"] == {"restored": 2}, results["damaged"]


def test_load_assembles_whole_tensors_from_every_rank(saved):
    for layout in LAYOUTS:
        step, state = load(os.path.join(saved, layout, "ckpt"))
        reference = torch.load(os.path.join(saved, layout, "full.pt"), weights_only=True)
        assert step == 3
        for key, value in reference["model"].items():
            assert torch.equal(state["app"]["model"][key], value), (layout, key)
        for key, moments in reference["optim"].items():
            for name, value in moments.items():
                assert torch.equal(state["app"]["optim"]["state"][key][name], value)


def test_dcp_checkpoints_move_both_ways_and_restore_on_another_world_size(saved, tmp_path):
    """``export --to-dcp`` of each 4-rank snapshot loads with DCP at 3 ranks into FSDP, TP and 2-D
    layouts bit-exact; ``import-dcp`` of each 4-rank DCP checkpoint restores with async_ckpt at 3
    ranks bit-exact; both then train on exactly alike."""
    pairs = ("fsdp-interop:fsdp", "tp-interop:2d", "2d-interop:tp")
    for layout in LAYOUTS:
        here = tmp_path / f"{layout}-interop"
        here.mkdir()
        # verify and inspect walk the DTensor leaves as restore does (format/tree.table_entry)
        assert cli(["verify", os.path.join(saved, layout, "ckpt")]) == 0
        assert cli(["inspect", os.path.join(saved, layout, "ckpt")]) == 0
        assert cli(["export", os.path.join(saved, layout, "ckpt"), "--to-dcp",
                    str(here / "dcp")]) == 0
        assert cli(["import-dcp", os.path.join(saved, layout, "dcp"), str(here / "ckpt"),
                    "--step", "3"]) == 0
        shutil.copy(os.path.join(saved, layout, "full.pt"), here / "full.pt")
    found = run_program(str(tmp_path), 3, "--phase", "restore", "--pairs", *pairs, output="interop")
    for rank, results in enumerate(found):
        for pair in pairs:
            r = results[pair]
            assert r["restored"] == 3, (rank, pair)
            assert r["exact"], f"{pair}: the imported DCP checkpoint restored another state"
            assert r["dcp_exact"], f"{pair}: DCP loaded another state from the exported one"
            assert r["same_losses_as_dcp"], (rank, pair, r["losses"])


def test_a_replicated_piece_is_stored_once(saved):
    """TP's row-wise layer keeps its bias replicated: only the rank at tensor-parallel coordinate
    0 stores it, the others record that they hold it."""
    from async_ckpt.format.shard import ShardReader

    record = read_manifest(LocalStorage(os.path.join(saved, "tp", "ckpt"))).snapshots[-1]
    stored = []
    for shard in record.shards:
        with ShardReader(os.path.join(saved, "tp", "ckpt", record.dir, shard.file)) as reader:
            bias = next(d for d in reader.index["dtensors"] if d["key"] == 'app.model["2.bias"]')
            stored.append(bias["tensor"] is not None)
    assert stored == [True, False, False, False]


def _set(index, key, **fields):
    next(d for d in index["dtensors"] if d["key"] == key).update(fields)


WEIGHT = 'app.model["0.weight"]'
HOSTILE_PIECES = {  # (edit, error, rank whose shard of the fsdp snapshot to edit): all damage
    "a piece left out": (lambda i: _set(i, WEIGHT, tensor=None), "cover", 1),
    "pieces that overlap": (lambda i: _set(i, WEIGHT, offset=[0, 0]), "overlap", 1),
    "another global shape": (lambda i: _set(i, WEIGHT, global_shape=[13, 13]), "another rank", 1),
    "another dtype": (lambda i: _set(i, WEIGHT, dtype="float64"), "another rank", 1),
    "a piece outside its tensor": (lambda i: _set(i, WEIGHT, offset=[12, 0]), "does not fit", 1),
    "an unknown dtype": (lambda i: _set(i, WEIGHT, dtype="float99"), "unknown dtype", 0),
    "a key missing": (lambda i: i["dtensors"].pop(), "not in every rank's shard", 1),
    "a malformed record": (lambda i: i["dtensors"][0].update(extra=1), "invalid index", 1),
    "a repeated key": (lambda i: i["dtensors"][1].update(key=WEIGHT), "invalid index", 1),
    "a tensor reference to a piece": (
        lambda i: i["tree"]["entries"]["app"]["state"]["model"].update(
            {"0.weight": {"$tensor": i["dtensors"][0]["tensor"]}}), "bad \\$tensor", 0),
    "a sharded tensor outside its table": (
        lambda i: i["tree"]["entries"]["app"]["state"]["model"].update(
            {"0.weight": {"$dtensor": len(i["dtensors"])}}), "not in its table", 0),
}


@pytest.mark.parametrize("edit", HOSTILE_PIECES, ids=list(HOSTILE_PIECES))
def test_a_crafted_piece_table_is_damage(saved, tmp_path, edit):
    """The pieces of every tensor must agree across the ranks' shards, lie inside the tensor and
    cover it exactly, without overlap; anything else is CorruptSnapshotError, so restore falls
    back, and nothing is returned with a hole or a stranger's bytes."""
    change, message, rank = HOSTILE_PIECES[edit]
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(saved, "fsdp", "ckpt"), ckpt)
    record = read_manifest(LocalStorage(ckpt)).snapshots[-1]
    rewrite_index(ckpt, record.dir, rank, change)
    with pytest.raises(CorruptSnapshotError, match=message):
        load(ckpt, record.step)
    assert load(ckpt)[0] == 2  # without a step: falls back to the snapshot before
    assert cli(["verify", ckpt, "--step", str(record.step)]) == EXIT_DAMAGE


def test_a_rank_killed_while_writing_never_commits_and_the_restart_resumes_bit_exact(tmp_path):
    steps, width = 30, 1024
    reference, run_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
    # FSDP over both ranks: a 1-D mesh uses the default group, the one a torchrun restart can
    # reconnect with gloo (docs/distributed.md, "torchrun restarts")
    common = ("--steps", str(steps), "--width", str(width))
    wait_torchrun(torchrun(TRAIN, 2, "--ckpt-dir", os.path.join(reference, "ckpt"), "--log-dir",
                   os.path.join(reference, "logs"), *common,
                   output=os.path.join(str(tmp_path), "reference.txt")),
          os.path.join(str(tmp_path), "reference.txt"))
    ckpt = os.path.join(run_dir, "ckpt")
    process = torchrun(TRAIN, 2, "--ckpt-dir", ckpt, "--log-dir", os.path.join(run_dir, "logs"),
                       *common, max_restarts=1, output=os.path.join(str(tmp_path), "killed.txt"))
    try:
        committed, killed_dir = kill_rank_1_mid_write(process, ckpt, run_dir, 240)
        wait_torchrun(process, os.path.join(str(tmp_path), "killed.txt"), timeout=1)
    finally:
        if process.poll() is None:
            kill_everything(process)
    assert killed_dir is not None, "never caught rank 1 writing"
    assert killed_dir not in committed | {s.dir for s in read_manifest(LocalStorage(ckpt)).snapshots}
    for rank in range(2):
        expected = {r["step"]: r["loss"] for r in read_log(reference, rank)}
        records = read_log(run_dir, rank)
        assert {r["step"] for r in records} == set(range(steps))
        assert all(r["loss"] == expected[r["step"]] for r in records), f"rank {rank}"
    assert len(read_log(run_dir, 0)) > steps  # the restart replayed the steps after the last commit


def test_a_box_is_read_in_one_run_only_where_both_layouts_order_its_bytes_alike():
    from async_ckpt.read.reshard import _one_run

    assert _one_run([3, 4], [4, 1], [4, 1], 4)  # a row split of row-major pieces
    assert _one_run([1, 4], [8, 1], [4, 1], 4)  # one row of a wider piece
    assert not _one_run([3, 4], [8, 1], [4, 1], 4)  # rows of a wider piece: gaps between them
    assert not _one_run([3, 4], [1, 3], [4, 1], 4)  # a transposed piece: dense, other order


def test_a_torch_without_the_public_dtensor_module_gets_a_typed_error(monkeypatch):
    """The package allows torch 2.4, whose DTensor lives in torch.distributed._tensor."""
    import sys

    from async_ckpt.errors import LayoutError
    from async_ckpt.tensors import dtensor_box

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor._utils", None)  # import fails
    with pytest.raises(LayoutError, match="need torch 2.5 or later"):
        dtensor_box(object())
