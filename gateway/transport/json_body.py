"""Request bodies as JSON, refused with a 400 whatever is malformed about them.

``msgspec`` raises ``DecodeError`` for most bad JSON, but a body nested deeper than the
decoder's recursion limit raises ``RecursionError``, and bytes that are not UTF-8 (including
CESU-8's encoded surrogates, ``ED A0 80``) raise ``UnicodeDecodeError``: uncaught, each was a
500. Every route that takes JSON decodes it here.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request

from loraplex.gateway.errors import bad_request

MAX_DEPTH_HINT = "nested too deeply"


def decode_json(body: bytes) -> Any:
    """Decode a request body.

    Raises:
        APIError: 400 ``invalid_json`` for anything that is not one valid UTF-8 JSON value
            (syntax, truncation, numbers out of range such as ``1e999``, invalid UTF-8 or
            surrogates, nesting beyond the decoder's limit).
    """
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        message = f"the body is not valid JSON: {exc}"
    except UnicodeDecodeError as exc:
        message = f"the body is not valid UTF-8 (byte {exc.start}): JSON must be UTF-8"
    except RecursionError:
        message = f"the body is not valid JSON: {MAX_DEPTH_HINT}"
    raise bad_request(message, code="invalid_json")


def decode_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Raises:
        APIError: 400 for malformed JSON (:func:`decode_json`) or a value that is not an object.
    """
    data = decode_json(body)
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body, which must be a JSON object (:func:`decode_object`).

    Raises:
        APIError: 400 for malformed JSON or a value that is not an object.
    """
    return decode_object(await request.body())
