"""The README's walk-through needs only loraplex's runtime install and what it tells you to add.

Issue 31: after the README's own install command (``pip install "torch==2.13.0" -e .``, no
extras) the walk-through imported ``openai`` and ``skimage``, which only the ``test`` extra
installs. ``tests/test_readme.py`` runs the blocks, but in the test environment, where the test
extra is installed too, so it cannot see this. Building a venv with only the runtime install
takes minutes and 1.5 GB (torch), too slow for the suite (``tests/test_readme.py`` runs from
such a venv when ``LORAPLEX_README_VENV`` names one); this test checks the same statically, in
well under a second:

every module that a walk-through block imports (``python`` blocks, and ``python -c`` in
``bash`` blocks) is the standard library's, loraplex's, or belongs to a distribution of the
runtime install's closure (loraplex's requirements without extras, and theirs, as the installed
metadata says) or of a ``pip install NAME`` line in an earlier block of the walk-through.
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_readme import README, readme_blocks

PYTHON_C = re.compile(r"""\bpython3?\s+-c\s+(?:"((?:[^"\\]|\\.)*)"|'([^']*)')""")
PIP_INSTALL = re.compile(r"^\s*(?:python3?\s+-m\s+)?pip3?\s+install\s+(.+)$", re.M)
OWN = {"loraplex", "bench", "tests"}  # the project's own top-level import names


def closure(roots: list[tuple[str, str]]) -> set[str]:
    """Canonical names of ``roots`` (``(distribution, extra)``) and all they require, installed.

    Raises:
        AssertionError: a required distribution (its markers true here) is not installed.
    """
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    todo = list(roots)
    while todo:
        name, extra = todo.pop()
        key = (canonicalize_name(name), extra)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise AssertionError(f"{name} is required but not installed") from None
        names.add(canonicalize_name(dist.metadata["Name"]))
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
    return names


def imports_of(block_lang: str, code: str) -> set[str]:
    """Top-level module names a block imports (``python -c`` code too, for ``bash``)."""
    sources = [code] if block_lang == "python" else []
    if block_lang == "bash":
        for double, single in PYTHON_C.findall(code):
            sources.append(double.replace('\\"', '"') if double else single)
    found: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def pip_installed(code: str) -> list[str]:
    """Distribution names of the ``pip install`` lines of a bash block (options left out)."""
    names = []
    for line in PIP_INSTALL.findall(code):
        for word in shlex.split(line.split("#")[0].replace("&&", " && ")):
            if word in ("&&", ";", "|"):
                break
            if not word.startswith(("-", ".")):
                names.append(Requirement(word).name)
    return names


def unprovided_imports(text: str) -> list[str]:
    """``README.md:LINE: module`` for each import the install and earlier blocks do not provide."""
    modules = packages_distributions()
    provided = closure([("loraplex", "")])
    missing = []
    for block in readme_blocks(text):
        if block.lang == "bash":
            provided |= closure([(name, "") for name in pip_installed(block.code)])
        if block.not_run:
            continue
        for module in sorted(imports_of(block.lang, block.code)):
            if module in sys.stdlib_module_names or module in OWN:
                continue
            dists = {canonicalize_name(d) for d in modules.get(module, ())}
            if not dists & provided:
                missing.append(f"README.md:{block.line}: {module} ({', '.join(dists) or '?'})")
    return missing


def test_the_walk_through_imports_only_what_the_install_and_the_readme_provide():
    assert unprovided_imports(README.read_text()) == []


def test_the_check_sees_a_test_extra_import_and_a_missing_pip_line():
    """The pre-issue-31 README's kind of block is caught: skimage, and openai without its line."""
    text = README.read_text()
    start = text.index("## A session with the server")
    block = "```python\nimport openai\nfrom skimage import data\nimport PIL.Image\n```\n"
    bad = text[:start] + "## A session with the server\n\n" + block
    missing = unprovided_imports(bad)
    assert [m.split(": ")[1].split()[0] for m in missing] == ["openai", "skimage"], missing
    with_pip = text[:start] + "## A session with the server\n\n```bash\npip install openai\n```\n"
    assert [m.split(": ")[1].split()[0] for m in unprovided_imports(with_pip + block)] == [
        "skimage"
    ]


def test_the_readme_says_pip_install_openai_before_its_first_sdk_block():
    blocks = readme_blocks(README.read_text())
    first_sdk = next(i for i, b in enumerate(blocks) if "import openai" in b.code)
    assert any("openai" in pip_installed(b.code) for b in blocks[:first_sdk] if b.lang == "bash")
    assert "openai" not in closure([("loraplex", "")])  # not a runtime dependency
