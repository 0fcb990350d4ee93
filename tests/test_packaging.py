"""What the package promises about itself: where it runs, its one version, its optional parts
(extras, the C extension)."""

import os
import re
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


def test_the_pythons_promised_agree_and_are_what_ci_runs():
    """pyproject's floor and classifiers and the README's requirement name the same Pythons, and
    the suite runs on one of them (CI runs it on its one Python, the only one promised)."""
    project = read_configuration(os.path.join(ROOT, "pyproject.toml"))["project"]
    versions = [c.rpartition(" :: ")[2] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert project["requires-python"] == f">={versions[0]}"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert f"Python {' and '.join(versions)} (the one version CI runs the tests on" in readme
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running in versions, f"the suite runs on Python {running}, which is not promised"


def test_what_one_command_uses_is_an_extra_not_a_dependency():
    project = read_configuration(os.path.join(ROOT, "pyproject.toml"))["project"]
    required = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "tqdm" not in required and "safetensors" not in required
    assert any(d.startswith("tqdm") for d in extras["cli"])
    assert any(d.startswith("safetensors") for d in extras["safetensors"])


def test_a_machine_that_cannot_build_the_extension_still_builds_the_package(tmp_path):
    """The C extension is optional (setup.py): a compiler that fails (here CC=false) is a warning,
    the package builds without it and uses the numpy fallback (tests/test_filters.py)."""
    build = tmp_path / "build"
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib",
                             str(build / "lib"), "--build-temp", str(build / "temp")],
                            cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "CC": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'building extension "async_ckpt._native" failed' in result.stdout + result.stderr
    assert not list(build.rglob("_native*"))

