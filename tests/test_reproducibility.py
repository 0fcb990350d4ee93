"""``async-ckpt compare-loss`` on real runs tells a resume that differs from training that is not
reproducible from process to process (tests/programs/resume_check.py): two runs made genuinely
non-reproducible (a noise term drawn without a seed) are reported NOT REPRODUCIBLE (exit 3), a
resume that forgets the optimizer RESUME DIFFERS (exit 1)."""

import os
import re
import subprocess
import sys

import pytest

from async_ckpt.tools.cli import main as cli_main

pytestmark = pytest.mark.slow
PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "resume_check.py")


def train(root, **runs):
    """Each run ``name=flags`` into ``root/name``, side by side; a run with ``--stop-after`` stops
    there and is then resumed to the end. Returns each run's log."""
    logs = {name: str(root / f"{name}.jsonl") for name in runs}

    def start(name, flags):
        return subprocess.Popen([sys.executable, PROGRAM, "--ckpt-dir", str(root / name),
                                 "--log", logs[name], *flags])

    def finish(processes):
        assert [p.wait(timeout=300) for p in processes] == [0] * len(processes)

    finish([start(name, flags) for name, flags in runs.items()])
    finish([start(name, [f for f in flags if not f.startswith("--stop-after")])
            for name, flags in runs.items() if any(f.startswith("--stop-after") for f in flags)])
    return logs


def compare(capsys, *argv):
    capsys.readouterr()
    code = cli_main(["compare-loss", *argv])
    return code, capsys.readouterr().out


def test_a_resume_that_forgets_the_optimizer_differs_after_the_resume(tmp_path, capsys):
    logs = train(tmp_path, a=[], b=["--stop-after=5", "--forget-optimizer"])
    code, out = compare(capsys, logs["a"], logs["b"])
    assert code == 1, out
    assert "B resumed from step 4 (step 5 logged again)" in out
    # B's first process trained as A's did (deterministic(): one thread): only the resume differs
    assert "before the resume (B's steps up to 4, as first logged): bit-identical on every " \
        "common step" in out
    assert "result: RESUME DIFFERS: identical to A up to step 4, where B resumed, different " \
        "from step 6 on" in out  # step 5: the restored model, before the fresh Adam steps


def test_runs_made_non_reproducible_are_told_apart_from_a_resume(tmp_path, capsys):
    logs = train(tmp_path, a=["--noise"], c=["--noise"],
                 b=["--noise", "--stop-after=5", "--mark-resume"])
    a, b, c = logs["a"], logs["b"], logs["c"]
    code, out = compare(capsys, a, b)
    assert code == 3, out
    assert "B resumed from step 4 (its \"resumed_from\" line 7)" in out
    # the noise moves a loss by ~1e-6, ~15 float32 ulps of its spread: two runs round one step's
    # loss to the same float about once in 50, four steps in a row about never; so the first
    # difference is among steps 0-3, not necessarily at step 0
    assert re.search(r"first difference: step [0-3]: A loss .*\(relative difference ", out), out
    assert re.search(r"result: NOT REPRODUCIBLE: B differs from A at step [0-3], before it resumed "
                     r"from step 4", out), out
    code, out = compare(capsys, a, b, c)
    assert code == 3 and re.search(r"A and C \(both uninterrupted\): differ first at step [0-3]",
                                   out), out
    assert "result: NOT REPRODUCIBLE: the two uninterrupted runs differ" in out


# The training programs whose losses or state the tests compare across processes (and, for
# ddp_checks.py and sharded.py, before and after a restore in one process).
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PROGRAMS = os.path.join("tests", "programs")
COMPARED = sorted([os.path.join(PROGRAMS, n) for n in os.listdir(os.path.join(ROOT, PROGRAMS))
                   if n.endswith(".py")]
                  + [os.path.join("examples", n) for n in ("train.py", "train_ddp.py",
                                                           "train_fsdp.py")])


@pytest.mark.parametrize("path", COMPARED)
def test_every_training_program_whose_losses_are_compared_pins_its_threads(path):
    """A BLAS that splits a product by the machine's load makes 1 process in 12 train otherwise
    (docs/data.md, "Reproducible runs"): a test comparing such losses would flake under load."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    if '"loss"' not in source and "losses" not in source:
        return  # logs no loss
    pinned = ("torch.set_num_threads(1)" in source or "deterministic()" in source
              or "torch.set_num_threads(THREADS)" in source and "\nTHREADS = 1 " in source)
    assert pinned, f"{path} logs losses that tests compare, without pinning one thread"
