"""The typed messages between an engine core process and its client (msgspec over ZMQ).

The client (the gateway's process) sends messages of :data:`ClientMessage` on one ZMQ PUSH
socket; the core answers with :data:`CoreMessage` on another. Both are msgspec tagged unions
encoded as MessagePack: the engine's own dataclasses (``EngineRequest``, ``SamplingParams``,
``EngineCoreOutput``) travel as they are, checked against their annotations when decoded, and
tensors (image pixel values and inputs) travel as raw bytes with dtype and shape, never pickled.
What vLLM v1 sends between ``EngineCoreClient`` and ``EngineCoreProc``, at our size.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from loraplex.adapters.limits import AdapterLimits
from loraplex.engine.kv_cache.events import KVEvent
from loraplex.engine.request import EngineRequest
from loraplex.engine.scheduling.output import EngineCoreOutput

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
}  # pixel values; an image's integer inputs (sizes, grids) and masks


# ------------------------------------------------------------------------- client -> core
class AddRequest(msgspec.Struct, tag=True):
    """Validate and queue a request; a refusal comes back as :class:`Rejected`.

    ``seq``: the client's count of requests sent, so that :class:`Outputs` can say which the
    core had taken (``taken``) in the core's own terms, whenever the client reads them.
    """

    request: EngineRequest
    seq: int = 0


class Abort(msgspec.Struct, tag=True):
    """Abort a request (its sequences finish with ``"abort"``, their blocks are freed)."""

    request_id: str


class FinishRequest(msgspec.Struct, tag=True):
    """A stop string ended a request's output (``index``) or all of it (None)."""

    request_id: str
    reason: str
    stop_reason: int | str | None = None
    index: int | None = None


class Call(msgspec.Struct, tag=True):
    """A request/response call between steps: ``add_lora`` or ``remove_lora`` of a digest."""

    call_id: int
    method: str
    digest: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop the core's loop and exit."""


ClientMessage = AddRequest | Abort | FinishRequest | Call | Shutdown


# ------------------------------------------------------------------------- core -> client
class CoreInfo(msgspec.Struct):
    """What the client needs of the loaded model (sent once, when the core is ready).

    Attributes:
        max_model_len: Most tokens of one sequence.
        adapter_limits: What adapters must fit.
        image_token_id: The image placeholder token, None for a text-only model.
        num_image_tokens: Placeholder tokens per image.
        num_parameters: The model's parameter count.
        dtype: Its dtype name.
        device: Its device.
        kv_pool: One line describing the KV pool (``engine.kv_cache.sizing``).
        pid: The core process's id.
        vocab_size: Token ids the model takes are in ``[0, vocab_size)``.
        cpu_threads: torch's threads and the CPUs they are bound to, for people
            (``engine.core.engine_core.apply_cpu_threads``).
    """

    max_model_len: int
    adapter_limits: AdapterLimits
    image_token_id: int | None
    num_image_tokens: int
    num_parameters: int
    dtype: str
    device: str
    kv_pool: str
    pid: int
    vocab_size: int = 0
    cpu_threads: str = ""


class Ready(msgspec.Struct, tag=True):
    """The core loaded its model and runs."""

    info: CoreInfo


class Outputs(msgspec.Struct, tag=True):
    """A step's outputs, with the core's statistics after it.

    The statistics are numbers, and lists of counts (``spec_decode_num_accepted_tokens_per_pos``).
    ``events`` are the KV events since the last message (``engine.kv_cache.events``; empty unless
    the core records them). ``taken``: the highest :class:`AddRequest` ``seq`` the core had
    taken before this message (the suspects of a death are the requests it took since the
    third-latest message: ``engine.client.process``).
    """

    outputs: list[EngineCoreOutput]
    stats: dict[str, int | float | list[int]]
    events: list[KVEvent] = []
    taken: int = 0


class Rejected(msgspec.Struct, tag=True):
    """A request refused at admission (``kind``: ``"value"``, ``"structured"`` or ``"fault"``)."""

    request_id: str
    message: str
    kind: str = "value"


class CallResult(msgspec.Struct, tag=True):
    """The answer to a :class:`Call`: its value, or the error's message."""

    call_id: int
    value: bool | None = None
    error: str | None = None


class Heartbeat(msgspec.Struct, tag=True):
    """The core process is alive (sent every 0.1 s by a thread of its own).

    ``step_s``: how long the step now running has run, 0 between steps.
    """

    step_s: float = 0.0


CoreMessage = Ready | Outputs | Rejected | CallResult | Heartbeat


# --------------------------------------------------------------------------- encoding
def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"cannot send a {t.dtype} tensor")
        return (name, list(t.shape), t.view(torch.uint8).numpy().tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        name, shape, data = obj
        dtype = _DTYPES[name]
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


def encoder() -> msgspec.msgpack.Encoder:
    """An encoder for both directions (tensors as ``(dtype, shape, bytes)``)."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends.

    Raises (when called):
        msgspec.ValidationError: a message that does not match its type.
    """
    return msgspec.msgpack.Decoder(CoreMessage, dec_hook=_dec_hook)


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the client sends (requests are checked against their annotations)."""
    return msgspec.msgpack.Decoder(ClientMessage, dec_hook=_dec_hook)
