"""The live dashboard: ``GET /dashboard`` (one page) and ``GET /dashboard/state`` (its JSON).

The page, its scripts and its styles are files of this package (``static/``), served by these
routes: no external asset, no CDN, no build step; it works with no network. The script polls
``/dashboard/state`` about once a second and redraws without reloading.

Authentication (docs/SERVER.md, 'Dashboard'): with ``--api-key`` the state needs the bearer key
exactly as ``/v1`` does. The page and its assets hold no data, so they are served without a key
(a browser cannot send a bearer header when it navigates); the page asks for the key and sends it
itself, and ``/dashboard#key=KEY`` fills it in (a URL fragment never reaches the server).

``register_dashboard(app, srv)`` adds the routes and runs the history sampler in the app's
lifespan (see ``history``).
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from turnkv.server.dashboard.state import Dashboard

ASSETS = {  # route -> (file in static/, content type)
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/draw.js": ("draw.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("app.css", "text/css; charset=utf-8"),
}
# Everything the page loads or fetches comes from this server; inline script and style are refused.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _asset_route(app: FastAPI, path: str, name: str, media_type: str) -> None:
    body = (files(__package__) / "static" / name).read_bytes()
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if name.endswith(".html"):
        headers["Content-Security-Policy"] = CSP
        headers["Referrer-Policy"] = "no-referrer"

    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=headers)

    app.add_api_route(path, asset, methods=["GET"], include_in_schema=False)


def register_dashboard(app: FastAPI, srv) -> Dashboard:
    """Add ``/dashboard``, its assets and ``/dashboard/state`` to ``app`` for ``srv`` (a ``Server``)."""
    dash = Dashboard(srv)
    for path, (name, media_type) in ASSETS.items():
        _asset_route(app, path, name, media_type)

    @app.get("/dashboard/state", include_in_schema=False)
    async def _state(request: Request) -> JSONResponse:
        srv.namespace(request, None)  # 401 without a valid key, as /v1
        return JSONResponse(dash.state(), headers={"Cache-Control": "no-store"})

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI):
        sampler = asyncio.create_task(dash.history.run())
        try:
            async with inner(a) as state:
                yield state
        finally:
            sampler.cancel()

    app.router.lifespan_context = lifespan
    return dash


__all__ = ["Dashboard", "register_dashboard"]
