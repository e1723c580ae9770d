"""The generation domain of the HTTP API (docs/api.md).

``POST /v1/chat/completions`` and ``POST /v1/completions``.
"""

from loraplex.gateway.domains.chat.controller import chat_completions, completions

ROUTES = [chat_completions, completions]
