"""``async_ckpt.deterministic()`` sets what a process can set to train bit-reproducibly and says
what it set and what it could not (docs/data.md, "Reproducible runs")."""

import pytest
import torch

import async_ckpt
from async_ckpt.errors import InvalidArgumentError


@pytest.fixture
def torch_settings(monkeypatch, restored_environment):
    """The process-wide settings deterministic() changes, put back after the test (the
    environment by ``restored_environment``: monkeypatch puts back only what it changed)."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield monkeypatch
    torch.set_num_threads(saved[0])
    torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[3:]


def test_it_sets_what_it_can_and_says_so(torch_settings, caplog):
    import os

    before = torch.get_num_threads()
    torch.backends.cudnn.benchmark = True
    with caplog.at_level("INFO", logger="async_ckpt"):
        done = async_ckpt.deterministic()
    assert torch.get_num_threads() == 1 and done["torch.set_num_threads"] == f"1 (was {before})"
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert os.environ["OMP_NUM_THREADS"] == "1"
    if torch.cuda.is_initialized():
        assert done["CUBLAS_WORKSPACE_CONFIG"].startswith("not set: CUDA is already initialised")
    else:
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "deterministic(): torch.set_num_threads 1" in caplog.text


def test_what_the_environment_already_says_is_kept_and_named(torch_settings):
    torch_settings.setenv("OMP_NUM_THREADS", "4")
    torch_settings.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    done = async_ckpt.deterministic(threads=2, warn_only=True)
    assert torch.get_num_threads() == 2 and torch.is_deterministic_algorithms_warn_only_enabled()
    assert done["OMP_NUM_THREADS"].startswith("not set: already '4'")
    assert done["CUBLAS_WORKSPACE_CONFIG"].startswith("not set: already ':0:0'")
    torch_settings.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert async_ckpt.deterministic()["CUBLAS_WORKSPACE_CONFIG"] == ":16:8 (already set)"


@pytest.mark.parametrize("threads", [0, -1, 1.0, True, "1"])
def test_a_thread_count_that_is_not_a_whole_number_is_refused(threads):
    with pytest.raises(InvalidArgumentError, match="threads"):
        async_ckpt.deterministic(threads=threads)


_CUDA_RUN = """
import os, torch, async_ckpt

assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
done = async_ckpt.deterministic()
assert done["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8 (read when cuBLAS starts)", done
g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(512, 512, device="cuda", generator=g)
b = torch.randn(512, 512, device="cuda", generator=g)
first, again = a @ b, a @ b  # raises without a deterministic cuBLAS workspace
assert torch.equal(first, again)
print(first.sum().item())
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_sets_the_cublas_workspace_before_cuda_starts():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    runs = [subprocess.run([sys.executable, "-c", _CUDA_RUN], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert runs[0].stdout == runs[1].stdout  # the same product in two processes
