"""Repository-level checks: the CLI entry point, the import rules, and lint."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# docs/architecture.md: who may import whom (loraplex.<package>; "torch" is a top-level name).
FORBIDDEN = {
    "hashing": {"engine", "gateway", "adapters", "kernels", "torch"},
    "kernels": {"engine", "gateway", "adapters", "hashing"},
    "engine": {"gateway"},
    "adapters": {"engine", "gateway"},
}
PACKAGES = ("gateway", "engine", "adapters", "hashing", "kernels", "migrations")


def imported_names(path: Path) -> set[str]:
    """Modules a file imports (absolute imports only), as written."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imported_packages(path: Path) -> set[str]:
    """loraplex packages (``loraplex.engine`` -> ``engine``) and other top-level names."""
    out = set()
    for name in imported_names(path):
        parts = name.split(".")
        out.add(parts[1] if parts[0] == "loraplex" and len(parts) > 1 else parts[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_rules(package):
    bad = {}
    for path in (ROOT / package).rglob("*.py"):
        hits = imported_packages(path) & FORBIDDEN[package]
        if hits:
            bad[str(path.relative_to(ROOT))] = sorted(hits)
    assert not bad, f"imports across docs/architecture.md's rules: {bad}"


def test_no_module_imports_a_package_by_its_bare_name():
    # The folders install as loraplex.<folder>; ``import engine`` works only from the repository
    # root (the current directory on sys.path), and would load a second copy of the module.
    bad = {}
    for folder in (*PACKAGES, "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            bare = {n for n in imported_names(path) if n.split(".")[0] in PACKAGES}
            if bare:
                bad[str(path.relative_to(ROOT))] = sorted(bare)
    assert not bad, f"bare imports (use loraplex.<package>): {bad}"


def test_kv_cache_needs_no_torch():
    code = (
        "import sys, loraplex.engine.kv_cache, loraplex.hashing.request_hasher;"
        "assert 'torch' not in sys.modules, 'kv cache imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help_and_version():
    exe = shutil.which("loraplex")
    cmd = [exe] if exe else [sys.executable, "-m", "loraplex.gateway.cli"]
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
