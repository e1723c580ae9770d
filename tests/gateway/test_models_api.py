"""``GET /v1/models``: the base model and the calling tenant's adapters, in OpenAI's list shape,
read through the ``openai`` SDK."""

from __future__ import annotations

import openai
import pytest

from tests.adapters.conftest import make_adapter
from tests.gateway.live import ADMIN_KEY
from tests.gateway.test_adapters_api import GOOD, OTHER, upload_dir
from tests.gateway.test_app_basics import assert_openai_error


@pytest.fixture(scope="module")
def two_dirs(hf_llava, tmp_path_factory):
    root = tmp_path_factory.mktemp("models-api")
    return (
        make_adapter(hf_llava, root / "a", seed=11, **GOOD)[0],
        make_adapter(hf_llava, root / "b", seed=12, **OTHER)[0],
    )


def test_models_lists_base_then_own_adapters(live, two_dirs):
    acme, other = live.create_tenant("acme"), live.create_tenant("other")
    sdk = live.openai(acme["api_key"])
    models = sdk.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [("tiny-llava", "model", "loraplex")]
    assert isinstance(models[0].created, int)

    with live.client(acme["api_key"]) as c:
        assert upload_dir(c, "zeta", two_dirs[0]).status_code == 201
        row = upload_dir(c, "alpha", two_dirs[1]).json()
    with live.client(other["api_key"]) as c:
        assert upload_dir(c, "theirs", two_dirs[0]).status_code == 201

    with live.client(acme["api_key"]) as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny-llava", "alpha", "zeta"]
    alpha = body["data"][1]
    assert alpha == {
        "id": "alpha",
        "object": "model",
        "created": alpha["created"],
        "owned_by": "acme",
        "parent": "tiny-llava",
    }
    assert abs(alpha["created"] - _epoch(row["created_at"])) <= 1

    assert [m.id for m in sdk.models.list()] == ["tiny-llava", "alpha", "zeta"]
    assert sdk.models.retrieve("alpha").owned_by == "acme"
    assert sdk.models.retrieve("tiny-llava").owned_by == "loraplex"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("theirs")  # another tenant's adapter does not exist for acme
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nope")
    assert [m.id for m in live.openai(other["api_key"]).models.list()] == ["tiny-llava", "theirs"]

    with live.client(acme["api_key"]) as c:
        assert c.delete("/v1/adapters/zeta").status_code == 200
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-llava", "alpha"]
        assert_openai_error(c.get("/v1/models/zeta"), 404, "model_not_found")


def test_models_needs_a_tenant_key(live):
    with live.client() as c:
        assert_openai_error(c.get("/v1/models"), 401)
    with live.client(ADMIN_KEY) as c:
        assert_openai_error(c.get("/v1/models"), 403)


def _epoch(iso: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(iso).timestamp())


def test_base_model_card_says_what_adapters_may_target(live, hf_llava, tmp_path):
    """``lora`` on the base model: the served model's targets, and a PEFT regex that works."""
    acme = live.create_tenant("acme-targets")
    with live.client(acme["api_key"]) as c:
        lora = c.get("/v1/models/tiny-llava").json()["lora"]
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        limits = live.state.engine.adapter_limits
        assert lora == {
            "architecture": "LlavaForConditionalGeneration",
            "decoder_layers": "model.language_model.layers",
            "num_layers": 4,
            "target_modules": names,
            "target_modules_regex": limits.targets.peft_target_regex(),
            "max_rank": limits.max_rank,
        }
        assert c.get("/v1/models").json()["data"][0]["lora"] == lora
        # PEFT with that regex adapts the language model only (a plain list reaches CLIP too)
        regex = make_adapter(
            hf_llava, tmp_path / "r", r=4, target_modules=lora["target_modules_regex"]
        )
        assert upload_dir(c, "by-regex", regex[0]).json()["target_modules"] == sorted(names)
        plain = make_adapter(hf_llava, tmp_path / "p", r=4, target_modules=["q_proj"])
        error = assert_openai_error(upload_dir(c, "by-list", plain[0]), 400)
        assert "(vision tower)" in error["message"]
        assert "may target: " + ", ".join(names) in error["message"]
