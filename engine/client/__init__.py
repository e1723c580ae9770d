"""The engine's client side: one front over one core-client interface (docs/architecture.md).

vLLM v1's ``AsyncLLM`` over ``EngineCoreClient``, at loraplex's size:

- :mod:`.front`: :class:`~.front.AsyncLLM`, the only place with a tokenizer, an input
  processor and its :class:`~.fair_pool.FairWorkerPool`, an output processor
  (:mod:`.output_processor`, :mod:`.detokenizer`, :mod:`.stop`) and the per-request streams
  (``LLM`` in ``engine.client.llm`` is the synchronous loop over the same output processor);
- :mod:`.core_client`: :class:`~.core_client.EngineCoreClient`, transport and liveness only,
  token ids in and :class:`~engine.scheduling.output.EngineCoreOutput` out, with three kinds:
  :mod:`.inproc` (the core on a thread of this process), :mod:`.process` (a child process or a
  Ray actor over ZMQ, restarted when it dies) and :mod:`.replicas` (a router over N of them,
  itself a core client).

Nothing here is imported by ``engine.core.engine_core``: the core never detokenizes.
"""
