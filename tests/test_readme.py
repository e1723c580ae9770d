"""The README runs as pasted (issue 14): its server walk-through and offline section, as written.

Every fenced ```bash and ```python block from "## A session with the server" to the end of
README.md runs, in order, in ONE bash process (``set -eo pipefail``), so variables a shell block
exports (``KEY``, ``IMG``, ...) reach the blocks after it; a python block is written to a file
and run there as ``python FILE``, with that environment. The working directory is a fresh
temporary directory in which ``loraplex serve`` (the README's own command, plus a free
``--port``) runs, so ``.loraplex/admin.key`` and ``.loraplex/models/tiny-llava`` are where the
README says.

What the test changes in the blocks, and nothing else:

- the port: ``localhost:8000`` / ``127.0.0.1:8000`` become the free port (8000 may be taken by
  another process on a shared machine);
- ``curl`` is a bash function adding ``--fail-with-body``, so a block whose request gets an
  HTTP error fails (the README's plain ``curl -s`` would print the error body and go on).

``loraplex`` and ``python`` are the test's own interpreter's, where the test extra is installed
too; with ``LORAPLEX_README_VENV=DIR`` they are that venv's instead: make it as a user would,
with only the README's install command (``python -m venv DIR && DIR/bin/pip install
"torch==2.13.0" -e .``), and the blocks' own ``pip install`` lines add the rest, as they would
for the user (a few minutes and 1.5 GB, hence not by default;
``tests/test_readme_imports.py`` checks the same statically on every run).

A block preceded by ``<!-- not-run: REASON -->`` is skipped (``loraplex serve`` itself, which
blocks). The test counts the blocks it ran and skipped, so an edit cannot silently skip them,
and checks what they did through the server's own API afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
START = "## A session with the server"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->\s*\Z")
RUN_BLOCKS = 14  # bash and python blocks the README's walk-through has to run
SKIPPED_BLOCKS = 1  # `loraplex serve`
SERVE_START_S = 180
SCRIPT_TIMEOUT_S = 900
MARK = "@@README-BLOCK"
VENV = "LORAPLEX_README_VENV"


@dataclass(frozen=True)
class Block:
    """One fenced block of the README."""

    lang: str
    code: str
    line: int
    not_run: str | None


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks after ``START``, with the reason of a ``not-run`` comment before one."""
    start = text.index(START)
    blocks, prev_end = [], start
    for m in FENCE.finditer(text, start):
        before = text[prev_end : m.start()]
        reason = NOT_RUN.search(before)
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(m.group(1), m.group(2), line, reason.group(1) if reason else None))
        prev_end = m.end()
    return blocks


def with_port(code: str, port: int) -> str:
    """``code`` talking to ``port`` instead of the README's 8000."""
    return code.replace("localhost:8000", f"localhost:{port}").replace(
        "127.0.0.1:8000", f"127.0.0.1:{port}"
    )


def build_script(blocks: list[Block], port: int, workdir: Path) -> str:
    """One bash script running every block not marked ``not-run``, in order."""
    lines = [
        "set -eo pipefail",
        'curl() { command curl --fail-with-body "$@"; }  # an HTTP error fails the block',
    ]
    for i, block in enumerate(blocks):
        if block.not_run:
            continue
        lines.append(f'echo "{MARK} {i} README.md:{block.line}"; echo "{MARK} {i}" >&2')
        code = with_port(block.code, port)
        if block.lang == "bash":
            lines.append(code)
        else:
            path = workdir.parent / f"readme_block_{i}_line_{block.line}.py"
            path.write_text(code)
            lines.append(f"python {path}")
        # what the test reads afterwards: the keys the session held
        lines.append(f'printf "%s\\n" "${{KEY:-}}" >> {workdir.parent / "keys_seen"}')
    return "\n".join(lines) + "\n"


def split_output(out: str) -> dict[int, str]:
    """Stdout per block index."""
    parts: dict[int, str] = {}
    for chunk in out.split(MARK + " ")[1:]:
        head, _, body = chunk.partition("\n")
        parts[int(head.split()[0])] = body
    return parts


class Server:
    """``loraplex serve --port P`` run in ``workdir`` with the environment the README assumes."""

    def __init__(self, workdir: Path, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            ["loraplex", "serve", "--port", str(self.port)],
            cwd=workdir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        self._log.flush()
        return self._log_path.read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"serve did not answer /health in {SERVE_START_S} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def test_readme_blocks_are_found_and_marked():
    blocks = readme_blocks(README.read_text())
    assert {b.lang for b in blocks} == {"bash", "python"}, [(b.lang, b.line) for b in blocks]
    skipped = [b for b in blocks if b.not_run]
    assert len(skipped) == SKIPPED_BLOCKS and skipped[0].code.startswith("loraplex serve")
    assert len(blocks) - len(skipped) == RUN_BLOCKS
    for b in blocks:  # the port substitution reaches every address the README gives
        assert "8000" not in with_port(b.code, 1), f"README.md:{b.line}"
    for b in blocks:  # no placeholder, truncated data or pasted secret left to fill in
        assert "lpx-..." not in b.code and "base64,iVBOR" not in b.code, f"README.md:{b.line}"


def test_readme_runs_as_pasted(tmp_path):
    workdir = tmp_path / "session"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.pop("KEY", None)
    venv = os.environ.get(VENV)  # a venv with only what the README installs (module doc)
    bin_dir = Path(venv) / "bin" if venv else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    assert shutil.which("loraplex", path=env["PATH"]), "the loraplex command is not installed"
    blocks = readme_blocks(README.read_text())
    server = Server(workdir, env, tmp_path / "serve.log")
    try:
        server.wait_healthy()
        script = build_script(blocks, server.port, workdir)
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
        )
        outputs = split_output(done.stdout)
        last = max(outputs, default=None)
        assert done.returncode == 0, (
            f"README block {last} (README.md:{blocks[last].line if last is not None else '?'}) "
            f"failed with {done.returncode}\n--- stdout (tail)\n{done.stdout[-4000:]}\n"
            f"--- stderr (tail)\n{done.stderr[-6000:]}\n"
            f"--- serve log (tail)\n{server.log()[-3000:]}"
        )
        assert len(outputs) == RUN_BLOCKS == sum(1 for b in blocks if not b.not_run)
        seen = [k for k in (tmp_path / "keys_seen").read_text().splitlines() if k]
        check_what_the_session_did(workdir, server.url, blocks, outputs, list(dict.fromkeys(seen)))
    finally:
        server.stop()


def block_output(blocks: list[Block], outputs: dict[int, str], needle: str) -> str:
    """The output of the one block whose code contains ``needle``."""
    (index,) = [i for i, b in enumerate(blocks) if needle in b.code and not b.not_run]
    return outputs[index]


def json_values(text: str) -> list:
    """The JSON values printed one after another (curl adds no newline after a body)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def check_what_the_session_did(workdir, url, blocks, outputs, keys_held) -> None:
    """Whatever the README's blocks claim to do happened, seen through the server's API."""
    admin = {"Authorization": f"Bearer {(workdir / '.loraplex' / 'admin.key').read_text().strip()}"}
    old_key, key = keys_held  # the tenant's first key, then the one the rotation made
    assert key.startswith("lpx-") and old_key.startswith("lpx-")
    with httpx.Client(base_url=url, timeout=30) as c:
        tenants = c.get("/admin/tenants", headers=admin).json()["data"]
        assert [t["name"] for t in tenants] == ["acme", "globex"]
        keys = c.get(f"/admin/tenants/{tenants[0]['id']}", headers=admin).json()["keys"]
        assert [k["revoked"] for k in keys] == [True, False]  # rotated: old revoked, new live
        assert key.startswith(keys[1]["prefix"])
        # the revoked key is refused within a few seconds (the server caches keys for 2 s)
        deadline = time.monotonic() + 10
        while c.get("/v1/models", headers={"Authorization": f"Bearer {old_key}"}).is_success:
            assert time.monotonic() < deadline, "the revoked key still works after 10 s"
            time.sleep(0.5)
        # ... and the one the session ends with works; its usage has every chat of the session
        usage = c.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    by_model = {row["model"]: row for row in usage["by_model"]}
    tools = block_output(blocks, outputs, 'tool_choice="required"').split()
    assert tools[:2] == ["tool_calls", "get_weather"]  # the forced call, its arguments valid
    tok, version = json_values(block_output(blocks, outputs, "localhost:8000/tokenize"))
    assert tok["count"] == len(tok["tokens"]) > 0 and version["version"]
    # two chats with an image, the tool call, the completion and the /tokenize call
    assert by_model["tiny-llava"]["requests"] == 5 and by_model["tiny-llava"]["images"] == 2
    assert by_model["my-lora"]["requests"] == 1

    # the curl chat and the SDK stream answered; the SDK printed its usage chunk
    (chat,) = json_values(block_output(blocks, outputs, '"What is in this picture?"'))
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] >= 1
    printed = block_output(blocks, outputs, "effect_mandelbrot((128, 96)")
    assert int(re.search(r"completion_tokens=(\d+)", printed).group(1)) >= 1
    # /metrics, read with the admin key (the API port serves it to no other key)
    metrics = block_output(blocks, outputs, "localhost:8000/metrics")
    assert "loraplex_kv_blocks_total " in metrics and "loraplex_tenant_requests_total{" in metrics
    # /docs: the schema was fetched without a key and lists the routes
    paths = block_output(blocks, outputs, "localhost:8000/openapi.json").split()
    assert {"/v1/chat/completions", "/v1/adapters", "/v1/models"} <= set(paths)
    # the served model said what adapters may target; the PEFT recipe made an adapter of the
    # language model only from its regex, and the upload took it
    (lora,) = json_values(block_output(blocks, outputs, '["lora"]'))
    assert lora["decoder_layers"] == "model.language_model.layers" and lora["max_rank"] == 64
    assert lora["target_modules"][:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = json.loads((workdir / "my-adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    regex = lora["target_modules_regex"].replace("|gate_proj|up_proj|down_proj", "")
    assert config["target_modules"] == regex
    upload, models, lora_chat, deleted = json_values(
        block_output(blocks, outputs, "-F name=my-lora")
    )
    assert upload["name"] == "my-lora" and upload["rank"] == 8
    assert upload["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # the projections
    assert {m["id"] for m in models["data"]} == {"tiny-llava", "my-lora"}
    assert lora_chat["model"] == "my-lora" and lora_chat["usage"]["completion_tokens"] >= 1
    assert deleted == {"name": "my-lora", "digest": upload["digest"], "deleted": True}
    # the key listing showed ids and prefixes, never a key; the new key listed the models
    listing, revoked, models_again = json_values(
        block_output(blocks, outputs, "loraplex keys create")
    )
    assert listing == {
        "id": keys[0]["id"],
        "prefix": keys[0]["prefix"],
        "created_at": keys[0]["created_at"],
        "revoked_at": None,
    }
    assert revoked == {"id": keys[0]["id"], "revoked": True}
    assert {m["id"] for m in models_again["data"]} == {"tiny-llava"}
    # offline: generate wrote one result per request line, in order
    results = [
        json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines() if line
    ]
    assert [r["index"] for r in results] == [0, 1]
    assert len(results[0]["outputs"]) == 1 and len(results[1]["outputs"]) == 2
    assert "error" not in results[0] and results[0]["prompt_token_ids"]


def test_readme_revocation_delay_is_the_servers():
    """The README's claim about revocation delay matches the server's key cache setting."""
    from loraplex.gateway.server.config import GatewayConfig

    config = GatewayConfig(data_dir=Path("."), db_url="", served_model_name="")
    text = README.read_text()
    assert f"keeps a verified key for {config.auth_cache_seconds:g} s" in text
