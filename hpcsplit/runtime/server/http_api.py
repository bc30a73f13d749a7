"""The v2 REST API on aiohttp (the binary tensor data extension included).

Every route but ``/v2/health/live`` and ``/v2/health/ready`` needs ``Authorization: Bearer <token>`` when
the server has a token; a missing or wrong one is refused (401) before the body is read.  A body larger
than ``runtime.server_max_body_mb`` is refused (413) from its ``Content-Length`` (or while it is read,
when chunked).  Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hpcsplit.runtime.server.hub import Hub
from hpcsplit.runtime.server.protocol import RequestRejected, decode_http, encode_http

__all__ = ["EXTENSIONS", "SERVER_NAME", "make_app"]

SERVER_NAME = "hpcsplit"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
_OPEN = frozenset({"/v2/health/live", "/v2/health/ready"})
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a model name or version that is a path part as it is
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, msg: str, **headers: str) -> web.Response:
    return web.json_response({"error": msg}, status=status, headers=headers or None)


def make_app(hub: Hub, max_body: int, version: str) -> web.Application:
    """The aiohttp application serving ``hub``'s model."""
    spec = hub.spec
    plans: dict[bytes, Any] = {}  # decode_http's and encode_http's caches (headers repeat)
    heads: dict[tuple[Any, ...], bytes] = {}

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN and not hub.check_token(request.headers.get("Authorization")):
            hub.count(None, "unauthenticated", "http")
            return _error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>'; the token is "
                               "in the file endpoint.json names)", **{"WWW-Authenticate": "Bearer"})
        if request.content_length is not None and request.content_length > max_body:
            hub.count(None, "too_large", "http")
            return _error(413, f"the request body of {request.content_length} bytes is over the server's limit of "
                               f"{max_body} bytes (runtime.server_max_body_mb)")
        try:
            return await handler(request)
        except RequestRejected as e:
            if not e.counted:
                hub.count(None, "rejected", "http")
            return _error(e.http_status, str(e))
        except web.HTTPRequestEntityTooLarge:
            hub.count(None, "too_large", "http")
            return _error(413, f"the request body is over the server's limit of {max_body} bytes "
                               "(runtime.server_max_body_mb)")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, f"{e.reason}: {request.method} {request.path}")

    def model_of(request: web.Request) -> None:
        spec.check_model(request.match_info["model"], request.match_info.get("version", ""))

    async def live(_: web.Request) -> web.Response:
        return web.Response(status=200)

    def _ready(not_ready: str) -> web.Response:
        if not hub.is_ready():
            return _error(503, not_ready)
        if hub.degraded:  # still serving, without some replicas ([Note: serving through faults])
            return web.json_response({"ready": True, "state": "degraded", "lost": hub.degraded})
        return web.Response(status=200)

    async def ready(_: web.Request) -> web.Response:
        return _ready("not ready")

    async def server_meta(_: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": version, "extensions": EXTENSIONS})

    async def model_meta(request: web.Request) -> web.Response:
        model_of(request)
        return web.json_response(spec.metadata())

    async def model_ready(request: web.Request) -> web.Response:
        model_of(request)
        return _ready(f"model {spec.name!r} is not ready")

    async def model_config(request: web.Request) -> web.Response:
        model_of(request)
        return web.json_response(spec.config())

    async def model_stats(request: web.Request) -> web.Response:
        if "model" in request.match_info:
            model_of(request)
        return web.json_response(await hub.read_statistics())

    async def infer(request: web.Request) -> web.Response:
        model_of(request)
        return await infer_own(request)

    async def infer_own(request: web.Request) -> web.Response:  # the path names the served model
        hl = request.headers.get("Inference-Header-Content-Length")
        try:
            header_len = int(hl) if hl is not None else None
        except ValueError:
            raise RequestRejected(f"Inference-Header-Content-Length {hl!r} is not a number") from None
        body = await request.read()
        req = decode_http(spec, body, header_len, plans)
        # the frontend loop answers every ticket: with its outputs, at runtime.request_timeout_s (504),
        # or when it ends (503); no timer of its own here (one costs 9 us a request)
        outputs = await hub.submit(req, "http").future
        data, n = encode_http(spec, req, outputs, heads)
        if n is None:
            return web.Response(body=data, content_type="application/json")
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(n)})

    async def metrics(_: web.Request) -> web.Response:
        resp = web.Response(body=await hub.metrics_text())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app = web.Application(middlewares=[guard], client_max_size=max_body)
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    if _PLAIN_NAME.fullmatch(spec.name) and _PLAIN_NAME.fullmatch(spec.version):
        # the served model's own infer paths first, as plain routes: aiohttp finds those with one dict
        # lookup, where the patterns below are tried one by one (a few us a request)
        own = f"/v2/models/{spec.name}"
        app.add_routes([web.post(own + "/infer", infer_own),
                        web.post(f"{own}/versions/{spec.version}/infer", infer_own)])
    app.add_routes([
        web.get("/v2/health/live", live), web.get("/v2/health/ready", ready), web.get("/v2", server_meta),
        web.get(m, model_meta), web.get(mv, model_meta), web.get(m + "/ready", model_ready),
        web.get(mv + "/ready", model_ready), web.get(m + "/config", model_config), web.get(mv + "/config", model_config),
        web.get(m + "/stats", model_stats), web.get(mv + "/stats", model_stats), web.get("/v2/models/stats", model_stats),
        web.post(m + "/infer", infer), web.post(mv + "/infer", infer), web.get("/metrics", metrics),
    ])
    return app
