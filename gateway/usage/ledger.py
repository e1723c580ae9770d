"""One request's usage, from admission to its row: counts, latencies, the ticket's release.

A request that passed the rate limiter (``/v1/chat/completions``, ``/v1/completions``,
``/tokenize``, ``/detokenize``) gets a :class:`UsageLedger`; from then on it writes exactly one
usage row (:mod:`.writer`) and releases its rate-limit ticket and admission share once, whatever
happens to the request (the life of a chat request: ``gateway.domains.chat.service``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.request import RequestOutput
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.errors import APIError
from loraplex.gateway.metrics.latency import ModelSeries, TokenClock
from loraplex.gateway.metrics.registry import GatewayMetrics
from loraplex.gateway.usage.records import UsageRecord
from loraplex.gateway.usage.writer import UsageWriter

if TYPE_CHECKING:
    from loraplex.gateway.auth.principals import TenantPrincipal
    from loraplex.gateway.limits.admission import AdmissionTicket
    from loraplex.gateway.limits.ratelimit import Ticket

logger = logging.getLogger(__name__)

_MAX_MODEL_COLUMN = 256


class LedgerDeps(Protocol):
    """What a ledger writes to."""

    usage: UsageWriter
    metrics: GatewayMetrics


class UsageLedger:
    """What one admitted request used; writes its usage row and frees its ticket, once.

    Args:
        deps: The usage writer and metrics (``ChatDeps`` in ``gateway.domains.chat``).
        principal: The caller.
        ticket: The rate limiter's admission, released with the tokens used.
        usage_id: The usage row's key: the server's id of this request (its response id),
            unique per executed request.
        client_request_id: The client's ``X-Request-Id`` (recorded, never a key).
        batch_id: The batch this request is a line of (``/v1/batches``), recorded in the row.

    Attributes:
        durable: Completes once the row is durable (None until :meth:`close`, or when the row
            could not be queued).
        series: The latency histograms of the request's model (:meth:`measure`); None until
            the model is resolved, and then no latency is recorded.
    """

    def __init__(
        self,
        deps: LedgerDeps,
        principal: TenantPrincipal,
        ticket: Ticket,
        usage_id: str,
        client_request_id: str | None = None,
        batch_id: str | None = None,
    ) -> None:
        self.deps = deps
        self.principal = principal
        self.ticket = ticket
        self.usage_id = usage_id
        self.client_request_id = client_request_id
        self.batch_id = batch_id
        self.durable: asyncio.Future[None] | None = None
        self.started = time.perf_counter()
        self.model = "(invalid request)"  # replaced as soon as the body names a model
        self.adapter_digest: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.images = 0
        self.ttft: float | None = None
        self._tokens: dict[int, int] = {}  # choice index -> tokens generated
        self._observed = False
        self.queue_time: float | None = None
        self.series: ModelSeries | None = None
        self._clock: TokenClock | None = None
        self.closed = False
        self.admission: AdmissionTicket | None = None  # released with the ticket

    def measure(self, series: ModelSeries) -> None:
        """Record this request's latencies in ``series`` (its model's; see :meth:`observe`)."""
        self.series = series
        self._clock = TokenClock(series.itl)

    def observe(self, out: RequestOutput) -> None:
        """Take a ``DELTA`` output's counts (each choice's ``num_tokens`` is its running total).

        Called as each output reaches the gateway: its new tokens' inter-token latency is
        observed now.
        """
        if self._clock is not None:
            self._clock.output(out, time.perf_counter())
        self._observed = True
        if out.queue_time is not None:
            self.queue_time = out.queue_time
        self.prompt_tokens = len(out.prompt_token_ids)
        for o in out.outputs:
            self._tokens[o.index] = o.num_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.ttft is not None and self.ttft is None:
            self.ttft = out.ttft

    @property
    def observed(self) -> bool:
        """Some engine output was taken (:meth:`observe`) since the last :meth:`forget_outputs`."""
        return self._observed

    def forget_outputs(self) -> None:
        """Nothing ran (the engine refused the request): nothing to count."""
        self._observed = False
        self._tokens.clear()
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def release_admission(self) -> None:
        """The engine is done with the request: its share of admission control is free."""
        admission, self.admission = self.admission, None
        if admission is not None:
            admission.release()

    def _take_counts(self) -> None:
        if self._observed:
            self.completion_tokens = sum(self._tokens.values())

    def close(self, status: str, error_type: str | None = None) -> None:
        """Record the request (``ok``, ``error`` or ``aborted``); later calls do nothing.

        Never raises: a usage row that cannot be queued is logged, never the request's failure.
        """
        if self.closed:
            return
        self.closed = True
        self._take_counts()
        tenant = self.principal.tenant_id
        latency = time.perf_counter() - self.started
        try:
            self.durable = self.deps.usage.submit(
                UsageRecord(
                    request_id=self.usage_id,
                    tenant_id=tenant,
                    model=self.model[:_MAX_MODEL_COLUMN],
                    key_id=self.principal.key_id,
                    adapter_digest=self.adapter_digest,
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=self.completion_tokens,
                    cached_tokens=self.cached_tokens,
                    images=self.images,
                    status=status,
                    error_type=error_type if status != "ok" else None,
                    ttft_ms=None if self.ttft is None else self.ttft * 1000.0,
                    latency_ms=latency * 1000.0,
                    created_at=utcnow(),
                    client_request_id=self.client_request_id,
                    batch_id=self.batch_id,
                )
            )
            self.deps.metrics.record_request(
                tenant,
                status,
                self.prompt_tokens,
                self.completion_tokens,
                self.cached_tokens,
            )
            if self.series is not None:
                self.series.finished(status == "ok", self.ttft, latency, self.queue_time)
        except Exception:  # a bug in a record; the request itself is not at fault
            logger.exception("could not record usage of %s", self.usage_id)
        finally:
            self.ticket.release(self.prompt_tokens + self.completion_tokens)
            self.release_admission()

    async def wait_durable(self, strict: bool = True) -> None:
        """Return once the row is durable (at once if it was never queued).

        Args:
            strict: Raise when the row could not be made durable; False: return anyway (for
                an error answer, which gives the client nothing it could be billed for).

        Raises:
            APIError: 503 ``usage_unavailable`` + ``Retry-After`` (``strict`` only) when
                neither the spool nor the database could take the row (it stays queued for
                the database).
        """
        if self.durable is None:
            return
        try:
            await self.durable
        except APIError:
            if strict:
                raise
