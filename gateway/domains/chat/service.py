"""One chat request against the engine: model resolution, the run itself, and its usage row.

Life of an admitted request (the controller drives it)::

    admit (429: no usage row)
      -> UsageLedger            from here on exactly one usage row and one ticket release
      -> parse, resolve model, process messages, check lengths     (4xx: row "error", 0 tokens)
      -> ChatRun: a task in deps.in_flight pumps engine outputs into a queue
           finished "stop"/"length"       -> row "ok"
           engine refusal / death / abort -> row "error" (refusal: 0 tokens)
           a fault in its part of a step  -> row "error" ("internal_error"); 500, or an
                                             error event mid-stream; others run on
           cancelled (client gone, shutdown) -> engine request aborted, row "aborted",
                                                the tokens generated so far
           a stream finished "ok" whose client is cut before its last write (the write
           deadline, eviction, a disconnect)  -> row "aborted", every token (``deliver``)

The run lives in its own task so that the HTTP side (JSON or SSE) only reads a queue: a client
that disconnects cancels the run, which closes the engine's stream, which aborts the engine
request (its KV blocks are freed at the next step boundary); graceful shutdown waits for the
same tasks.

The usage row is submitted when the run ends (``UsageLedger.close``) and becomes durable a
moment later (the usage spool's group commit); the HTTP side awaits :meth:`ChatRun.durable`
before it sends the response's last bytes, so a client never holds a whole answer whose row a
crash could lose. A stream served by ``LimitedHttpProtocol`` is ``ok`` only once its last
write goes out (:meth:`ChatRun.delivered`): one whose client stopped reading and was cut is
``aborted``. The key's concurrency slot is held until the response is written or cut
(``Ticket.hold``, released by the connection), not only until the engine finishes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.engine.client.quarantine import QueryOfDeathError, TenantThrottledError
from loraplex.engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.engine.structured_output.grammar import StructuredOutputError
from loraplex.gateway.domains.adapters.upload import NAME_RE
from loraplex.gateway.domains.chat.batch import fan_in
from loraplex.gateway.errors import APIError, not_found, rate_limited
from loraplex.gateway.limits.admission import AdmissionControl
from loraplex.gateway.limits.ratelimit import Limiter, RateLimitExceeded
from loraplex.gateway.metrics.registry import GatewayMetrics
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.services.adapters import find_adapter
from loraplex.gateway.services.tenants import TenantLimits
from loraplex.gateway.usage.ledger import UsageLedger
from loraplex.gateway.usage.writer import UsageWriter

if TYPE_CHECKING:
    from loraplex.gateway.auth.principals import TenantPrincipal
    from loraplex.gateway.limits.ratelimit import Ticket

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatDeps:
    """What a generation request works with: the ``chat_deps`` dependency.

    One dependency made per request from the app's services (``gateway.server.app``), rather
    than one parameter each: Litestar resolves a handler's sibling dependencies in a task
    group, a task each, which cost the chat route about 0.2 ms of CPU per request.

    Attributes:
        config: Gateway settings.
        engine: The engine.
        sessions: Async session factory (adapter names).
        limiter: Per-key rate limits.
        admission: Global bounds on outstanding requests and tokens.
        usage: The usage writer.
        metrics: Prometheus counters and latency histograms.
        default_limits: The server-wide limits of tenants that set none.
        in_flight: The runs now going (graceful shutdown waits for them).
        draining: The server is shutting down (new requests get 503).
    """

    config: GatewayConfig
    engine: EngineClient
    sessions: async_sessionmaker
    limiter: Limiter
    admission: AdmissionControl
    usage: UsageWriter
    metrics: GatewayMetrics
    default_limits: TenantLimits
    in_flight: set[asyncio.Task]
    draining: bool = False


MODEL_NOT_FOUND = "model_not_found"
_MAX_ADAPTER_NAME = 64


async def resolve_model(deps: ChatDeps, tenant_id: str, model: str) -> str | None:
    """The adapter digest ``model`` names for this tenant; None for the base model.

    A name that no adapter may have (``NAME_RE``: NUL or other control characters, too long)
    gets the same 404 without a database lookup.

    Raises:
        APIError: 404 ``model_not_found`` for an unknown name or another tenant's adapter
            (the same answer, so a name's existence never leaks across tenants).
    """
    if model == deps.engine.model_name:
        return None
    row = None
    if NAME_RE.fullmatch(model):
        async with deps.sessions() as session:
            row = await find_adapter(session, tenant_id, model)
    if row is None:
        raise not_found(
            f"the model {model[:_MAX_ADAPTER_NAME]!r} does not exist: use "
            f"{deps.engine.model_name!r} or the name of one of your adapters",
            code=MODEL_NOT_FOUND,
            param="model",
        )
    return row.digest


async def admit_rate(deps: ChatDeps, principal: TenantPrincipal) -> Ticket:
    """The key's rate-limit admission for one request.

    Raises:
        APIError: 429 with ``Retry-After`` past a limit (counted in
            ``loraplex_rate_limited_requests``).
    """
    limits = principal.limits.or_defaults(deps.default_limits)
    try:
        return await deps.limiter.acquire(principal.key_id, limits)
    except RateLimitExceeded as exc:
        deps.metrics.rate_limited.labels(principal.tenant_id, exc.limit).inc()
        raise rate_limited(
            f"rate limit exceeded: {exc.limit} of this key; retry after "
            f"{max(1.0, exc.retry_after):.0f} s",
            exc.retry_after,
        ) from None


class _Cancelled(Exception):
    """The run was cancelled (client gone or shutdown); nothing more will come."""


class ChatRun:
    """An engine request running in its own task, its outputs readable with :meth:`next`.

    One reader at a time (the HTTP side of the request) calls :meth:`next` / :meth:`next_nowait`.

    Args:
        deps: The gateway (the task joins ``deps.in_flight``).
        request: The engine request.
        ledger: Its usage; the run closes it when it ends, whatever the way.
        structured_param: The body field that asked for structured output: a spec the engine
            refuses is a 400 naming it.
        batch: A Completions batch: one engine request per prompt (``request`` is the first),
            run side by side and read as one request with their choices renumbered
            (``gateway.domains.chat.batch.fan_in``); None: ``request`` alone.
        deliver: When the engine finishes the request ``ok``, the usage row waits for
            :meth:`delivered` (the HTTP side is about to hand its last bytes over) or for
            :meth:`cancel` (the client was cut first: ``aborted``). Admission control's share
            is freed when the engine finishes all the same. A reader that never calls either
            must not use it; the chat controller passes it for streams whose connection
            reports its end (``Exchange.on_written``), which calls :meth:`cancel`.
    """

    def __init__(
        self,
        deps: ChatDeps,
        request: EngineRequest,
        ledger: UsageLedger,
        structured_param: str = "",
        deliver: bool = False,
        batch: list[EngineRequest] | None = None,
    ) -> None:
        self.deps = deps
        self.request = request
        self.requests = batch or [request]
        self.structured_param = structured_param
        self.ledger = ledger
        self.deliver = deliver
        self.cancel_reason = "shutdown"  # what a cancel from outside (app shutdown) means
        self.client_left = False
        self._delivery: tuple[str, str | None] | None = None  # finished, awaiting delivered()
        self._left_reason: Callable[[], str | None] = _no_reason
        self._outputs: deque[Any] = deque()  # outputs (or a failure) not read yet
        self._reader: asyncio.Future[None] | None = None  # set while next() waits
        self._watcher: asyncio.Future[None] | None = None
        self.task = asyncio.create_task(self._pump(), name=f"loraplex-{request.request_id}")
        deps.in_flight.add(self.task)
        self.task.add_done_callback(self._done)

    @property
    def choices(self) -> int:
        """The request's choices: ``n`` of each prompt, summed."""
        return sum(r.sampling.n for r in self.requests)

    def watch_client(
        self,
        receive: Callable[[], Awaitable[dict[str, Any]]],
        reason: Callable[[], str | None] | None = None,
    ) -> None:
        """Cancel the run (usage: aborted, ``client_disconnected``) if the client disconnects.

        One watcher task for the whole run, ended with it: ``receive`` is the request's ASGI
        receive, whose body has been read, so only ``http.disconnect`` can still arrive.

        Args:
            receive: The request's ASGI receive.
            reason: Why the client is gone when the server cut it (``write_timeout``,
                ``evicted_stalled``: ``Exchange.cut_reason``), recorded as the row's
                ``error_type`` instead of ``client_disconnected``; None when it left itself.
        """
        if reason is not None:
            self._left_reason = reason
        if self._watcher is None and not self.task.done():
            self._watcher = asyncio.ensure_future(self._watch(receive))

    def client_gone(self) -> None:
        """The client is gone (the connection was cut or closed): cancel with its reason."""
        self.client_left = True
        self.cancel(self._left_reason() or "client_disconnected")

    async def _watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server cannot tell us any more: nothing left to watch
            logger.debug("watching the client of %s failed", self.request.request_id, exc_info=True)
            return
        self.client_gone()

    async def next(self) -> RequestOutput:
        """The next engine output; the last one has ``finished`` set.

        Raises:
            APIError: the engine refused the request (400), is not running or aborted it
                (503), or the run was cancelled (503).
        """
        while not self._outputs:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self._check(self._outputs.popleft())

    def next_nowait(self) -> RequestOutput | None:
        """The next output if the engine already produced it, else None (see :meth:`next`).

        Raises:
            APIError: as :meth:`next`.
        """
        if not self._outputs:
            return None
        return self._check(self._outputs.popleft())

    def _put(self, item: Any) -> None:
        """Hand an output (or a failure) to the reader; wakes a waiting :meth:`next`."""
        self._outputs.append(item)
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    @staticmethod
    def _check(item: Any) -> RequestOutput:
        if isinstance(item, _Cancelled):
            raise APIError(503, "the request was aborted", code="request_aborted")
        if isinstance(item, BaseException):
            raise item
        if item.finished and item.error is not None:
            raise APIError(500, "an internal error ended this request", code="internal_error")
        if item.finished and any(o.finish_reason == "abort" for o in item.outputs):
            raise APIError(503, "the engine aborted the request", code="request_aborted")
        return item

    async def final(self) -> RequestOutput:
        """Wait for the finished request: its ``DELTA`` outputs added up (see :meth:`next`)."""
        total: RequestOutput | None = None
        while True:
            out = await self.next()
            if total is None:
                total = out
            else:
                total.add(out)
            if out.finished:
                return total

    async def durable(self, strict: bool = True) -> None:
        """Wait until the run has ended and its usage row is durable.

        Args:
            strict: See :meth:`UsageLedger.wait_durable`.

        Raises:
            APIError: 503 ``usage_unavailable`` (``strict`` only).
        """
        if not self.ledger.closed:
            await asyncio.wait((self.task,))
        await self.ledger.wait_durable(strict)

    def cancel(self, reason: str) -> None:
        """Stop the run (the engine request is aborted); its usage row says ``aborted``.

        Also for a run the engine finished that awaits :meth:`delivered`: the client did not
        get its last bytes.
        """
        if self.ledger.closed:
            return
        if not self.task.done():
            self.cancel_reason = reason
            self.task.cancel()
        elif self._delivery is not None:
            self._delivery = None
            self.ledger.close("aborted", reason)

    def delivered(self) -> None:
        """The last bytes of the answer go out now: record the finished run (``deliver``).

        Does nothing when the run was not deferred, or already recorded.
        """
        delivery, self._delivery = self._delivery, None
        if delivery is not None:
            self.ledger.close(*delivery)

    async def _pump(self) -> None:
        ledger = self.ledger
        status, error_type = "error", "internal_error"
        requests = self.requests
        if len(requests) == 1:
            outputs = self.deps.engine.generate(self.request)
        else:
            outputs = fan_in(self.deps.engine.generate, requests, ledger.usage_id)
        try:
            async for out in outputs:
                ledger.observe(out)
                if out.finished:  # recorded before anyone can see it: a late cancel is moot
                    status, error_type = _final_status(out)
                    if self.deliver and status == "ok":  # unless the answer is not delivered
                        self._delivery = (status, error_type)
                        ledger.release_admission()
                    else:
                        ledger.close(status, error_type)
                self._put(out)
        except asyncio.CancelledError:
            self._delivery = None  # cancelled before delivery: aborted
            status, error_type = "aborted", self.cancel_reason
            self._put(_Cancelled())
            raise
        except EngineDeadError:  # the engine (core process) died under it: not the client's
            status, error_type = "aborted", "engine_unavailable"
            self._put(APIError(503, "the engine is not running", code="engine_unavailable"))
        except EngineOverloadedError as exc:  # the grammar sandbox had no time: retry
            ledger.forget_outputs()
            status, error_type = "aborted", "overloaded"
            self._put(APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"}))
        except RequestFailedError:  # a fault admitting it; logged by the engine
            self._put(APIError(500, "an internal error ended this request", code="internal_error"))
        except (
            QueryOfDeathError
        ) as exc:  # in flight at repeated core deaths (engine.client.quarantine)
            ledger.forget_outputs()
            error_type = "request_quarantined"
            self._put(APIError(400, str(exc), code="request_quarantined"))
        except TenantThrottledError as exc:
            ledger.forget_outputs()
            error_type = "too_many_engine_faults"
            seconds = str(max(1, math.ceil(exc.retry_after)))
            self._put(
                APIError(
                    429, str(exc), code="too_many_engine_faults", headers={"Retry-After": seconds}
                )
            )
        except ValueError as exc:  # refused at admission: nothing ran, nothing to count
            if not (len(requests) > 1 and ledger.observed):  # a batch: what the others made
                ledger.forget_outputs()
            error_type = "invalid_request_error"
            param = None
            if isinstance(exc, StructuredOutputError):  # a schema the engine cannot enforce
                param = self.structured_param or None
            elif str(exc).split(" ", 1)[0] in _ENGINE_CHECKED:  # ids outside the vocabulary
                param = str(exc).split(" ", 1)[0]
            self._put(APIError(400, str(exc), param=param))
        except Exception:
            logger.exception("chat request %s failed", self.request.request_id)
            self._put(APIError(500, "internal server error"))
        finally:
            if self._delivery is None:
                ledger.close(status, error_type)

    def _done(self, task: asyncio.Task) -> None:
        """Leave ``in_flight``; a task cancelled before it ever ran still closes its ledger."""
        self.deps.in_flight.discard(task)
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # dropped: its CancelledError's traceback holds our frame
            watcher.cancel()
        if not self.ledger.closed and self._delivery is None:
            self._put(_Cancelled())
            self.ledger.close("aborted", self.cancel_reason)


def _no_reason() -> str | None:
    return None


_ENGINE_CHECKED = ("logit_bias", "stop_token_ids", "prompt")  # fields only the engine can check


def _final_status(out: RequestOutput) -> tuple[str, str | None]:
    """``("ok", None)`` unless a choice was aborted by the engine (e.g. its adapter failed)."""
    if out.error is not None:
        return "error", "internal_error"
    if any(o.finish_reason == "abort" for o in out.outputs):
        return "error", "engine_abort"
    return "ok", None
