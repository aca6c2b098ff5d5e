"""``/docs``: Swagger UI for the audit API, only when asked for (``TOOLLEDGER_API_DOCS``).

Operators paste tokens into this page, so nothing in it comes from anywhere but this app:
Swagger UI's own files are read from an installed package (``fastapi-offline`` ships them),
never a CDN; the page's one script of its own is a file too, so the policy can stay
``script-src 'self'`` with no inline script; and Swagger UI's validator badge, which would
ask a public host about the document, is turned off.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from importlib.abc import Traversable
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, Response

from toolledger.audit.auth import ApiConfigurationError

ASSETS_PACKAGE = "fastapi_offline"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
"""The files the page loads, by name: nothing else of the package is served."""
DOCS_PATHS = frozenset({"/docs", "/docs/init.js", "/docs/assets/{name}"})
DOCS_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; font-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
"""data: images are Swagger UI's own icons, inlined in its stylesheet."""

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>toolledger audit API</title>
<link rel="icon" type="image/png" href="/docs/assets/favicon.png">
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"""

_INIT = """"use strict";
// validatorUrl null: Swagger UI would otherwise show a badge fetched from a public validator.
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
  deepLinking: true,
});
"""


def assets_directory() -> Traversable:
    """Where Swagger UI's files are; ApiConfigurationError when no package provides them."""
    try:
        directory = importlib.resources.files(ASSETS_PACKAGE) / "static"
    except ModuleNotFoundError:
        directory = None
    if directory is None or not all((directory / name).is_file() for name in ASSETS):
        raise ApiConfigurationError(
            "TOOLLEDGER_API_DOCS serves Swagger UI from the fastapi-offline package, never a CDN: "
            "`pip install 'toolledger[docs]'`, or leave /docs off (the document is at /openapi.json)"
        )
    return directory


def add_docs_routes(app: FastAPI) -> None:
    """/docs, its initializer and Swagger UI's files; refuses (ApiConfigurationError) when the
    files are not installed."""
    directory = assets_directory()

    async def docs() -> HTMLResponse:
        return HTMLResponse(_PAGE)

    async def initializer() -> Response:
        return Response(_INIT, media_type="text/javascript; charset=utf-8")

    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            raise HTTPException(404, "Not Found")
        return Response(
            (directory / name).read_bytes(),
            media_type=media_type,
            headers={"Cache-Control": "public, max-age=86400"},
        )

    routes: list[tuple[str, Callable[..., Any]]] = [
        ("/docs", docs),
        ("/docs/init.js", initializer),
        ("/docs/assets/{name}", asset),
    ]
    for path, endpoint in routes:
        app.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False)


__all__ = ["DOCS_PATHS", "DOCS_POLICY", "add_docs_routes", "assets_directory"]
