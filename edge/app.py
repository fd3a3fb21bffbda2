"""The edge application: FastAPI app factory, its lifespan, and health, readiness and metrics.

Where this sits in the data flow::

    client --HTTP/SSE--> edge --SubmitGeneration/CancelGeneration--> COMMANDS --> admission processor
                          ^ <----------- EDGE_INBOX partition of this edge: Outcome, TextDelta,
                          |              GenerationFinalized, PromptRequest (answered on WORKER_CONTROL)
                          `--- CAPACITY (worker heartbeats -> queue-wait estimate)

``create_app(settings)`` builds one ``Edge`` (edge/state.py: settings, authenticator, buckets, stream
hub, capacity view, command client) and starts its Kafka clients in the lifespan. ``python -m edge`` runs it under
uvicorn with drain-on-SIGTERM (``edge.__main__``). Logs carry opaque ids only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from starlette.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from edge import errors
from edge.body import refuse_unexpected_body
from edge.deps import new_request_id
from edge.openapi_spec import build_openapi
from edge.outcomes import OutcomeMiddleware
from edge.routes import conversations, generations, internal, openai, ui, usage
from edge.settings import EdgeSettings
from edge.state import Edge
from infra.runtime.gc_tuning import tune_gc

OPENAPI_TITLE = "chatplane edge"
OPENAPI_VERSION = "1.0.0"
# How long a browser may cache a CORS preflight answer.
CORS_MAX_AGE_S = 600


class RequestIdMiddleware:
    """Gives every request an opaque ``request_id`` (``request.state.request_id``, ``X-Request-Id``).

    Plain ASGI rather than ``BaseHTTPMiddleware``: that one runs each response in an extra task group
    with its own disconnect listener, which cost a third of the edge's CPU per streaming request.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _cache_openapi(app: FastAPI) -> dict[str, Any]:
    app.openapi_schema = build_openapi(app)
    return app.openapi_schema


def create_app(settings: EdgeSettings | None = None) -> FastAPI:
    edge = Edge(settings or EdgeSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await edge.start()
        tune_gc(edge.settings.gc_gen0_threshold)
        try:
            yield
        finally:
            await edge.stop()

    app = FastAPI(
        title=OPENAPI_TITLE,
        version=OPENAPI_VERSION,
        description="The HTTP/SSE edge of chatplane: submit, read and cancel generations.",
        lifespan=lifespan,
        # A path with a trailing slash is an unknown route (typed 404), never a redirect: Starlette's
        # redirect builds its Location from the client's Host header.
        redirect_slashes=False,
        # Every route reads its body through edge.body; one that takes none refuses any.
        dependencies=[Depends(refuse_unexpected_body)],
    )
    app.state.edge = edge
    app.openapi = lambda: app.openapi_schema or _cache_openapi(app)  # type: ignore[method-assign]
    app.include_router(generations.router)
    app.include_router(openai.router)
    app.include_router(usage.router)
    app.include_router(conversations.router)
    app.include_router(internal.router)  # the proxy's route-key look-up; not in the OpenAPI document
    ui.install(app, edge.settings.dev_mode)
    app.add_exception_handler(errors.ApiError, errors.api_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    app.add_middleware(OutcomeMiddleware, edge=edge)  # inside RequestIdMiddleware: it reads the request id
    app.add_middleware(RequestIdMiddleware)
    if edge.settings.cors_origin_list:
        # Outermost: a preflight is answered before authentication. Bearer tokens travel in a header,
        # so no credentials mode (cookies) is allowed; scripts may read the retry and request-id headers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=edge.settings.cors_origin_list,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Retry-After", "X-Request-Id", "retry-after-ms", "x-should-retry"],
            allow_credentials=False,
            max_age=CORS_MAX_AGE_S,
        )

    @app.get("/healthz", include_in_schema=True, tags=["operations"], summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Readiness: fails first when draining")
    async def readyz() -> Response:
        if not edge.ready or edge.hub.draining:
            return JSONResponse({"status": "draining" if edge.hub.draining else "starting"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get(
        "/healthz/admission", tags=["operations"],
        summary="Admission health: whether the processor answers a probe command (not part of readiness)",
        responses={503: {"description": "Admission down: the last probe got no decision in time (or none ended yet)"}},
    )
    async def admission_health() -> Response:
        return JSONResponse(edge.admission.status(), status_code=200 if edge.admission.up else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(edge.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
