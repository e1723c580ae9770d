"""Bounded memory per adapter upload: caps derived from the served model, enforced as bytes stream.

Every assertion is on behaviour (a 400/413 with the right param and message, the byte caps the
server applies, how many uploads are processed at once), never on wall time.
"""

from __future__ import annotations

import io
import json
import re
import struct
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from loraplex.adapters.peft_config import MAX_CONFIG_BYTES
from loraplex.adapters.sizes import max_header_bytes, max_weights_bytes
from loraplex.gateway.domains.adapters import controller as adapter_controller
from loraplex.gateway.domains.adapters.form import MAX_PARTS, TEXT_FIELD_BYTES
from loraplex.gateway.domains.adapters.limits import UploadLimits
from tests.adapters.conftest import make_adapter, store_snapshot
from tests.gateway.live import LiveGateway
from tests.gateway.test_adapters_api import (
    GOOD,
    archive_part,
    file_parts,
    read,
    upload,
)
from tests.gateway.test_app_basics import assert_openai_error

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def good_dir(hf_llava, tmp_path_factory):
    return make_adapter(hf_llava, tmp_path_factory.mktemp("limits") / "good", seed=1, **GOOD)[0]


def _weights_cap(live) -> int:
    limits = live.state.engine.adapter_limits
    return max_weights_bytes(limits.targets, limits.max_rank)


def test_caps_are_derived_from_the_served_model(live):
    """The tiny model's largest valid adapter sets the caps, far below the configured 512 MiB."""
    limits = UploadLimits.derive(live.state.engine.adapter_limits, live.state.config)
    weights = _weights_cap(live)
    assert limits.weights_bytes == weights
    assert limits.config_bytes == MAX_CONFIG_BYTES
    assert limits.body_bytes < live.state.config.upload_max_body_bytes
    assert limits.body_bytes < 2 * (weights + MAX_CONFIG_BYTES) + (2 << 20)
    handler = next(
        r.route_handlers[0]
        for r in live.app.routes
        if r.path == "/v1/adapters" and "POST" in getattr(r, "methods", ())
    )
    assert handler.resolve_request_max_body_size() == limits.body_bytes


def test_body_over_the_derived_limit_is_413(live, good_dir):
    t = live.create_tenant("acme")
    config, _ = read(good_dir)
    limits = UploadLimits.derive(live.state.engine.adapter_limits, live.state.config)
    junk = ("files", ("README.md", b"#" * limits.body_bytes, "text/markdown"))
    with live.client(t["api_key"]) as c:
        err = assert_openai_error(upload(c, "big", file_parts(config, b"x") + [junk]), 413)
        assert err["code"] == "request_too_large"


def test_weights_part_over_the_largest_valid_adapter_is_refused_while_streaming(live, good_dir):
    t = live.create_tenant("acme")
    config, _ = read(good_dir)
    cap = _weights_cap(live)
    before = store_snapshot(live.state.store)
    with live.client(t["api_key"]) as c:
        r = upload(c, "fat", file_parts(config, bytes(cap + 1)))
        err = assert_openai_error(r, 400, "invalid_adapter")
        assert err["param"] == "files"
        assert f"larger than {cap} bytes" in err["message"]
        big_config = json.dumps({"peft_type": "LORA", "x": " " * MAX_CONFIG_BYTES}).encode()
        err = assert_openai_error(upload(c, "cfg", file_parts(big_config, b"w")), 400)
        assert f"adapter_config.json is larger than {MAX_CONFIG_BYTES}" in err["message"]
    assert store_snapshot(live.state.store) == before


def test_text_fields_and_part_count_are_bounded(live, good_dir):
    t = live.create_tenant("acme")
    config, weights = read(good_dir)
    with live.client(t["api_key"]) as c:
        r = upload(c, "n" * (TEXT_FIELD_BYTES + 1), file_parts(config, weights))
        assert assert_openai_error(r, 400)["param"] == "name"
        r = c.post(
            "/v1/adapters",
            data={"name": "a", "junk": "j" * (TEXT_FIELD_BYTES + 1)},
            files=file_parts(config, weights),
        )
        assert "longer than" in assert_openai_error(r, 400)["message"]
        many = [("files", (f"r{i}.md", b"#", "text/plain")) for i in range(MAX_PARTS)]
        r = upload(c, "many", file_parts(config, weights) + many)
        assert f"more than {MAX_PARTS} parts" in assert_openai_error(r, 400)["message"]
        r = upload(c, "two", archive_part(b"PK\x03\x04") + archive_part(b"PK\x03\x04"))
        assert assert_openai_error(r, 400)["param"] == "archive"
        assert c.get("/v1/adapters").json()["data"] == []


def _safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def test_hostile_safetensors_headers(live, good_dir):
    """A header claiming 2^60 bytes, one with 10^6 entries, one over the derived header cap."""
    t = live.create_tenant("acme")
    config, _ = read(good_dir)
    limits = live.state.engine.adapter_limits
    header_cap = max_header_bytes(limits.targets)
    million = b"{" + b",".join(b'"t%d":{}' % i for i in range(10**6)) + b"}"
    few_bytes_many_entries = b"{" + b",".join(b'"%d":0' % i for i in range(6000)) + b"}"
    assert len(few_bytes_many_entries) < header_cap
    cases = {
        "huge": (struct.pack("<Q", 1 << 60) + b"{}", "header of 1152921504606846976 bytes"),
        "over-cap": (_safetensors(b" " * (header_cap + 1)), f"at most {header_cap}"),
        "entries": (_safetensors(few_bytes_many_entries), "more entries than 1080 tensors"),
    }
    with live.client(t["api_key"]) as c:
        for case, (weights, match) in cases.items():
            err = assert_openai_error(upload(c, case, file_parts(config, weights)), 400)
            assert err["param"] == "files", case
            assert re.search(match, err["message"]), (case, err["message"])
        # 10^6 entries weigh ~10 MB: past the derived body limit before a byte is parsed
        r = upload(c, "million", file_parts(config, _safetensors(million)))
        assert_openai_error(r, 413)


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("maker", [_zip, _tar_gz], ids=["zip", "tar.gz"])
def test_archive_bombs_stop_at_the_derived_caps(live, good_dir, maker):
    t = live.create_tenant("acme")
    config, _ = read(good_dir)
    cap = _weights_cap(live)
    bomb = maker({"adapter_config.json": config, "adapter_model.safetensors": bytes(64 << 20)})
    assert len(bomb) < 200_000
    with live.client(t["api_key"]) as c:
        err = assert_openai_error(upload(c, "bomb", archive_part(bomb)), 400, "invalid_archive")
        assert f"unpacks to more than {cap} bytes" in err["message"]
        junk = maker({"adapter_config.json": config, "README.md": bytes(64 << 20)})
        err = assert_openai_error(upload(c, "junk", archive_part(junk)), 400, "invalid_archive")
        assert "archive" in err["message"]


# ------------------------------------------------------------ one slot, many uploads
@pytest.fixture
def one_slot(engine_client, tmp_path):
    from tests.gateway.conftest import adapter_store_dir

    store = adapter_store_dir(Path(engine_client.config.model))
    with LiveGateway(
        engine_client, tmp_path / "one", adapter_store_dir=store, max_concurrent_uploads=1
    ) as gw:
        yield gw


def test_uploads_are_processed_one_slot_at_a_time(one_slot, good_dir, monkeypatch):
    """Three uploads arrive together; while the first holds the only slot (blocked inside it),
    the other two finish streaming their bodies and wait: none enters processing."""
    t = one_slot.create_tenant("acme")
    config, weights = read(good_dir)
    real_bytes, real_form = adapter_controller.adapter_bytes, adapter_controller.read_form
    state = {"active": 0, "most": 0, "entered": 0, "parsed": 0}
    lock, release = threading.Lock(), threading.Event()

    def counting_bytes(*args, **kwargs):
        with lock:
            state["active"] += 1
            state["entered"] += 1
            state["most"] = max(state["most"], state["active"])
            first = state["entered"] == 1
        try:
            if first:
                release.wait(30)
            return real_bytes(*args, **kwargs)
        finally:
            with lock:
                state["active"] -= 1

    async def counting_form(*args, **kwargs):
        form = await real_form(*args, **kwargs)
        state["parsed"] += 1
        return form

    monkeypatch.setattr(adapter_controller, "adapter_bytes", counting_bytes)
    monkeypatch.setattr(adapter_controller, "read_form", counting_form)
    results = {}

    def send(i):
        with one_slot.client(t["api_key"]) as c:
            results[i] = upload(c, f"a{i}", file_parts(config, weights)).status_code

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while (state["parsed"] < 3 or state["entered"] < 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state["parsed"] == 3 and state["entered"] == 1
    assert one_slot.state.adapters.uploads.locked()
    release.set()
    for thread in threads:
        thread.join(60)
    assert results == {0: 201, 1: 201, 2: 201}
    assert state["most"] == 1 and state["entered"] == 3


def test_chunked_body_without_length_is_still_capped(live, good_dir):
    t = live.create_tenant("acme")
    config, _ = read(good_dir)
    cap = _weights_cap(live)
    request = httpx.Request(
        "POST", "http://x/", data={"name": "c"}, files=file_parts(config, bytes(cap + 10))
    )
    body, ctype = request.read(), request.headers["content-type"]
    with live.client(t["api_key"]) as c:
        r = c.post(
            "/v1/adapters",
            content=(body[i : i + 65536] for i in range(0, len(body), 65536)),
            headers={"content-type": ctype},
        )
        assert assert_openai_error(r, 400)["param"] == "files"
