"""The chat domain of the HTTP API (CONTRACT.md): ``POST /v1/chat/completions``."""

from loraplex.gateway.domains.chat.controller import chat_completions

ROUTES = [chat_completions]
