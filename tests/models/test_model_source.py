"""``--model`` as a directory, a Hub id or a path that is neither (engine.models.source, .hub).

The Hub is huggingface_hub's real client against a pre-populated HF cache (offline) or
:class:`tests.models.fake_hub.FakeHub` on loopback; huggingface_hub reads its environment
(``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE``) once, at import, so these in-process tests set
the ``huggingface_hub.constants`` those variables become (as huggingface_hub's own tests do);
tests/gateway/test_model_source_cli.py sets the variables themselves, for the CLI.
"""

import socket

import pytest
from huggingface_hub import constants

from loraplex.engine.config import EngineConfig
from loraplex.engine.models.hub import ALLOW_PATTERNS
from loraplex.engine.models.source import (
    ModelSourceError,
    is_hub_id,
    resolve_model,
    resolve_model_source,
)
from tests.models.fake_hub import FakeHub, cache_snapshot, model_files

MAIN, V2 = "1" * 40, "2" * 40


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """An empty HF cache, online, no token; returns the hub cache directory."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return cache


def _endpoint(monkeypatch, url):
    monkeypatch.setattr(constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@pytest.fixture
def hub(hf, monkeypatch):
    """``hub(repos, **kw) -> FakeHub``, made the endpoint."""
    started = []

    def start(repos, **kw):
        fake = FakeHub(repos, **kw)
        started.append(fake)
        _endpoint(monkeypatch, fake.url)
        return fake

    yield start
    for fake in started:
        fake.close()


@pytest.fixture(scope="module")
def files(text_dir):
    return model_files(text_dir)


def test_a_directory_is_used_as_it_is(text_dir):
    resolved = resolve_model(str(text_dir))
    assert (resolved.directory, resolved.name, resolved.kind) == (text_dir, "text", "directory")
    with pytest.raises(ModelSourceError, match="--revision 'v2' is a revision of a Hub model"):
        resolve_model(str(text_dir), revision="v2")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("./no/such/dir", "no such directory or .gguf file, and not a Hugging Face Hub id"),
        ("/no/such/dir", "no such directory or .gguf file, and not a Hugging Face Hub id"),
        ("missing.gguf", "no such GGUF file"),
    ],
)
def test_a_path_that_names_nothing_is_one_line(model, message):
    with pytest.raises(ModelSourceError, match=message) as info:
        resolve_model(model)
    assert "\n" not in str(info.value)


def test_a_file_that_is_not_gguf_is_refused(text_dir):
    with pytest.raises(ModelSourceError, match="is a file, not a model directory or a .gguf"):
        resolve_model(str(text_dir / "config.json"))


def test_hub_ids_are_huggingface_hubs_rule():
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id("./x") and not is_hub_id("a/b/c") and not is_hub_id("a--b/c")


def test_offline_a_cached_hub_id_resolves_to_its_snapshot_at_each_revision(hf, files, monkeypatch):
    main = cache_snapshot(hf, "acme/tiny", MAIN, files)
    v2 = cache_snapshot(hf, "acme/tiny", V2, files, refs=("v2",))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("acme/tiny").directory == main
    assert resolve_model("acme/tiny", revision="v2").directory == v2
    assert resolve_model("acme/tiny", revision=V2).directory == v2  # a commit
    assert resolve_model("acme/tiny").name == "acme/tiny"
    with pytest.raises(ModelSourceError) as info:
        resolve_model("acme/tiny", revision="v3")
    message = str(info.value)
    assert "revision 'v3'" in message and "HF_HUB_OFFLINE is set" in message
    assert "`hf download acme/tiny --revision v3`" in message and "\n" not in message


def test_a_config_is_resolved_once(hf, files, monkeypatch, text_dir):
    cache_snapshot(hf, "acme/tiny", MAIN, files)
    cache_snapshot(hf, "acme/draft", MAIN, files)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = EngineConfig(
        model="acme/tiny", speculative_method="draft", speculative_model="acme/draft"
    )
    resolved = resolve_model_source(config)
    assert resolved.model == str(hf / "models--acme--tiny" / "snapshots" / MAIN)
    assert resolved.speculative_model == str(hf / "models--acme--draft" / "snapshots" / MAIN)
    assert (resolved.model_source, resolved.served_model_name) == ("acme/tiny", "acme/tiny")
    # Resolved, it never goes back to the cache (an engine core process gets this config).
    (hf / "models--acme--tiny" / "refs" / "main").unlink()
    assert resolve_model_source(resolved) is resolved
    with pytest.raises(ModelSourceError):
        resolve_model_source(config)
    named = resolve_model_source(EngineConfig(model=str(text_dir), served_model_name="base"))
    assert (named.model, named.model_source, named.served_model_name) == (
        str(text_dir),
        str(text_dir),
        "base",
    )


def test_a_hub_id_is_downloaded_with_only_what_the_engine_reads(hub, hf, files):
    extra = {
        "pytorch_model.bin": b"pickle",  # safetensors only
        "consolidated.safetensors": b"a second copy",  # Mistral's own format
        "original/params.json": b"{}",  # Meta's own format
        "README.md": b"# card",
    }
    fake = hub({"acme/tiny": {"main": (MAIN, {**files, **extra}), "v2": (V2, files)}})
    resolved = resolve_model("acme/tiny")
    assert resolved.directory == hf / "models--acme--tiny" / "snapshots" / MAIN
    assert sorted(fake.downloaded()) == sorted(files)
    assert (resolved.directory / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert (hf / "models--acme--tiny" / "refs" / "main").read_text() == MAIN
    assert resolve_model("acme/tiny", revision="v2").directory.name == V2
    assert all(auth is None for _, _, auth in fake.requests)
    assert "*.safetensors" in ALLOW_PATTERNS


def test_the_token_is_sent_and_its_refusals_are_one_line(hub, files, monkeypatch):
    fake = hub({"acme/private": {"main": (MAIN, files)}}, token="hf_right")
    with pytest.raises(ModelSourceError, match=r"or it is private \(no HF_TOKEN is set\)"):
        resolve_model("acme/private")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelSourceError, match="the Hub refused the token"):
        resolve_model("acme/private")
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    assert resolve_model("acme/private").directory.name == MAIN
    assert fake.requests[-1][2] == "Bearer hf_right"


@pytest.mark.parametrize(
    ("repo", "revision", "message"),
    [
        ("acme/none", None, "no such repository on the Hub, or it is private"),
        ("acme/tiny", "v9", "the repository has no revision 'v9'"),
        ("acme/gated", None, "is gated: accept its terms at http"),
        ("acme/bins", None, "has no safetensors weights"),
        ("acme/down", None, r"the Hub at http\S+ answered HTTP 503: The Hub is down for"),
    ],
)
def test_hub_refusals_are_one_line(hub, files, repo, revision, message):
    bins = {"config.json": files["config.json"], "pytorch_model.bin": b"pickle"}
    repos = {
        "acme/tiny": {"main": (MAIN, files)},
        "acme/gated": {"main": (MAIN, files)},
        "acme/bins": {"main": (MAIN, bins)},
    }
    hub(repos, gated={"acme/gated"}, broken={"acme/down"})
    with pytest.raises(ModelSourceError, match=message) as info:
        resolve_model(repo, revision=revision)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"model '{repo}'")


def test_an_unreachable_hub_is_one_line_and_the_cache_still_serves(hf, files, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _endpoint(monkeypatch, f"http://127.0.0.1:{port}")
    with pytest.raises(ModelSourceError) as info:
        resolve_model("acme/tiny")
    message = str(info.value)
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in message
    assert "Connection refused" in message and "`hf download acme/tiny`" in message
    assert "pass a local directory" in message and "\n" not in message
    main = cache_snapshot(hf, "acme/tiny", MAIN, files)
    assert resolve_model("acme/tiny").directory == main  # huggingface_hub falls back to it
