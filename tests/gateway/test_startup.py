"""``loraplex serve``'s start-up: the address first, progress lines in order, no triton or peft.

Behaviour only (the machines are noisy; bench/startup figures live in docs/startup.md): a port
in use is refused before anything is loaded, the progress lines come in the order the work is
done, and a CPU server never imports triton or peft (nor prints triton's leak report at exit).
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.gateway.live import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT = 120  # a hang guard, not a timing assertion


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "TRITON_"))}


def _loraplex():
    exe = shutil.which("loraplex")
    return [exe] if exe else [sys.executable, "-m", "loraplex.gateway.cli"]


def test_serve_reaches_its_bind_without_the_heavy_modules():
    # What runs before ``serve`` binds its address: the CLI module and serve's own parser.
    code = (
        "import sys, loraplex.gateway.cli as cli\n"
        "cli.build_parser(['serve']).parse_args(['serve'])\n"
        "heavy = ('torch', 'transformers', 'peft', 'triton', 'alembic', 'sqlalchemy', 'numpy',"
        " 'PIL', 'litestar', 'uvicorn')\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_a_command_loads_only_its_own_module():
    code = (
        "import sys, loraplex.gateway.cli as cli\n"
        "parser = cli.build_parser(['serve'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('loraplex.gateway.commands.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
    )
    loaded = out.stdout.strip()
    assert "commands.serve" in loaded and "commands.db" not in loaded, loaded
    assert "commands.tenants" not in loaded and "commands.generate" not in loaded, loaded


def test_a_port_in_use_fails_before_anything_is_loaded(tmp_path, llava_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / "data"
        out = subprocess.run(
            [*_loraplex(), "serve", "--model", str(llava_dir), "--data-dir", str(data)]
            + ["--port", str(port)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=START_TIMEOUT,
        )
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"loraplex serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert not data.exists()  # nothing was set up: the data directory is made after the bind


# Runs ``loraplex serve`` (the console script's own ``main``) in a child; once /health answers
# it sends itself SIGINT, and after the graceful exit prints which heavy modules were imported.
_CHILD = """
import json, os, signal, sys, threading, time, urllib.request
from loraplex.gateway.cli import main

port = int(sys.argv[1])

def poke():
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=poke, daemon=True).start()
code = main(sys.argv[2:])
loaded = {m: sys.modules.get(m) is not None for m in ("triton", "peft", "torch._dynamo")}
print(json.dumps({"code": code, "loaded": loaded}), flush=True)
sys.exit(code)
"""


def test_serve_reports_progress_in_order_and_imports_no_triton_or_peft(tmp_path, llava_dir):
    port = free_port()
    data = tmp_path / "data"
    argv = ["serve", "--model", str(llava_dir), "--data-dir", str(data), "--port", str(port)]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(port), *argv, "--log-level", "warning"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=START_TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    assert result["loaded"]["triton"] is False, "a CPU serve imported triton"
    assert result["loaded"]["peft"] is False, "serve imported peft before any adapter was read"
    assert "nanobind" not in out.stderr, out.stderr

    progress = [line for line in out.stderr.splitlines() if line.startswith("loraplex: ")]
    expected = [
        f"listening address http://127.0.0.1:{port} is ours",
        f"loading model {llava_dir} ",
        "model llava loaded: ",
        "KV pool of ",
        "database migrated to revision ",
        f"admin key written to {data / 'admin.key'}",
        f"ready on http://127.0.0.1:{port}: llava, ",
    ]
    assert len(progress) == len(expected), out.stderr
    for line, start in zip(progress, expected, strict=True):
        assert line.startswith(f"loraplex: {start}"), (line, start)
    assert "parameters, float32 on cpu, in " in progress[2]
    blocks = int(progress[3].split("KV pool of ")[1].split()[0])
    assert blocks > 0 and " GiB (" in progress[3]
