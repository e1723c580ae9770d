"""The Responses API of the HTTP API (docs/api.md, *Responses API*).

``POST /v1/responses``, ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``, over
the chat domain's generation path.
"""

from loraplex.gateway.domains.responses.controller import (
    create_response,
    delete_response,
    retrieve_response,
)

ROUTES = [create_response, retrieve_response, delete_response]
