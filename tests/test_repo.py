"""Repository-level checks: the CLI entry point, the import rules, and lint."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DESIGN.md: who may import whom.
FORBIDDEN = {
    "hashing": {"engine", "gateway", "adapters", "kernels", "torch"},
    "kernels": {"engine", "gateway", "adapters", "hashing"},
    "engine": {"gateway"},
    "adapters": {"engine", "gateway"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_rules(package):
    bad = {}
    for path in (ROOT / package).rglob("*.py"):
        hits = imported_top_levels(path) & FORBIDDEN[package]
        if hits:
            bad[str(path.relative_to(ROOT))] = sorted(hits)
    assert not bad, f"imports across DESIGN.md's rules: {bad}"


def test_kv_cache_needs_no_torch():
    code = (
        "import sys, engine.kv_cache, hashing.request_hasher;"
        "assert 'torch' not in sys.modules, 'kv cache imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help_and_version():
    exe = shutil.which("loraplex")
    cmd = [exe] if exe else [sys.executable, "-m", "gateway.cli"]
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, check=True)
    assert "loraplex" in out.stdout
    out = subprocess.run(cmd + ["--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("loraplex ")


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the test extra)")
    out = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
