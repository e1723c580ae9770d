"""vLLM's tokenizer endpoints and ``GET /version`` (docs/api.md)."""

from loraplex.gateway.domains.tokenize.controller import detokenize, tokenize, version

ROUTES = [tokenize, detokenize, version]
