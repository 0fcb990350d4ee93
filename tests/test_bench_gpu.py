"""The GPU benchmark (``python -m bench --device``) and its one-call check script keep running:
run on the CPU as the device, every system is reported and every restore is bit-exact; its
options never write over the committed report. Apart from tests/test_bench.py so that the two
long runs land on different test workers."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.__main__ import parse_args  # noqa: E402



def test_the_gpu_benchmark_runs_on_the_cpu_and_every_restore_is_exact(tmp_path):
    """``bench/gpu_check.sh OUT --device cpu --quick``: the GPU check's script and benchmark
    (``python -m bench --device``) with the CPU as the device, what proves they will run on the
    day a GPU is lent: the CUDA tests skip, every system is reported, every restore is bit-exact,
    async_ckpt's RNG states are restored, the report and the logs are written."""
    from bench import gpu
    from bench.systems import GPU_SYSTEMS

    out = tmp_path / "out"
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out), "--device", "cpu", "--quick"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert {"check.log", "bench.log", "test_cuda.xml"} <= set(os.listdir(out))
    assert 'skipped="' in (out / "test_cuda.xml").read_text()
    results = json.loads((out / "results.json").read_text())
    config = gpu.PRESETS["cpu", True]
    assert results["kind"] == "gpu" and results["raw"]["rounds_run"] == config.rounds
    assert len(results["raw"]["floors"]) == len(results["raw"]["settle"]) == config.rounds
    names = [s.name for s in GPU_SYSTEMS]
    assert list(results["raw"]["systems"]) == names
    assert all(results["raw"]["systems"][n]["available"] for n in names), results["raw"]["systems"]
    checks = results["exactness"]
    assert len(checks) == len(names) * config.rounds
    assert all(c["bit_exact"] and c["differing"] == 0 for c in checks)
    assert [c["rng_exact"] for c in checks if "rng_exact" in c] == [True] * 2 * config.rounds
    for name in names:
        figure = results["figures"][name]
        assert set(figure["ks"]) == {"1", str(config.every)}
        for k in figure["ks"].values():
            assert k["blocking_s"]["x_floor"]["median"] > 0 and k["overhead"]["median"] > 0
        assert figure["restore_s"]["x_floor"]["n"] == config.rounds
        assert ("x_best_dcp" in figure["to_durable_s"]) == (name not in gpu.DCP_NAMES)
    report = (out / "report.md").read_text()
    assert report in proc.stdout
    for heading in ("## Floors", "## Blocking, time to durable, restore",
                    "## Training-step overhead", "## Exactness"):
        assert heading in report
    assert f"{len(checks)} of {len(checks)} restores bit-exact" in report
    assert "DIFFERS" not in report and "no GPU (--device cpu)" in report


def test_the_gpu_benchmark_options_never_write_over_the_committed_report():
    from bench import gpu

    assert parse_args(["--device", "cuda"]).out == gpu.COMMITTED_RESULTS
    for argv in (["--device", "cpu"], ["--device", "cuda", "--quick"],
                 ["--device", "cuda", "--params-gb", "4"], ["--device", "cuda", "--rounds", "5"]):
        out = parse_args(argv).out
        assert os.path.abspath(out) != os.path.abspath(gpu.COMMITTED_RESULTS)
        os.rmdir(out)
    for argv in (["--device", "cuda", "--ks", "1"], ["--device", "cpu", "--stall"],
                 ["--params-gb", "1"], ["--device", "cpu", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    args = parse_args(["--device", "cuda", "--params-gb", "4", "--budget", "100", "--out", "x"])
    assert gpu.config_for(args).params_gb == 4 and gpu.config_for(args).budget_s == 100
