"""Exact resume in a user's own loop, written from the README (tests/programs/readme_loop.py):
dropout in the model, augmentation drawn from the worker's global RNG with ``num_workers=2``, a
cosine schedule, snapshots every few steps and a final one at close. Killed with SIGKILL at chosen
points and run again, every step's loss and the final state are bit-identical to an uninterrupted
run, and a finished job run again trains nothing. The interrupted runs stage lazily, the
reference eagerly: the two stagings commit the same snapshots."""

import os

import pytest

from async_ckpt import load
from conftest import assert_same
from test_resume import read_log, run_killed

pytestmark = pytest.mark.slow
LOOP = os.path.join(os.path.dirname(__file__), "programs", "readme_loop.py")
STEPS, EVERY = 18, 5  # 6 batches per epoch: 3 epochs; the last step (17) is not a multiple of 5


def loop(ckpt, log, staging="lazy"):
    return [LOOP, "--ckpt-dir", ckpt, "--log", log, "--steps", str(STEPS), "--every", str(EVERY),
            "--staging", staging]


def test_a_readme_loop_killed_anywhere_resumes_bit_identical(tmp_path):
    ref_ckpt, ref_log = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    assert run_killed(loop(ref_ckpt, ref_log, staging="eager")) == 0
    reference = {r["step"]: r for r in read_log(ref_log)}
    assert sorted(reference) == list(range(STEPS))

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    for point in (3, 13):  # before the snapshot at 5; after the one at 10, across an epoch's end
        assert run_killed(loop(ckpt, log), kill_after_step=point, log=log) < 0
    assert run_killed(loop(ckpt, log)) == 0
    records = read_log(log)
    assert len(records) > STEPS, "no step was replayed: the kills came too late to test anything"
    for r in records:
        assert r == reference[r["step"]], f"step {r['step']} differs after a resume"

    step, state = load(ckpt)
    assert step == load(ref_ckpt)[0] == STEPS - 1  # close(final_step=...) committed the last step
    assert_same(load(ref_ckpt)[1], state)
    assert run_killed(loop(ckpt, log)) == 0  # finished: nothing retrained
    assert len(read_log(log)) == len(records)
