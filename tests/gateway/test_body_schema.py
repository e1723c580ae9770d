"""The request bodies against the ``openai`` SDK's own parameter types: every parameter of
Chat Completions and Completions is declared (honoured, ignored or refused), so none is ever
"unknown"; refused ones and unknown ones are 400s naming them; ``/docs`` shows the types."""

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from loraplex.gateway.domains.chat.body import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionBody,
    CompletionBody,
    convert_body,
)
from loraplex.gateway.errors import APIError

SDK_CHAT = set(chat_params.CompletionCreateParamsBase.__annotations__)
SDK_COMPLETION = set(completion_params.CompletionCreateParamsBase.__annotations__)


def test_every_sdk_parameter_is_declared():
    assert SDK_CHAT - set(ChatCompletionBody.__struct_fields__) == set()
    assert SDK_COMPLETION - set(CompletionBody.__struct_fields__) == set()
    assert set(IGNORED_FIELDS) <= set(ChatCompletionBody.__struct_fields__)


@pytest.mark.parametrize("name", sorted(REFUSED_FIELDS))
def test_refused_fields_are_400_naming_them(name):
    kind = CompletionBody if name == "suffix" else ChatCompletionBody
    body = {"model": "m", "messages": [], "prompt": "p", name: "x"}
    body.pop("prompt" if kind is ChatCompletionBody else "messages")
    with pytest.raises(APIError) as err:
        convert_body(body, kind)
    assert err.value.status == 400 and err.value.param == name


def test_types_are_checked_with_the_field_path():
    cases = [
        ({"temperature": True}, "temperature"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"logit_bias": {"1": "x"}}, "logit_bias"),
        ({"frobnicate": 1}, "frobnicate"),
    ]
    for extra, param in cases:
        with pytest.raises(APIError) as err:
            convert_body({"model": "m", "messages": [], **extra}, ChatCompletionBody)
        assert err.value.param == param, (extra, err.value.message)


def test_docs_show_the_body_types():
    from litestar import Litestar
    from litestar.di import Provide

    from loraplex.gateway.domains import chat, tokenize
    from loraplex.gateway.server.app import DEPENDENCY_NAMES

    unused = {name: Provide(lambda: None, sync_to_thread=False) for name in DEPENDENCY_NAMES}
    app = Litestar(route_handlers=[*chat.ROUTES, *tokenize.ROUTES], dependencies=unused)
    schema = app.openapi_schema.to_schema()
    components = schema["components"]["schemas"]
    assert {"ChatCompletionBody", "CompletionBody", "DetokenizeBody"} <= set(components)
    chat_fields = set(components["ChatCompletionBody"]["properties"])
    assert {"tools", "logit_bias", "min_tokens", "user"} <= chat_fields
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("CompletionBody")
