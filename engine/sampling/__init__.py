"""Sampling: per-request params, the batched sampler and logprobs (the core's side).

Detokenization and stop strings are the client's (``engine.client.detokenizer``,
``engine.client.stop``): the core never calls them.

Public API::

    SamplingParams(n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                   seed=None, stop=(), stop_token_ids=(), ignore_eos=False,
                   include_stop_str_in_output=False, logprobs=None, skip_special_tokens=True)
    Sampler(generator=None)(logits [N, V], params [N], generators [N] | None,
                            default_generator=None) -> SamplerOutput
    make_generator(seed, device) -> torch.Generator
    TokenBytes(tokenizer)(token_ids) -> each token's exact UTF-8 bytes (OpenAI logprobs)
"""

from loraplex.engine.sampling.logprobs import TokenBytes, TopLogprobs, gather_logprobs
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    exponential_race,
    filter_probs,
    make_generator,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "TokenBytes",
    "TopLogprobs",
    "exponential_race",
    "filter_probs",
    "gather_logprobs",
    "make_generator",
]
