"""``/v1/adapters`` on a live gateway: real PEFT adapters (made with peft on the tiny LLaVA)
uploaded as files and as archives, listed, fetched, replaced, deleted; every refusal of the
multi-LoRA issue as a 400 with OpenAI's body and the store unchanged; archive attacks; tenant
isolation; body limits; and an uploaded adapter used by name in chat, token for token equal to
the engine run on the adapter directory, which equals transformers + peft.
"""

from __future__ import annotations

import io
import json
import re
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path

import openai
import pytest
import torch

from tests.adapters.conftest import edit_config, edit_tensors, make_adapter, store_snapshot
from tests.gateway.live import ADMIN_KEY, LiveGateway
from tests.gateway.test_app_basics import assert_openai_error

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

LM = r".*language_model.*\."
GOOD = dict(r=4, lora_alpha=8, target_modules=LM + r"(q_proj|v_proj)")
OTHER = dict(r=8, lora_alpha=16, target_modules=LM + r"(gate_proj|up_proj|down_proj)")
CONTRACT_KEYS = {
    "name",
    "digest",
    "rank",
    "lora_alpha",
    "target_modules",
    "base_model",
    "created_at",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway-adapters")


@pytest.fixture(scope="module")
def good_dir(hf_llava, root):
    return make_adapter(hf_llava, root / "good", seed=1, **GOOD)[0]


@pytest.fixture(scope="module")
def other_dir(hf_llava, root):
    return make_adapter(hf_llava, root / "other", seed=2, **OTHER)[0]


def read(adapter_dir: Path) -> tuple[bytes, bytes]:
    return (
        (adapter_dir / "adapter_config.json").read_bytes(),
        (adapter_dir / "adapter_model.safetensors").read_bytes(),
    )


def file_parts(config: bytes | None, weights: bytes | None, weights_name=None) -> list:
    parts = []
    if config is not None:
        parts.append(("files", ("adapter_config.json", config, "application/json")))
    if weights is not None:
        name = weights_name or "adapter_model.safetensors"
        parts.append(("files", (name, weights, "application/octet-stream")))
    return parts


def upload(client, name, parts, *, replace=None, **kw):
    params = {"replace": replace} if replace is not None else None
    return client.post("/v1/adapters", data={"name": name}, files=parts, params=params, **kw)


def upload_dir(client, name, adapter_dir, **kw):
    return upload(client, name, file_parts(*read(adapter_dir)), **kw)


def zip_of(adapter_dir: Path, extra: dict | None = None) -> bytes:
    """The adapter directory as ``cd dir && zip -r a.zip .`` would make it (README included)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(adapter_dir.iterdir()):
            z.write(path, path.name)
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return buf.getvalue()


def tar_gz_of(adapter_dir: Path, extra=()) -> bytes:
    """``tar czf a.tar.gz -C dir .``, plus ``extra`` TarInfo members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(adapter_dir, arcname=".")
        for info in extra:
            t.addfile(info)
    return buf.getvalue()


def archive_part(blob: bytes, filename="adapter.zip") -> list:
    return [("archive", (filename, blob, "application/octet-stream"))]


def digest_of(adapter_dir: Path, live) -> str:
    from loraplex.adapters.validation import load_adapter_dir

    limits = live.state.engine.adapter_limits
    return load_adapter_dir(
        adapter_dir,
        limits=limits,
    ).digest


# ----------------------------------------------------------------------------- happy paths
def test_upload_files_list_get_delete(live, good_dir):
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        r = upload_dir(c, "my-adapter_v1.0", good_dir)
        assert r.status_code == 201, r.text
        body = r.json()
        assert set(body) == CONTRACT_KEYS
        config = json.loads((good_dir / "adapter_config.json").read_text())
        assert body["name"] == "my-adapter_v1.0"
        assert body["digest"] == digest_of(good_dir, live)
        assert body["rank"] == 4 and body["lora_alpha"] == 8
        assert body["target_modules"] == ["q_proj", "v_proj"]
        assert body["base_model"] == config["base_model_name_or_path"]
        assert body["created_at"].endswith("+00:00")
        assert live.state.store.has(body["digest"])
        # warmed in the engine: the first chat does not pay a cold load
        assert body["digest"] in live.state.engine.core.engine_core.lora_manager.cpu_digests

        listing = c.get("/v1/adapters").json()
        assert listing == {"object": "list", "data": [body]}
        assert c.get("/v1/adapters/my-adapter_v1.0").json() == body

        r = c.delete("/v1/adapters/my-adapter_v1.0")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert_openai_error(c.get("/v1/adapters/my-adapter_v1.0"), 404, "not_found")
        assert_openai_error(c.delete("/v1/adapters/my-adapter_v1.0"), 404)
        assert c.get("/v1/adapters").json() == {"object": "list", "data": []}
        # nobody else holds the weights: they left the engine and the store
        assert not live.state.store.has(body["digest"])
        assert body["digest"] not in live.state.engine.core.engine_core.lora_manager.cpu_digests
        # the name is free again
        assert upload_dir(c, "my-adapter_v1.0", good_dir).status_code == 201


@pytest.mark.parametrize("kind", ["zip", "tar.gz", "zip-named-tgz"])
def test_upload_archive(live, good_dir, kind):
    t = live.create_tenant("acme")
    blob = tar_gz_of(good_dir) if kind == "tar.gz" else zip_of(good_dir)
    # the format is told by content: a zip called .tar.gz is still a zip
    filename = {"zip": "a.zip", "tar.gz": "a.tar.gz", "zip-named-tgz": "a.tar.gz"}[kind]
    with live.client(t["api_key"]) as c:
        r = upload(c, "arch", archive_part(blob, filename))
        assert r.status_code == 201, r.text
        assert r.json()["digest"] == digest_of(good_dir, live)
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == ["arch"]


def test_conflict_and_replace(live, good_dir, other_dir):
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        first = upload_dir(c, "x", good_dir).json()
        before = store_snapshot(live.state.store)
        err = assert_openai_error(upload_dir(c, "x", other_dir), 409, "conflict")
        assert "replace=true" in err["message"]
        assert store_snapshot(live.state.store) == before  # refused before anything was stored
        assert_openai_error(upload_dir(c, "x", good_dir, replace="false"), 409)

        r = upload_dir(c, "x", other_dir, replace="true")
        assert r.status_code == 201, r.text
        second = r.json()
        assert second["digest"] != first["digest"] and second["rank"] == 8
        assert c.get("/v1/adapters/x").json() == second
        assert [a["digest"] for a in c.get("/v1/adapters").json()["data"]] == [second["digest"]]
        # the replaced weights had no other live row: gone; the new ones stored
        assert not live.state.store.has(first["digest"])
        assert live.state.store.has(second["digest"])
        # replacing with identical weights keeps them
        assert upload_dir(c, "x", other_dir, replace="true").status_code == 201
        assert live.state.store.has(second["digest"])
        # replace=true for a new name is a plain upload
        assert upload_dir(c, "y", good_dir, replace="true").status_code == 201
        assert_openai_error(upload_dir(c, "z", good_dir, replace="maybe"), 400)


def test_concurrent_uploads_of_one_name(live, good_dir, other_dir):
    """Racing uploads of one name: exactly one wins, the rest are 409, the store holds only the
    winner's weights (the loser's, if stored, are collected)."""
    from concurrent.futures import ThreadPoolExecutor

    t = live.create_tenant("acme")
    before = set(live.state.store.digests())

    def one(adapter_dir):
        with live.client(t["api_key"]) as c:
            return upload_dir(c, "race", adapter_dir)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(one, [good_dir, other_dir] * 3))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201, 409, 409, 409, 409, 409], [r.text for r in responses]
    winner = next(r.json() for r in responses if r.status_code == 201)
    with live.client(t["api_key"]) as c:
        assert c.get("/v1/adapters").json()["data"] == [winner]
    after = set(live.state.store.digests())
    assert winner["digest"] in after and after - before <= {winner["digest"]}


def test_tenants_never_see_each_others_adapters(live, good_dir):
    a, b = live.create_tenant("a"), live.create_tenant("b")
    with live.client(a["api_key"]) as ca, live.client(b["api_key"]) as cb:
        digest = upload_dir(ca, "secret", good_dir).json()["digest"]
        assert_openai_error(cb.get("/v1/adapters/secret"), 404, "not_found")
        assert_openai_error(cb.delete("/v1/adapters/secret"), 404, "not_found")
        assert cb.get("/v1/adapters").json()["data"] == []
        assert [m["id"] for m in cb.get("/v1/models").json()["data"]] == ["tiny-llava"]
        assert_openai_error(cb.get("/v1/models/secret"), 404, "model_not_found")
        assert ca.get("/v1/adapters/secret").status_code == 200  # B's delete did nothing

        # names are per tenant: B may use the same name, and the same weights share a digest
        assert upload_dir(cb, "secret", good_dir).json()["digest"] == digest
        assert ca.delete("/v1/adapters/secret").status_code == 200
        assert live.state.store.has(digest)  # B's live row still holds the weights
        assert cb.get("/v1/adapters/secret").status_code == 200
        assert cb.delete("/v1/adapters/secret").status_code == 200
        assert not live.state.store.has(digest)


def test_keys_and_guards(live, good_dir):
    with live.client() as c:
        assert_openai_error(c.get("/v1/adapters"), 401)
        assert_openai_error(upload_dir(c, "x", good_dir), 401)
    with live.client(ADMIN_KEY) as c:  # the admin key serves /admin/* only
        assert_openai_error(c.get("/v1/adapters"), 403)
        assert_openai_error(upload_dir(c, "x", good_dir), 403)
        assert_openai_error(c.delete("/v1/adapters/x"), 403)


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "name",
    ["", "has space", "a/b", "x" * 65, "émile", "semi;colon", "tab\t"],
)
def test_bad_names(live, good_dir, name):
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        err = assert_openai_error(upload_dir(c, name, good_dir), 400)
        assert err["param"] == "name"
        assert c.get("/v1/adapters").json()["data"] == []


def test_form_shape_refusals(live, good_dir):
    t = live.create_tenant("acme")
    config, weights = read(good_dir)
    with live.client(t["api_key"]) as c:
        r = c.post("/v1/adapters", files=file_parts(config, weights))  # no name
        assert assert_openai_error(r, 400)["param"] == "name"
        r = c.post("/v1/adapters", json={"name": "x"})
        assert "multipart/form-data" in assert_openai_error(r, 400)["message"]
        r = upload(c, "x", [])
        assert "'archive'" in assert_openai_error(r, 400)["message"]
        both = file_parts(config, weights) + archive_part(zip_of(good_dir))
        assert "not both" in assert_openai_error(upload(c, "x", both), 400)["message"]
        two = archive_part(zip_of(good_dir)) * 2
        assert_openai_error(upload(c, "x", two), 400)
        dup = file_parts(config, weights) + file_parts(None, weights)
        assert "twice" in assert_openai_error(upload(c, "x", dup), 400)["message"]
        # a file part without a file name arrives as a text field
        r = c.post(
            "/v1/adapters",
            data={"name": "x", "files": "not a file"},
            files=file_parts(config, None),
        )
        assert_openai_error(r, 400)
        err = assert_openai_error(upload(c, "tiny-llava", file_parts(config, weights)), 409)
        assert "base model" in err["message"]
        assert c.get("/v1/adapters").json()["data"] == []


@pytest.fixture(scope="module")
def bad_adapters(hf_llava, good_dir, root):
    """``case -> (form parts, message pattern)``: each refusal of the multi-LoRA issue."""
    config, weights = read(good_dir)

    def peft(name, **kw):
        return read(make_adapter(hf_llava, root / name, seed=3, **{**GOOD, **kw})[0])

    def edited(name, **changes):
        copy = root / name
        copy.mkdir(exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (copy / f).write_bytes((good_dir / f).read_bytes())
        return read(edit_config(copy, **changes))

    def tensors(name, fn):
        copy = root / name
        copy.mkdir(exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (copy / f).write_bytes((good_dir / f).read_bytes())
        return read(edit_tensors(copy, fn))

    pickle_dir = make_adapter(hf_llava, root / "pickle", seed=3, safe=False, **GOOD)[0]
    pickled = (pickle_dir / "adapter_model.bin").read_bytes()
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    begin, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [begin + 10**6, end + 10**6]  # points past the file
    lie = json.dumps(header).encode()
    lying = len(lie).to_bytes(8, "little") + lie + weights[8 + n :]

    return {
        "pickle-file": (
            file_parts(config, pickled, "adapter_model.bin"),
            "adapter_model.bin are a pickle file",
        ),
        "pickle-bytes": (file_parts(config, pickled), "pickle"),
        "missing-config": (file_parts(None, weights), "no 'files' part named adapter_config"),
        "missing-weights": (file_parts(config, None), "no 'files' part named adapter_model"),
        "rank-too-high": (
            file_parts(*peft("r80", r=80)),
            "r = 80 exceeds the server's max LoRA rank 64",
        ),
        "shape-mismatch": (
            file_parts(*tensors("shape", lambda t: {k: v[:, :3] for k, v in t.items()})),
            r"has shape \[.*\], expected",
        ),
        "unknown-target": (
            file_parts(*edited("unknown", target_modules=["q_proj", "nonexistent_proj"])),
            "'nonexistent_proj' matches no module",
        ),
        "vision-tower-target": (
            file_parts(*peft("fc1", target_modules=["fc1"])),
            r"fc1 \(vision tower\)",
        ),
        "dora": (file_parts(*peft("dora", use_dora=True)), "DoRA"),
        "modules-to-save": (
            file_parts(*peft("mts", modules_to_save=["lm_head"])),
            "modules_to_save",
        ),
        "truncated": (file_parts(config, weights[:-10]), "truncated or corrupt"),
        "empty-weights": (file_parts(config, b""), "truncated"),
        "header-lies": (file_parts(config, lying), "truncated or corrupt|overlaps|gap"),
        "not-lora": (file_parts(*edited("ia3", peft_type="IA3")), "'IA3' is not supported"),
        "nan": (
            file_parts(
                *tensors("nan", lambda t: {k: v.clone().fill_(torch.nan) for k, v in t.items()})
            ),
            "NaN",
        ),
        "config-not-json": (file_parts(b"{not json", weights), "not valid JSON"),
    }


def test_every_bad_adapter_is_a_400_and_the_store_is_unchanged(live, good_dir, bad_adapters):
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        assert upload_dir(c, "keep", good_dir).status_code == 201  # so "unchanged" means something
        before = store_snapshot(live.state.store)
        for case, (parts, match) in bad_adapters.items():
            r = upload(c, f"bad-{case}", parts)
            err = assert_openai_error(r, 400)
            assert err["type"] == "invalid_request_error", case
            assert re.search(match, err["message"]), (case, err["message"])
            assert store_snapshot(live.state.store) == before, case
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == ["keep"]


def test_bad_adapter_inside_an_archive(live, root, good_dir):
    """The validator's refusals reach archive uploads as well."""
    t = live.create_tenant("acme")
    bad = root / "bad-in-archive"
    bad.mkdir(exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (bad / f).write_bytes((good_dir / f).read_bytes())
    edit_config(bad, r=128)
    before = store_snapshot(live.state.store)
    with live.client(t["api_key"]) as c:
        for blob in (zip_of(bad), tar_gz_of(bad)):
            err = assert_openai_error(upload(c, "bad", archive_part(blob)), 400, "invalid_adapter")
            assert "exceeds the server's max LoRA rank" in err["message"]
            assert err["param"] == "archive"
    assert store_snapshot(live.state.store) == before


# ------------------------------------------------------------------------ archive attacks
def _tar_info(name, kind=tarfile.REGTYPE, **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in attrs.items():
        setattr(info, k, v)
    return info


def test_archive_attacks(live, good_dir):
    t = live.create_tenant("acme")
    symlink = _tar_info("link", tarfile.SYMTYPE, linkname="/etc/passwd")
    hardlink = _tar_info("hard", tarfile.LNKTYPE, linkname="/etc/shadow")
    device = _tar_info("dev", tarfile.CHRTYPE, devmajor=1, devminor=3)
    cases = {
        "zip-slip": (zip_of(good_dir, {"../x": b"pwned"}), "outside the archive"),
        "zip-slip-deep": (zip_of(good_dir, {"a/../../x": b"pwned"}), "outside the archive"),
        "absolute": (zip_of(good_dir, {"/tmp/x": b"pwned"}), "absolute path"),
        "tar-symlink": (tar_gz_of(good_dir, [symlink]), "is a link"),
        "tar-hardlink": (tar_gz_of(good_dir, [hardlink]), "is a link"),
        "tar-device": (tar_gz_of(good_dir, [device]), "not a regular file"),
        "too-many": (
            zip_of(good_dir, {f"junk/{i}": b"" for i in range(20)}),
            "more than 16 entries",
        ),
        "not-an-archive": (b"just some bytes, no magic", "neither a .zip nor a .tar.gz"),
        "corrupt": (zip_of(good_dir)[:-200], "corrupt or truncated"),
        "nested": (_nested_zip(good_dir), "must be at the archive's root"),
    }
    before = store_snapshot(live.state.store)
    with live.client(t["api_key"]) as c:
        for case, (blob, match) in cases.items():
            err = assert_openai_error(upload(c, "x", archive_part(blob)), 400, "invalid_archive")
            assert re.search(match, err["message"]), (case, err["message"])
            assert err["param"] == "archive"
        assert c.get("/v1/adapters").json()["data"] == []
    assert store_snapshot(live.state.store) == before


def _nested_zip(adapter_dir: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path in sorted(adapter_dir.iterdir()):
            z.write(path, f"{adapter_dir.name}/{path.name}")
    return buf.getvalue()


# ------------------------------------------------------------------------------ limits
@pytest.fixture
def tight(engine_client, tmp_path):
    """A gateway with small limits: chat bodies 64 KiB, uploads 1 MiB, archives 4 entries
    unpacking to 512 KiB."""
    from tests.gateway.conftest import adapter_store_dir

    store = adapter_store_dir(Path(engine_client.config.model))
    with LiveGateway(
        engine_client,
        tmp_path / "tight",
        adapter_store_dir=store,
        chat_max_body_bytes=64 * 1024,
        upload_max_body_bytes=1024 * 1024,
        max_archive_members=4,
        max_archive_unpacked_bytes=512 * 1024,
    ) as gw:
        yield gw


def test_upload_body_limits(tight, good_dir):
    t = tight.create_tenant("acme")
    config, weights = read(good_dir)
    padding = ("files", ("README.md", b"#" * (300 * 1024), "text/markdown"))
    with tight.client(t["api_key"]) as c:
        # past the chat limit, within the upload limit: the route's own limit applies
        r = upload(c, "padded", file_parts(config, weights) + [padding])
        assert r.status_code == 201, r.text
        big = ("files", ("README.md", b"#" * (1100 * 1024), "text/markdown"))
        err = assert_openai_error(upload(c, "big", file_parts(config, weights) + [big]), 413)
        assert err["code"] == "request_too_large"

        # no Content-Length (chunked): the limit is enforced on the bytes as they stream
        import httpx

        body, ctype = _multipart({"name": "chunked"}, file_parts(config, weights) + [big])
        r = c.post(
            "/v1/adapters",
            content=(body[i : i + 65536] for i in range(0, len(body), 65536)),
            headers={"content-type": ctype},
        )
        assert_openai_error(r, 413)
        assert isinstance(r, httpx.Response)
        # other routes keep the (smaller) app default
        r = c.post(
            "/v1/chat/completions",
            content=b"{" + b" " * (100 * 1024) + b"}",
            headers={"content-type": "application/json"},
        )
        assert_openai_error(r, 413)
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == ["padded"]


def test_archive_caps_from_config(tight, good_dir):
    t = tight.create_tenant("acme")
    with tight.client(t["api_key"]) as c:
        r = upload(c, "ok", archive_part(zip_of(good_dir)))  # 3 entries with README.md
        assert r.status_code == 201, r.text
        five = zip_of(good_dir, {"a": b"", "b": b""})
        err = assert_openai_error(upload(c, "five", archive_part(five)), 400)
        assert "more than 4 entries" in err["message"]
        # a zip bomb built here: the weights inflate 1000:1 past the 512 KiB cap
        bomb_dir = Path(tight.state.config.data_dir) / "bomb"
        bomb_dir.mkdir()
        (bomb_dir / "adapter_config.json").write_bytes(read(good_dir)[0])
        (bomb_dir / "adapter_model.safetensors").write_bytes(bytes(32 << 20))
        bomb = zip_of(bomb_dir)
        assert len(bomb) < 100_000
        err = assert_openai_error(upload(c, "bomb", archive_part(bomb)), 400)
        assert "unpacks to more than 524288 bytes" in err["message"]
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == ["ok"]


def _multipart(data: dict, files: list) -> tuple[bytes, str]:
    """A multipart body as httpx would send it, for a hand-streamed request."""
    import httpx

    request = httpx.Request("POST", "http://x/", data=data, files=files)
    return request.read(), request.headers["content-type"]


# ------------------------------------------------------------------------- used in chat
@pytest.fixture(scope="module")
def peft_reference(llava_dir, good_dir):
    """The adapter directory through ``engine.client.llm.LLM`` and through transformers + peft."""
    from peft import PeftModel
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams
    from tests.engine.conftest import photo, user
    from tests.engine.test_engine_parity import hf_greedy

    conversations = [
        (user("hello there, tell me about the sea"), 8),
        (user("what is in this picture?", photo("astronaut")), 8),
    ]
    llm = LLM(EngineConfig(model=str(llava_dir)))
    digest = llm.engine.add_lora_dir(str(good_dir)).digest
    requests = [
        llm.make_request(m, SamplingParams(temperature=0, max_tokens=k), lora_digest=digest)
        for m, k in conversations
    ]
    engine_outs = llm.generate(requests)
    processor = AutoProcessor.from_pretrained(llava_dir)
    base = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # transformers' deprecation notes inside peft
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(base, str(good_dir)).eval()
    oracle = [hf_greedy(model, processor, m, k, True) for m, k in conversations]
    return conversations, engine_outs, oracle


def test_uploaded_adapter_in_chat_equals_engine_and_peft(live, good_dir, peft_reference):
    conversations, engine_outs, oracle = peft_reference
    acme, other = live.create_tenant("acme"), live.create_tenant("other")
    with live.client(acme["api_key"]) as c:
        assert upload(c, "sea-lora", archive_part(tar_gz_of(good_dir), "a.tgz")).status_code == 201
    sdk = live.openai(acme["api_key"])
    for (messages, max_tokens), out, (prompt, tokens) in zip(
        conversations, engine_outs, oracle, strict=True
    ):
        # the engine on the adapter directory equals transformers + peft
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == tokens
        # the uploaded adapter, by name, through the gateway, equals both
        resp = sdk.chat.completions.create(
            model="sea-lora", messages=messages, max_tokens=max_tokens, temperature=0
        )
        assert resp.model == "sea-lora"
        assert resp.choices[0].message.content == out.outputs[0].text
        assert resp.usage.prompt_tokens == len(prompt)
        assert resp.usage.completion_tokens == len(tokens)
        base = sdk.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=max_tokens, temperature=0
        )
        assert base.choices[0].message.content != resp.choices[0].message.content

    # another tenant cannot use it; after delete nobody can
    with pytest.raises(openai.NotFoundError):
        live.openai(other["api_key"]).chat.completions.create(
            model="sea-lora", messages=conversations[0][0], max_tokens=2
        )
    with live.client(acme["api_key"]) as c:
        assert c.delete("/v1/adapters/sea-lora").status_code == 200
        r = c.post(
            "/v1/chat/completions",
            json={"model": "sea-lora", "messages": conversations[0][0], "max_tokens": 2},
        )
        assert_openai_error(r, 404, "model_not_found")


def test_delete_while_a_request_runs(live, good_dir, other_dir):
    """A running request keeps its adapter to the end; new requests get 404 at once; the
    weights leave the store once the engine lets go (collected by the next change)."""
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        digest = upload_dir(c, "busy", good_dir).json()["digest"]
        other = upload_dir(c, "other", other_dir).json()["digest"]
    sdk = live.openai(t["api_key"])
    messages = [{"role": "user", "content": [{"type": "text", "text": "go on and on"}]}]
    stream = sdk.chat.completions.create(
        model="busy", messages=messages, max_tokens=200, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    assert live.state.engine.stats()["lora_slots_in_use"] == 1  # running, holding its slot
    with live.client(t["api_key"]) as c:
        assert c.delete("/v1/adapters/busy").status_code == 200
        assert live.state.store.has(digest)  # the engine refused: a request runs on it
        r = c.post("/v1/chat/completions", json={"model": "busy", "messages": messages})
        assert_openai_error(r, 404, "model_not_found")
        rest = list(chunks)
        reasons = [x.choices[0].finish_reason for x in rest if x.choices]
        assert [r for r in reasons if r] in (["length"], ["stop"])
        assert "".join(x.choices[0].delta.content or "" for x in rest if x.choices)
        assert c.delete("/v1/adapters/other").status_code == 200
    assert not live.state.store.has(digest) and not live.state.store.has(other)
