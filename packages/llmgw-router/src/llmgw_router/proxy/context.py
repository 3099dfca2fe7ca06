"""What the stages of the request path pass along: the request's context, where its
answer goes, and what its one exit counts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from llmgw_router.config import ApiKey, Deadlines
from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.tokens import PromptBlocks

if TYPE_CHECKING:
    from llmgw_router.upstream import Response

__all__ = [
    "Headers",
    "Incoming",
    "Outcome",
    "Reply",
    "RequestContext",
    "UpstreamFailure",
    "respond",
]

# Lower-case names; the first of repeated headers.
Headers = dict[bytes, bytes]

_JSON = [(b"content-type", b"application/json")]


class Reply(Protocol):
    """Where one request's answer goes: a head, then body pieces until the last.

    ``gone`` is set (and ``task`` cancelled) when the client goes away first.
    """

    gone: bool
    task: asyncio.Task[Any] | None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, more: bool = False) -> None: ...


class Incoming(Reply, Protocol):
    """A request the router's own HTTP server has read whole (protocol.py)."""

    method: str
    path: str
    # Lower-case names; the first of repeated headers.
    headers: Headers
    content: bytes
    # The body went over max_body_bytes (and was not kept): answer 413.
    too_large: bool
    declared_length: int | None
    # Judged on the head, before any body byte was read (:meth:`ProxyApp.admit`): the
    # caller's key, or the error that answers the request (401, 404, 405).
    api_key: ApiKey | None
    refusal: ApiError | None


@dataclass(slots=True)
class RequestContext:
    """One proxied request, from its parsed head to its outcome."""

    path: str
    body: bytes
    # The request headers an engine gets.
    headers: list[tuple[bytes, bytes]]
    model: str
    candidates: tuple[Endpoint, ...]
    deadlines: Deadlines
    # On the router's one clock (state.now).
    started: float
    deadline: float
    # session_affinity's key: the affinity header, else the body's `user`.
    affinity_key: str | None = None
    # cache_aware's prompt prefix blocks, and with precise matching its token blocks.
    prefix: tuple[int, ...] = ()
    tokens: PromptBlocks | None = None
    tried: list[Endpoint] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)
    # The balancer's last pick: why, and (cache_aware) the prefix blocks the endpoint is
    # predicted to prefill.
    pick_reason: str = ""
    pick_miss: int = 0
    retries: int = 0
    # When the answer's first byte went to the client (the router's clock; 0: not yet).
    first_byte_at: float = 0.0
    # The outcome, counted once when the request ends.
    status: int = 0
    endpoint: str = ""
    # Tenants: the admission ticket (tenants.gate.Ticket) and the engine's usage
    # (prompt, completion tokens) once the relay read it.
    tenant: Any = None
    usage: tuple[int, int] | None = None
    # The engine's method (GET/DELETE of a stored response), and what the engine's
    # response passes through on its way to the client (routes.py: response ids).
    method: str = "POST"
    wrap: Callable[[Response, Endpoint], Response] | None = None
    # The body as SGLang engines get it (llmgw_router.lora), once per body: the body it
    # was made from, and it (retries and a disaggregated decode reuse it).
    sglang_body: tuple[bytes, bytes] | None = None


class Outcome:
    """What the one exit counts: set by whichever stage answered."""

    __slots__ = ("ctx", "error_model", "error_status")

    def __init__(self) -> None:
        self.ctx: RequestContext | None = None
        self.error_status = 0
        # The model of an error answered before a context existed (ApiError.model).
        self.error_model = ""


class UpstreamFailure(Exception):
    """An attempt that failed before any byte went to the client: it may be retried."""

    def __init__(
        self,
        reason: str,
        detail: str,
        response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        # For 5xx/429: the engine's own answer, passed on when no retry is left.
        self.response = response


async def respond(
    reply: Reply, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON answer."""
    await reply.start(status, [*_JSON, (b"content-length", b"%d" % len(body)), *(headers or [])])
    await reply.body(body)
