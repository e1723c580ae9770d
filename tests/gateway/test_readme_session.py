"""The README's Python session runs as written against a live gateway."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_openai_session(live):
    (block,) = [b for b in python_blocks() if "openai.OpenAI(" in b]
    assert '"http://127.0.0.1:8000/v1"' in block and '"lpx-..."' in block
    tenant = live.create_tenant("readme")
    code = block.replace('"http://127.0.0.1:8000/v1"', repr(f"{live.base_url}/v1")).replace(
        '"lpx-..."', repr(tenant["api_key"])
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    completion = int(re.search(r"completion_tokens=(\d+)", printed).group(1))
    prompt = int(re.search(r"prompt_tokens=(\d+)", printed).group(1))
    assert 1 <= completion <= 16 and prompt > 0
    with live.client(tenant["api_key"]) as c:
        totals = c.get("/v1/usage").json()["totals"]
    assert totals["requests"] == 1 and totals["images"] == 1
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (prompt, completion)
