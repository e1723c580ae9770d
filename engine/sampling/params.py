"""Per-request sampling parameters, with vLLM / OpenAI semantics.

A :class:`SamplingParams` is frozen and validated on construction, so a request that reaches the
scheduler can never carry a value the sampler or the detokenizer would choke on. Values known only
at run time (a child's seed for ``n > 1``) make a new object with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.engine.structured_output.grammar import StructuredOutputSpec

MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # the detokenizer holds back and searches this much text per step
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence / frequency penalties
MAX_REPETITION_PENALTY = 100.0
MAX_TOKEN_ID = 2**63  # exclusive: ids travel as int64 (the core's wire, tensors)
MAX_TOP_K = 2**31 - 1  # any k >= the vocabulary keeps every token; bounded so it fits int64
SEED_RANGE = (-(2**63), 2**64 - 1)  # reduced modulo 2**64 by ``make_generator``
_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy, as vLLM does


def _as_tuple(name: str, value: object, kind: type) -> tuple:
    """Normalize a str / int / iterable / None field to a tuple of ``kind``."""
    if value is None:
        return ()
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {value!r}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ValueError(f"{name} must contain only {kind.__name__} values, got {item!r}")
    return items


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions (vLLM / OpenAI semantics).

    Attributes:
        n: Completions to generate for the prompt (>= 1).
        max_tokens: Most tokens to generate per completion (>= 0); hitting it finishes the
            completion with ``finish_reason="length"``. 0 runs the prefill only (the prompt's
            KV and, with ``prompt_logprobs``, its logprobs): every completion finishes with
            ``"length"`` and no token, as vLLM's server answers ``echo`` with
            ``max_tokens: 0``.
        temperature: Softmax temperature in ``[0, 100]``; 0 (or below 1e-5) means greedy.
        top_p: Nucleus sampling (Holtzman et al. 2019): keep the smallest set of most likely
            tokens whose probability sums to at least ``top_p``; in ``(0, 1]``, 1 disables it.
        top_k: Keep the ``top_k`` most likely tokens (ties at the k-th value are kept); 0 or -1
            disables it; in ``[-1, 2**31 - 1]`` (a ``k`` at or above the vocabulary size keeps
            every token).
        min_p: Drop tokens whose probability is below ``min_p`` times the top token's
            (Nguyen et al. 2024); in ``[0, 1]``, 0 disables it.
        seed: Per-request seed: the same seed gives the same tokens whatever the batch.
            None draws from the engine's shared generator. In ``[-2**63, 2**64 - 1]``.
        stop: Stop strings (a single str is accepted; at most 16, each 1 to 1024 characters).
            The first one to appear in the output ends it with ``finish_reason="stop"``; the
            text is cut before it unless ``include_stop_str_in_output``.
        stop_token_ids: Token ids that end the completion like EOS does.
        ignore_eos: Keep generating after the model's EOS token.
        include_stop_str_in_output: Keep the matched stop string (or the stop token's text) in
            the output text.
        logprobs: None for no logprobs; otherwise return the sampled token's logprob plus this
            many top alternatives (``0..20``; 0 means only the sampled token's).
        prompt_logprobs: None for none; otherwise the logprob of every prompt token after
            the first (the first has none) plus this many top alternatives at each position
            (``0..20``), vLLM's ``prompt_logprobs``. Computed in the prefill, per chunk; a
            request that asks for them takes no prefix-cache hits (docs/engine.md, *Prompt
            logprobs*).
        skip_special_tokens: Drop special tokens from the output text.
        presence_penalty: OpenAI's: subtracted once from the logit of every token that already
            appears in the output; in ``[-2, 2]``.
        frequency_penalty: OpenAI's: subtracted from a token's logit once per time it appears
            in the output; in ``[-2, 2]``.
        repetition_penalty: vLLM's / HF's (Keskar et al. 2019, CTRL): the logit of every token
            in the prompt or the output is divided by it when positive, multiplied when
            negative; in ``(0, 100]``, 1 disables it.
        logit_bias: OpenAI's: token id -> value in ``[-100, 100]`` added to its logit before
            anything else; at most 300 entries (ids are checked against the vocabulary by the
            engine).
        min_tokens: Until this many tokens are generated, EOS and ``stop_token_ids`` cannot
            be sampled and stop strings are not looked for (vLLM's); ``0 <= min_tokens <=
            max_tokens``.
        structured_output: Constrain the output to a JSON schema, any JSON object, a regex or
            a grammar (``engine.structured_output.grammar``); None for free text.

    Raises:
        ValueError: A field is out of range; the message names the field.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        # Normalize list / str inputs before validating (frozen: go through object.__setattr__).
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int)
        )
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        """Check every field's range.

        Raises:
            ValueError: A field is out of range; the message starts with the field's name.
        """
        _check_int("n", self.n, lo=1)
        _check_int("max_tokens", self.max_tokens, lo=0)
        _check_float("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}"
            )
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=-1, hi=MAX_TOP_K)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=SEED_RANGE[0], hi=SEED_RANGE[1])
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutputSpec
        ):
            raise ValueError("structured_output must be a StructuredOutputSpec")
        if any(not 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, 2**63), got {_ids(self)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}"
            )
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """True when penalties, ``logit_bias`` or ``min_tokens`` touch the logits."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0 or below 1e-5)."""
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when ``top_k`` restricts the candidates (not 0 or -1)."""
        return self.top_k > 0


def _logit_bias(value: object) -> dict[int, float]:
    """``logit_bias`` as ``{int id: float}``, range-checked.

    Keys may be decimal strings, as JSON object keys are.
    """
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < MAX_TOKEN_ID:
            shown = f"a {type(key).__name__}"
            if isinstance(key, str):
                shown = repr(key[:32])  # a JSON key may be megabytes long
            elif isinstance(key, int) and not isinstance(key, bool):
                shown = str(key) if key.bit_length() <= 128 else "a huge integer"
            raise ValueError(
                f"logit_bias keys must be token ids (integers in [0, 2**63)), got {shown}"
            )
        _check_float("logit_bias", bias)
        if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        out[key] = float(bias)
    return out


def _ids(params: SamplingParams) -> str:
    """``stop_token_ids`` for an error message, never thousands of digits long."""
    text = ", ".join(str(t) if t.bit_length() <= 128 else "(huge)" for t in params.stop_token_ids)
    return f"[{text}]"


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
