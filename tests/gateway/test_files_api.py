"""``/v1/files`` through the openai SDK: upload, list, retrieve, content, delete, per tenant."""

import io
import json

import openai
import pytest


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}]},
}


def test_upload_list_retrieve_content_delete(live, client):
    data = jsonl([LINE, {**LINE, "custom_id": "b"}])
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.id.startswith("file-") and f.bytes == len(data) and f.purpose == "batch"
    assert f.filename == "in.jsonl" and f.status == "processed"
    assert client.files.retrieve(f.id).bytes == len(data)
    assert client.files.content(f.id).content == data
    assert [x.id for x in client.files.list()] == [f.id]
    assert [x.id for x in client.files.list(purpose="batch_output")] == []
    # another tenant sees none of it
    other = live.openai(live.create_tenant("other")["api_key"])
    assert list(other.files.list()) == []
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert client.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert list((live.state.config.files_dir).glob("file-*")) == []


@pytest.mark.parametrize(
    ("purpose", "data", "param"),
    [
        ("fine-tune", jsonl([LINE]), "purpose"),
        ("batch_output", jsonl([LINE]), "purpose"),
        ("batch", b"", "file"),
        ("batch", b"\n\n", "file"),
        ("batch", b"\xff\xfe{}\n", "file"),
    ],
)
def test_bad_uploads_are_400_naming_the_field(client, purpose, data, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", io.BytesIO(data)), purpose=purpose)
    assert err.value.body["param"] == param


def test_size_line_and_count_bounds(engine_client, tmp_path):
    from tests.gateway.live import LiveGateway

    bounds = {
        "batch_file_max_bytes": 1000,
        "batch_max_requests": 3,
        "batch_max_files_per_tenant": 1,
        "batch_max_active_per_tenant": 0,
    }
    with LiveGateway(engine_client, tmp_path / "d", **bounds) as gw:
        c = gw.openai(gw.create_tenant("t")["api_key"])
        with pytest.raises(openai.APIStatusError) as err:
            c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n" * 400)), purpose="batch")
        assert err.value.status_code == 413
        with pytest.raises(openai.BadRequestError) as err:
            c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n" * 4)), purpose="batch")
        assert err.value.body["param"] == "file"
        f = c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n" * 3)), purpose="batch")
        assert f.bytes == 9
        assert not list((tmp_path / "d" / "files").glob(".upload-*"))  # refused spools removed
        with pytest.raises(openai.RateLimitError) as err:  # the tenant's file count
            c.files.create(file=("y.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert err.value.body["code"] == "too_many_files"
        with pytest.raises(openai.RateLimitError) as err:  # its unfinished batches
            c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert err.value.body["code"] == "too_many_batches"
