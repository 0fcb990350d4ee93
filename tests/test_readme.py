"""Every Python block of the README runs as written, and runs again to resume.

Each block is written to a file of its own and run in a fresh directory, twice: the second run
finds the first one's checkpoint and resumes from it (with nothing left to train). Blocks that
start a process group run under torchrun; the "Sharded models" block the second time on another
number of ranks. A new block fails ``test_every_block_is_run`` until a test here runs it.
"""

import os
import subprocess
import sys

import pytest

from async_ckpt import load
from test_distributed import kill_everything

pytestmark = pytest.mark.slow
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")


def python_blocks() -> dict[str, str]:
    """The README's ```python blocks by the heading of the section that holds them."""
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, heading, inside = {}, "", None
    for line in lines:
        if inside is not None:
            if line == "```":
                assert heading not in blocks, f"two python blocks under {heading!r}"
                blocks[heading], inside = "\n".join(inside) + "\n", None
            else:
                inside.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line == "```python":
            inside = []
    return blocks


RUN_HERE = {"Use": ("runs/exp1/ckpt", 3 * 8 - 1),  # 3 epochs of 256 / 32 batches
            "Incremental snapshots": ("ckpt-lora", 19)}
UNDER_TORCHRUN = {"Several ranks (torchrun)": ("ckpt-ddp", 2 * 512 // 2 // 16 - 1, 2, 2),
                  "Sharded models (FSDP2, tensor parallel)": ("ckpt-fsdp", 99, 2, 3)}


WITH_A_STORE = {"Remote storage": ("ckpt-node", 19)}


def test_every_block_is_run():
    assert set(python_blocks()) == set(RUN_HERE) | set(UNDER_TORCHRUN) | set(WITH_A_STORE)


def _run(command, cwd, log, env=None):
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=cwd, start_new_session=True, stdout=out,
                                   stderr=subprocess.STDOUT, env=env)
        try:
            code = process.wait(timeout=240)
        except BaseException:
            kill_everything(process)
            raise
    with open(log, errors="replace") as f:
        text = f.read()
    assert code == 0, f"{' '.join(command[-2:])} exited with {code}:\n{text[-3000:]}"
    return text


@pytest.mark.parametrize("heading", sorted(RUN_HERE))
def test_a_block_runs_and_a_second_run_resumes(tmp_path, heading):
    ckpt, last_step = RUN_HERE[heading]
    script = tmp_path / "block.py"
    script.write_text(python_blocks()[heading])
    for run in (1, 2):
        _run([sys.executable, str(script)], str(tmp_path), str(tmp_path / f"run-{run}.txt"))
        assert load(str(tmp_path / ckpt))[0] == last_step, run


def test_the_remote_block_runs_against_a_store_and_a_fresh_node_resumes_from_it(tmp_path):
    """Run against a moto server through the AWS environment alone; the second run has a fresh
    local directory, so it resumes from the bucket."""
    from s3server import S3Server

    ckpt, last_step = WITH_A_STORE["Remote storage"]
    server = S3Server(bucket="my-bucket")
    server.start()
    try:
        env = {**os.environ, **server.env}
        for run in (1, 2):
            here = tmp_path / f"node-{run}"
            here.mkdir()
            (here / "block.py").write_text(python_blocks()["Remote storage"])
            _run([sys.executable, "block.py"], str(here), str(here / "log.txt"), env)
            options = {"endpoint_url": server.endpoint, "access_key_id": "testing",
                       "secret_access_key": "testing", "region": "us-east-1"}
            assert load("s3://my-bucket/runs/exp1", remote_options=options)[0] == last_step
        assert load(str(tmp_path / "node-1" / ckpt))[0] == last_step
        # the fresh node found everything trained: it committed nothing, it only downloaded
        assert not (tmp_path / "node-2" / ckpt / "manifest.json").exists()
    finally:
        server.kill()


@pytest.mark.parametrize("heading", sorted(UNDER_TORCHRUN))
def test_a_block_runs_under_torchrun_and_resumes(tmp_path, heading):
    """The sharded block resumes on 3 ranks what 2 saved."""
    ckpt, last_step, first, second = UNDER_TORCHRUN[heading]
    script = tmp_path / "block.py"
    script.write_text(python_blocks()[heading])
    for nproc in (first, second):
        text = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={nproc}", str(script)], str(tmp_path),
                    str(tmp_path / f"run-{nproc}-{nproc == second}.txt"))
        assert load(str(tmp_path / ckpt))[0] == last_step
    if first != second:
        assert f"restoring step {last_step}, written by {first} rank(s), on {second}" in text


def test_the_options_table_lists_every_option():
    """README "Use": one row per EngineOptions field, no row for an option that does not exist."""
    import dataclasses
    import re

    from async_ckpt.options import EngineOptions

    with open(README, encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| option | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    listed = {name for row in table for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == {f.name for f in dataclasses.fields(EngineOptions)}


def test_the_performance_section_quotes_the_committed_report_as_it_is():
    """README's "Performance" is bench/results/report.md's headline, opening and sections pasted
    as they are (``###`` headings as ``####``), its own paragraphs aside (those that say how to
    run the benchmark): a figure that differs is a published fact gone stale."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    start = readme.index("\n## Performance\n")
    section = readme[start:readme.index("\n## ", start + 1)]
    with open(os.path.join(os.path.dirname(README), "bench", "results", "report.md"),
              encoding="utf-8") as f:
        report = f.read()
    quoted = [block.strip() for block in section.split("\n\n")[1:]
              if block.strip() and "python -m bench" not in block]
    assert len(quoted) > 20  # the headline, the opening, the tables
    for block in quoted:
        text = "###" + block[4:] if block.startswith("####") else block
        assert text in report, block[:200]
