"""The distribution installs one import namespace, ``loraplex``, and nothing else at top level."""

import ast
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("gateway", "engine", "adapters", "hashing", "kernels", "migrations")


def test_every_package_of_the_folders_is_in_the_distribution():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        "loraplex." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert listed == found
    assert config["package-dir"] == {f"loraplex.{f}": f for f in FOLDERS}


def test_outside_the_repository_only_loraplex_imports():
    code = (
        "import importlib.util, loraplex.engine, loraplex.gateway.cli;"
        "print([n for n in ('engine', 'gateway', 'adapters', 'hashing', 'kernels', 'migrations')"
        " if importlib.util.find_spec(n) is not None])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == "[]"


def test_transformers_sees_no_kernels_package_of_ours():
    # As the ``loraplex`` console script runs, even from the repository root: the script's own
    # directory, not the current one, is first on sys.path (``-P``).
    code = (
        "from transformers.utils.import_utils import _is_package_available;"
        "print(_is_package_available('kernels', return_version=True))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    found, _ = ast.literal_eval(out.stdout.strip())
    if found:  # Hugging Face's own kernels hub is installed: it must be theirs, not ours
        assert importlib.metadata.distribution("kernels").metadata["Name"] != "loraplex"
    top = importlib.metadata.distribution("loraplex").read_text("top_level.txt") or ""
    assert top.split() in ([], ["loraplex"])


def _requirement_names(requirements):
    return {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_triton_is_in_the_gpu_and_test_extras_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "triton" not in _requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "triton" in _requirement_names(extras["gpu"])
    assert "triton" in _requirement_names(extras["test"])  # kernel tests: Triton's interpreter
    assert "peft" in _requirement_names(project["dependencies"])  # adapters are read at runtime


def test_the_triton_backend_without_triton_says_which_extra_installs_it():
    # As on a runtime-only install: ``import triton`` fails.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from loraplex.engine.attention import get_attention_backend\n"
        "try:\n"
        "    get_attention_backend('triton')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs triton" in out.stdout and "[gpu]" in out.stdout, out.stdout + out.stderr
