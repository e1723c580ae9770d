"""LangChain's ``bind_tools(..., tool_choice="any")`` against a live gateway (issue 31): the
tool's schema has no ``additionalProperties`` (LangChain sends none), and the reply's
``AIMessage.tool_calls`` hold arguments that validate against it, with no key it does not list,
invoked or streamed.

Slow (a live gateway and a client library that is not in the test extra); skipped where
``langchain-openai`` is not installed (``pip install langchain-openai``).
"""

from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (not in the test extra)"
)
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402

MODEL = "tiny-llava"


class Add(BaseModel):
    """Add two small numbers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)
    unit: Literal["m", "km"] = "m"


@pytest.mark.slow
def test_bind_tools_any_gives_calls_whose_args_validate(live):
    parameters = convert_to_openai_tool(Add)["function"]["parameters"]
    assert "additionalProperties" not in parameters  # the shape of the bug
    closed = {**parameters, "additionalProperties": False}
    key = live.create_tenant("acme")["api_key"]
    chat = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{live.base_url}/v1",
        api_key=key,
        max_tokens=200,
        temperature=1.0,
        seed=3,
        max_retries=0,
    )
    bound = chat.bind_tools([Add], tool_choice="any")
    message = bound.invoke("Add 2 and 3.")
    assert message.tool_calls and not message.invalid_tool_calls, message
    assert message.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in bound.stream("Add 4 and 5."):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and not streamed.invalid_tool_calls, streamed
    for call in [*message.tool_calls, *streamed.tool_calls]:
        assert call["name"] == "Add" and call["id"].startswith("call_")
        jsonschema.validate(call["args"], closed)
