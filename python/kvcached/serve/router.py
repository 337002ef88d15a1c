"""The OpenAI-compatible endpoint of ``kvcached serve``: one port, requests routed on ``model``.

Request and response bodies pass through unchanged (the body is parsed only to read ``model``);
streaming responses are passed on chunk by chunk. A model not configured is a 404 and a model whose
engine is not ready a 503 (with ``Retry-After``), both as OpenAI-style error JSON. A client that
goes away cancels its request: the connection to the engine is closed, and vLLM and SGLang abort a
request whose client disconnected. Each engine is reached through a connection pool of its own
(:mod:`kvcached.serve.upstreams`): one model's load never delays another's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Callable, Optional, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvcached.serve.metrics import ServeMetrics
from kvcached.serve.request_body import MAX_BODY_BYTES, BadBody, model_of, read_body
from kvcached.serve.sleep_manager import WakeRefused
from kvcached.serve.upstreams import DEFAULT_LIMITS, UpstreamLimits, Upstreams

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
ENDPOINTS = ("GET /v1/models", *(f"POST {path}" for path in ROUTED_PATHS), "GET /health", "GET /metrics")
RETRY_AFTER_S = 5
# Headers that belong to one connection, not to the request or response passed on.
_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    )
)
# The OpenAI error `type` of each status the router itself answers with.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
CLIENT_CLOSED_REQUEST = 499  # nginx's code for a client that went away; logged, never sent
ENGINE_BROKE_OFF = 502  # counted for a stream the engine ended early (the client already has a 200)


class Route(Protocol):
    """What the router needs of one model's engine."""

    @property
    def url(self) -> Optional[str]: ...  # the engine's base URL while it is ready, else None

    @property
    def state(self) -> Any: ...  # shown in 503 messages and /health


class Routes(Protocol):
    """Model name -> its engine; :class:`kvcached.serve.supervisor.Supervisor` is one."""

    def route(self, name: str) -> Optional[Route]: ...


def openai_error(status: int, message: str, error_type: str, code: str, param: Optional[str] = None) -> JSONResponse:
    """An error in the OpenAI API's shape (what vLLM and SGLang send too)."""
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _state_text(state: Any) -> str:
    return str(getattr(state, "value", state))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _passed_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


class Router:
    """The app's request handling, around one HTTP client per engine."""

    def __init__(
        self,
        routes: Routes,
        model_names: list[str],
        metrics: ServeMetrics,
        limits: UpstreamLimits = DEFAULT_LIMITS,
        max_body_bytes: int = MAX_BODY_BYTES,
        sleep: Any = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.sleep = sleep  # the SleepManager where models may sleep, else None
        self.routes = routes
        self.model_names = model_names
        self.metrics = metrics
        self.upstreams = Upstreams(model_names, limits)
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "kvcached"}
            for name in self.model_names
        ]
        return {"object": "list", "data": data}

    def health(self) -> JSONResponse:
        """200 while every model's engine is ready (awake or asleep: a request wakes it), else 503; the
        body gives each model's state ("ready", or "asleep", "waking", "falling asleep")."""
        states = {name: _state_text(self.routes.route(name).state) for name in self.model_names}  # type: ignore[union-attr]
        ready = all(state == "ready" for state in states.values())
        if self.sleep is not None:
            for name, state in states.items():
                sleep_state = self.sleep.state(name).value
                if state == "ready" and sleep_state != "awake":
                    states[name] = sleep_state
        return JSONResponse(
            {"status": "ok" if ready else "degraded", "models": states}, status_code=200 if ready else 503
        )

    async def forward(self, request: Request, path: str) -> Response:
        """Passes one OpenAI request to its model's engine and the answer back (a sleeping model is
        woken first: the request waits for it)."""
        started = time.monotonic()
        try:
            body = await read_body(request, self.max_body_bytes)
            model = model_of(body)
        except BadBody as bad:
            return openai_error(bad.status, bad.message, ERROR_TYPES[bad.status], bad.code, bad.param)
        route = self.routes.route(model)
        if route is None:
            message = f"The model `{model}` does not exist. Served models: {', '.join(self.model_names)}."
            self.metrics.request_done(model, path, 404, started, known=False)
            return openai_error(404, message, "NotFoundError", "model_not_found", "model")
        if route.url is None:
            self.metrics.request_done(model, path, 503, started)
            return self._unavailable(model, route)
        woken = False
        if self.sleep is not None and not self.sleep.claim(model):
            refused = await self._wake(model)
            if refused is not None:
                self.metrics.request_done(model, path, 503, started)
                return refused
            woken = True
        finished = (lambda: self.sleep.done(model)) if self.sleep is not None else (lambda: None)
        url = route.url
        if url is None:  # the engine died while the request waited
            finished()
            self.metrics.request_done(model, path, 503, started)
            return self._unavailable(model, route)
        return await self._pass_on(request, body, model, path, url, started, woken, finished)

    async def _wake(self, model: str) -> Optional[JSONResponse]:
        """Waits until ``model`` is awake and claims it for this request; the 503 to send if it cannot be."""
        try:
            await asyncio.to_thread(self.sleep.wake_and_claim, model)
        except WakeRefused as refused:
            return openai_error(503, f"{refused}.", "ServiceUnavailableError", "model_cannot_wake", "model")
        return None

    async def _pass_on(
        self,
        request: Request,
        body: bytes,
        model: str,
        path: str,
        url: str,
        started: float,
        woken: bool,
        finished: Callable[[], None],
    ) -> Response:
        """Sends the request to the engine at ``url`` and relays its answer; ``finished`` once it ends."""
        client = self.upstreams.client(model)
        upstream = client.build_request("POST", url + path, content=body, headers=_passed_headers(request.headers))
        sending = asyncio.ensure_future(client.send(upstream, stream=True))
        gone = asyncio.ensure_future(_client_gone(request))
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()  # a streaming response watches for the disconnect itself from here
        if not sending.done():
            sending.cancel()  # closes the connection: the engine aborts the request
            finished()
            self.metrics.request_done(model, path, CLIENT_CLOSED_REQUEST, started)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            answer = sending.result()
        except httpx.PoolTimeout:
            finished()
            self.metrics.request_done(model, path, 503, started)
            return self._busy(model)
        except httpx.HTTPError as exc:
            logger.warning("%s: engine did not answer %s: %s", model, path, str(exc) or type(exc).__name__)
            finished()
            self.metrics.request_done(model, path, 503, started)
            return self._unreachable(model)
        if woken:
            self.metrics.request_waited_for_wake(model, started)
        headers = _passed_headers(answer.headers)
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                self._relay(answer, model, path, started, finished), status_code=answer.status_code, headers=headers
            )
        try:
            content = b"".join([chunk async for chunk in answer.aiter_raw()])
        finally:
            await answer.aclose()
            finished()
        self.metrics.request_done(model, path, answer.status_code, started)
        return Response(content, status_code=answer.status_code, headers=headers)

    async def _relay(
        self, answer: httpx.Response, model: str, path: str, started: float, finished: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        status = answer.status_code
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # the engine died mid-stream: the client sees the stream end
            status = ENGINE_BROKE_OFF
            logger.warning("%s: engine broke off a stream on %s: %s", model, path, str(exc) or type(exc).__name__)
        except BaseException:
            status = CLIENT_CLOSED_REQUEST  # cancelled: the client went away mid-stream
            raise
        finally:
            await answer.aclose()
            finished()
            self.metrics.request_done(model, path, status, started)

    def _busy(self, model: str) -> JSONResponse:
        limits = self.upstreams.limits
        message = (
            f"The model `{model}` has {limits.connections} requests in flight, its most, and none ended within "
            f"{limits.pool_timeout_s:g} s; retry in a few seconds."
        )
        return openai_error(503, message, "ServiceUnavailableError", "engine_busy", "model")

    def _unreachable(self, model: str) -> JSONResponse:
        # Its state may still read "ready": the engine died a moment ago and serve has not seen it yet.
        message = f"The model `{model}` is not available now (its engine did not answer); retry in a few seconds."
        return openai_error(503, message, "ServiceUnavailableError", "engine_unreachable", "model")

    def _unavailable(self, model: str, route: Route) -> JSONResponse:
        state = _state_text(route.state)
        message = f"The model `{model}` is not available now (its engine is {state}); retry in a few seconds."
        return openai_error(503, message, "ServiceUnavailableError", f"engine_{state}", "model")


def create_app(
    routes: Routes,
    model_names: list[str],
    metrics: ServeMetrics,
    limits: UpstreamLimits = DEFAULT_LIMITS,
    max_body_bytes: int = MAX_BODY_BYTES,
    sleep: Any = None,
) -> FastAPI:
    """The FastAPI app: ``/v1/models``, the routed ``/v1/*`` endpoints, ``/health`` and ``/metrics``;
    every error the router answers itself (unknown path, wrong method, a fault) in the OpenAI shape."""
    router = Router(routes, model_names, metrics, limits, max_body_bytes, sleep)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.upstreams.aclose()

    app = FastAPI(title="kvcached serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"There is no {request.url.path} here; kvcached serve answers {', '.join(ENDPOINTS)}."
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}."
        else:
            message = str(exc.detail)
        code = {404: "path_not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        return openai_error(exc.status_code, message, ERROR_TYPES.get(exc.status_code, "BadRequestError"), code)

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception) -> Response:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
        return openai_error(
            500, "kvcached serve failed to answer; its log says why", ERROR_TYPES[500], "internal_error"
        )

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return router.models()

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/metrics")
    async def metrics_text() -> Response:
        content, content_type = metrics.exposition()
        return Response(content, media_type=content_type)

    for path in ROUTED_PATHS:

        async def routed(request: Request, _path: str = path) -> Response:
            return await router.forward(request, _path)

        app.add_api_route(path, routed, methods=["POST"])

    return app


__all__ = ["ROUTED_PATHS", "Route", "Router", "Routes", "create_app", "openai_error"]
