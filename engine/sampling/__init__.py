"""Sampling: per-request params, the batched sampler, logprobs, detokenization and stops.

Public API::

    SamplingParams(n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                   seed=None, stop=(), stop_token_ids=(), ignore_eos=False,
                   include_stop_str_in_output=False, logprobs=None, skip_special_tokens=True)
    Sampler(generator=None)(logits [N, V], params [N], generators [N] | None,
                            default_generator=None) -> SamplerOutput
    make_generator(seed, device) -> torch.Generator
    IncrementalDetokenizer(tokenizer, params, eos_token_ids=..., prompt_token_ids=None)
        .append(token_id) -> str; .finish(reason) -> str; .text, .finish_reason, .stop_reason
    StopChecker(stop, include_stop_str_in_output).append(delta) -> str
    TokenBytes(tokenizer)(token_ids) -> each token's exact UTF-8 bytes (OpenAI logprobs)
"""

from loraplex.engine.sampling.detokenizer import IncrementalDetokenizer, TextStream
from loraplex.engine.sampling.logprobs import TokenBytes, TopLogprobs, gather_logprobs
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    exponential_race,
    filter_probs,
    make_generator,
)
from loraplex.engine.sampling.stop import StopChecker

__all__ = [
    "IncrementalDetokenizer",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "StopChecker",
    "TextStream",
    "TokenBytes",
    "TopLogprobs",
    "exponential_race",
    "filter_probs",
    "gather_logprobs",
    "make_generator",
]
