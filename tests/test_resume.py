"""Exact resume, proven the article's way: run examples/train.py uninterrupted, then kill it with
SIGKILL at chosen points and restart it until it finishes. Every step's loss, and the final model,
EMA, optimizer, scheduler, scaler and sampler state, must be bit-identical to the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from async_ckpt import load
from async_ckpt.tools.cli import main as cli_main
from conftest import assert_same

pytestmark = pytest.mark.slow
TRAIN = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train.py")
STEPS = 40
BATCHES_PER_EPOCH = 12  # examples/train.py: 96 samples, batches of 8


def train(ckpt_dir, log, every, kill_after_step=None, staging="eager"):
    """Run train.py; with ``kill_after_step``, SIGKILL it (and its writer and data workers) as soon
    as its log shows that step. Returns the exit code."""
    return run_killed([TRAIN, "--ckpt-dir", ckpt_dir, "--log", log, "--steps", str(STEPS),
                       "--every", str(every), "--seed", "3", "--staging", staging],
                      kill_after_step, log)


def run_killed(argv, kill_after_step=None, log=None):
    """Run a training program (``argv`` after the interpreter) in its own session; with
    ``kill_after_step``, SIGKILL its whole session (writer and data workers too) as soon as its
    JSON-lines ``log`` shows that step. Returns the exit code."""
    start = os.path.getsize(log) if log and os.path.exists(log) else 0
    process = subprocess.Popen([sys.executable, *argv], start_new_session=True)
    if kill_after_step is None:
        return process.wait(timeout=300)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if any(r["step"] >= kill_after_step for r in read_log(log, start)):
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    return process.wait()


def read_log(path, offset=0):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f.read().splitlines(keepends=True) if line.endswith("\n")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    ckpt, log = str(root / "ckpt"), str(root / "loss.jsonl")
    assert train(ckpt, log, every=1) == 0
    return ckpt, log


@pytest.mark.parametrize("every,staging", [(1, "eager"), (5, "lazy")])
def test_killed_runs_resume_bit_identical(tmp_path, uninterrupted, every, staging):
    ref_ckpt, ref_log = uninterrupted
    reference = {r["step"]: r for r in read_log(ref_log)}
    assert sorted(reference) == list(range(STEPS))

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    kill_points = [2,                              # early
                   BATCHES_PER_EPOCH + 5,          # mid-epoch
                   2 * BATCHES_PER_EPOCH - 1,      # the last batch of an epoch
                   2 * BATCHES_PER_EPOCH + 7]      # right after logging: a snapshot is in flight
    for point in kill_points:
        assert train(ckpt, log, every, point, staging) == -signal.SIGKILL
    assert train(ckpt, log, every, staging=staging) == 0

    records = read_log(log)
    assert {r["step"] for r in records} == set(range(STEPS))
    for r in records:  # replayed steps included: each reproduces the same loss and lr
        assert r == reference[r["step"]], f"step {r['step']} differs after a resume"
    assert len(records) > STEPS, "no step was replayed: the kills came too late to test anything"

    ref_step, ref_state = load(ref_ckpt)
    step, state = load(ckpt)
    assert step == ref_step == STEPS - 1
    assert_same(ref_state, state)
    assert cli_main(["compare-loss", ref_log, log]) == 0
