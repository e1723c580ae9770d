"""docker-compose.yml and the Dockerfile against the CLI and the README (no Docker engine here).

What can be checked without running containers: the compose file parses; the loraplex service's
entrypoint + command parse with ``loraplex serve``'s own parser and, with the service's
environment applied, resolve (through the CLI's real code paths) to the data directory and a
database URL that agree with the postgres service; volumes sit where the flags point; health
checks, GPU reservation, restart policy and ports are there; the image installs with README.md's
test install command minus the CPU torch pin, plus the gpu extra; the data directory (secrets)
never enters the build context.
"""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from loraplex.gateway.cli import build_parser
from loraplex.gateway.commands.serve import gateway_config_from_args

ROOT = Path(__file__).resolve().parents[1]
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value, env=None):
    """Compose's ``${NAME}`` / ``${NAME:-default}`` substitution, with ``env`` (else defaults)."""
    env = env or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose():
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def dockerfile():
    """Instructions as (KEYWORD, argument text), line continuations joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def instruction(dockerfile, keyword):
    found = [rest for kw, rest in dockerfile if kw == keyword]
    assert found, f"the Dockerfile has no {keyword}"
    return found


def exec_form(text):
    return yaml.safe_load(text)  # a JSON array is valid YAML


def serve_args(compose, dockerfile):
    service = compose["services"]["loraplex"]
    entry = exec_form(instruction(dockerfile, "ENTRYPOINT")[-1])
    command = service.get("command") or exec_form(instruction(dockerfile, "CMD")[-1])
    if isinstance(command, str):
        command = shlex.split(command)
    argv = [str(a) for a in entry + command]
    assert argv[0] == "loraplex", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:  # argparse printed which flag is unknown or malformed
        pytest.fail(f"`{' '.join(argv)}` is not a valid loraplex command line")


def service_env(service):
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service):
    """``container path -> (source, read_only)`` of a service's volumes."""
    out = {}
    for volume in service.get("volumes", []):
        parts = volume.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def test_services_and_build(compose):
    assert set(compose["services"]) == {"postgres", "loraplex"}
    build = compose["services"]["loraplex"]["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
    assert compose["services"]["postgres"]["image"].split(":")[0] == "postgres"


def test_command_and_environment_resolve_through_the_cli(compose, dockerfile, monkeypatch):
    service = compose["services"]["loraplex"]
    args = serve_args(compose, dockerfile)
    assert args.command == "serve"
    assert args.host == "0.0.0.0" and args.device == "cuda"
    env = service_env(service)
    # Every LORAPLEX_* variable set must be one the CLI reads (serve's --help names each).
    assert {k for k in env if k.startswith("LORAPLEX_")} <= {
        "LORAPLEX_DB_URL",
        "LORAPLEX_DATA_DIR",
        "LORAPLEX_ADMIN_KEY",
    }
    for name in ("LORAPLEX_DB_URL", "LORAPLEX_DATA_DIR", "LORAPLEX_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = gateway_config_from_args(args, "base")

    volumes = mounts(service)
    assert str(config.data_dir) in volumes, "the data directory must be a volume"
    assert not volumes[str(config.data_dir)][1], "the data directory must be writable"
    model_mount = next((m for m in volumes if Path(args.model).is_relative_to(m)), None)
    assert model_mount is not None, f"--model {args.model} is not on a volume"

    url = make_url(config.db_url)
    pg = compose["services"]["postgres"]
    pg_env = service_env(pg)
    assert url.drivername == "postgresql+asyncpg"
    assert url.host == "postgres" and url.port in (None, 5432)
    assert url.username == pg_env["POSTGRES_USER"]
    assert url.password == pg_env["POSTGRES_PASSWORD"]
    assert url.database == pg_env["POSTGRES_DB"]
    depends = service["depends_on"]
    assert depends["postgres"]["condition"] == "service_healthy"


def test_password_is_shared_when_set():
    """One variable sets the password on both sides (the server and the URL)."""
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = {"POSTGRES_PASSWORD": "s3cret"}
    compose = interpolate(raw, env)
    pg = service_env(compose["services"]["postgres"])
    url = make_url(service_env(compose["services"]["loraplex"])["LORAPLEX_DB_URL"])
    assert pg["POSTGRES_PASSWORD"] == url.password == "s3cret"


def test_healthchecks(compose, dockerfile):
    pg = compose["services"]["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in " ".join(pg)
    assert "/var/lib/postgresql/data" in mounts(compose["services"]["postgres"])

    args = serve_args(compose, dockerfile)
    probe = compose["services"]["loraplex"]["healthcheck"]["test"]
    assert probe[0] == "CMD" and probe[1] == "python" and probe[2] == "-c"
    compile(probe[3], "<healthcheck>", "exec")  # valid Python (no curl in the image)
    assert f"http://127.0.0.1:{args.port}/health" in probe[3]
    docker_probe = instruction(dockerfile, "HEALTHCHECK")[-1]
    assert f"http://127.0.0.1:{args.port}/health" in docker_probe


def test_gpu_restart_and_port(compose, dockerfile):
    service = compose["services"]["loraplex"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    for name in ("postgres", "loraplex"):
        assert compose["services"][name]["restart"] in ("always", "unless-stopped", "on-failure")
    args = serve_args(compose, dockerfile)
    published = [str(p).rsplit(":", 1)[-1] for p in service["ports"]]
    assert published == [str(args.port)]
    assert instruction(dockerfile, "EXPOSE") == [str(args.port)]


def readme_install_commands():
    """The README's ``pip install ... && COMMAND`` lines: {COMMAND: the install, as tokens}."""
    found = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("pip install ") and "&&" in line:
            install, _, then = line.partition("&&")
            found[then.strip()] = shlex.split(install)
    assert found, "README.md has no `pip install ... && ...` command"
    return found


def test_readme_run_command_installs_runtime_dependencies_only():
    commands = readme_install_commands()
    assert commands["loraplex serve"] == ["pip", "install", "torch==2.13.0", "-e", "."]
    assert commands["python -m pytest -q"] == ["pip", "install", "torch==2.13.0", "-e", ".[test]"]


def test_image_installs_the_gpu_and_test_extras(dockerfile):
    readme = readme_install_commands()["python -m pytest -q"]
    pins = [t for t in readme if t.startswith("torch==")]
    assert len(pins) == 1, readme  # the CPU pin the README says to drop on a GPU host
    # The README's test install minus the pin, plus the gpu extra (triton: the GPU kernels).
    expected = [".[gpu,test]" if t == ".[test]" else t for t in readme if t not in pins]
    runs = [shlex.split(r) for r in instruction(dockerfile, "RUN")]
    installs = [r for r in runs if r[:2] == ["pip", "install"]]
    assert installs == [expected]
    base = instruction(dockerfile, "ARG")[0].partition("=")[2]
    assert instruction(dockerfile, "FROM") == ["${BASE_IMAGE}"]
    assert base.startswith("pytorch/pytorch:") and "cuda" in base and "runtime" in base


def test_secrets_stay_out_of_the_build_context():
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".loraplex", ".git"} <= ignored


def test_ray_cluster_compose_file_agrees_with_the_cli(monkeypatch):
    """docs/deploy/ray-cluster.compose.yml: the gateway's serve line parses with the real
    parser and asks for Ray replicas; every node mounts the model and the shared data volume
    at the same paths; workers reserve GPUs and join the head."""
    path = ROOT / "docs" / "deploy" / "ray-cluster.compose.yml"
    compose = interpolate(yaml.safe_load(path.read_text()))
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "ray-head", "ray-worker", "gateway"}
    script = services["gateway"]["command"][-1]
    join, _, serve = script.partition("&&")
    assert "ray start --address=ray-head:6379" in join
    argv = shlex.split(serve.strip().removeprefix("exec "))
    assert argv[0] == "loraplex"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.replicas, args.ray_address) == ("serve", 2, "auto")
    assert args.device == "cuda" and args.model == "/models/base"
    for name in ("ray-head", "ray-worker", "gateway"):
        volumes = mounts(services[name])
        assert volumes["/models/base"][1] and volumes["/data"] == ("loraplex-data", False)
    assert "--address=ray-head:6379" in services["ray-worker"]["command"]
    gpus = services["ray-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpus["capabilities"] == ["gpu"]
    env = service_env(services["gateway"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = gateway_config_from_args(args, "base")
    url = make_url(config.db_url)
    assert url.host == "postgres" and url.drivername == "postgresql+asyncpg"
    assert config.rate_limit_url == "redis://redis:6379/0"  # every gateway shares the limits
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
