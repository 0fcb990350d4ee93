"""What the package promises about itself: where it runs, its one version, its optional parts."""

import os
import subprocess
import sys

from setuptools.config.pyprojecttoml import read_configuration

import async_ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_another_platform_is_refused_at_import_with_a_typed_error():
    code = ("import sys; sys.platform = 'darwin'\n"
            "try:\n"
            "    import async_ckpt\n"
            "except ImportError as e:\n"
            "    print(*(c.__name__ for c in type(e).__mro__[:2]), e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert out.startswith("UnsupportedPlatformError CheckpointError async_ckpt needs Linux")
    assert "this is darwin" in out


def test_the_version_is_kept_once():
    project = read_configuration(os.path.join(ROOT, "pyproject.toml"))["project"]
    assert "version" in project["dynamic"] and project["version"] == async_ckpt.__version__


def test_what_one_command_uses_is_an_extra_not_a_dependency():
    project = read_configuration(os.path.join(ROOT, "pyproject.toml"))["project"]
    required = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "tqdm" not in required and "safetensors" not in required
    assert any(d.startswith("tqdm") for d in extras["cli"])
    assert any(d.startswith("safetensors") for d in extras["safetensors"])
