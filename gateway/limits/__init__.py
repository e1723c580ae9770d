"""What the gateway refuses before a request reaches the engine, one module per limit.

* :mod:`.auth_throttle`: failed authentications per client address (429 before hashing a key).
* :mod:`.ratelimit`: per-key requests, tokens and concurrency in this process;
  :mod:`.ratelimit_shared` the same limits shared by several gateways through Redis.
* :mod:`.admission`: the server-wide bound on outstanding requests and tokens, each tenant's
  share of it.

The transport's own limits (head size, deadlines, connections) are :mod:`gateway.transport`.
docs/hardening.md lists every limit with its flag and answer.
"""
