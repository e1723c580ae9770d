"""``/docs`` and ``/openapi.json``: the API's documentation, open without a key, with no CDN.

Routes (none takes a key; ``serve --disable-docs`` removes them all, as vLLM's
``--disable-fastapi-docs`` does):

* ``GET /docs`` (and ``/docs/swagger``): Swagger UI over the schema. Its script, stylesheet and
  icon are served by the gateway itself from ``/docs/assets/`` (:func:`docs_asset`), read
  from the ``swagger-ui-bundle-v2`` package's copy of ``swagger-ui-dist`` (a runtime
  dependency), so the page works on a machine without internet; it loads nothing from another
  host (no CDN, no favicon, no validator badge: ``validatorUrl: null``). *Authorize* takes a
  tenant key (or the admin key for ``/admin/*``) and *Try it out* sends it.
* ``GET /openapi.json`` (where vLLM and FastAPI serve it) and ``GET /docs/openapi.json``: the
  OpenAPI 3.1 schema (:mod:`gateway.server.openapi`: bearer security schemes, OpenAI's error
  body), made once per app and served from memory.

Anything else under ``/docs/`` is a 404 in OpenAI's error body. The schema and the page are
public because they say nothing a tenant's own requests do not (routes and body shapes);
each is a bounded, cached answer.
"""

from __future__ import annotations

import functools
import html
from collections.abc import Sequence
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, Router, get
from litestar.enums import OpenAPIMediaType
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import OpenAPIRenderPlugin
from litestar.params import FromPath

from loraplex.gateway.errors import APIError, error_response, not_found
from loraplex.gateway.server.openapi import EXCLUDE_FROM_AUTH, document

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
"""The files of ``swagger-ui-dist`` the page loads, and their media types (no others served)."""
ASSET_MAX_AGE_S = 86400
PUBLIC = {EXCLUDE_FROM_AUTH: True}


class ApiSchema:
    """One app's documented schema as JSON bytes, made on first use and kept.

    Litestar builds its schema once (``app.openapi_schema``, from the registered routes);
    :func:`gateway.server.openapi.document` adds the keys and errors; the result is encoded
    once, so a request for it costs a lookup.
    """

    def __init__(self) -> None:
        self._source: object = None
        self._json = b""

    def json(self, app: Litestar) -> bytes:
        """The schema of ``app`` (OpenAPI 3.1, UTF-8 JSON)."""
        source = app.openapi_schema
        if source is not self._source:
            self._json = msgspec.json.encode(document(source.to_schema(), app))
            self._source = source
        return self._json


class SchemaJson(OpenAPIRenderPlugin):
    """Litestar render plugin serving :class:`ApiSchema`'s JSON.

    Args:
        schema: The app's documented schema.
        path: Where, under ``/docs``.
    """

    def __init__(self, schema: ApiSchema, path: str = "/openapi.json") -> None:
        super().__init__(path=path, media_type=OpenAPIMediaType.OPENAPI_JSON)
        self.schema = schema

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        """The documented schema (``openapi_schema``, Litestar's own, is not used)."""
        return self.schema.json(request.app)


class SwaggerPage(OpenAPIRenderPlugin):
    """Litestar render plugin serving the Swagger UI page, its assets from ``/docs/assets``.

    Args:
        path: Where, under ``/docs`` (``/`` makes it the page of ``/docs`` itself).
    """

    def __init__(self, path: Sequence[str] = ("/", "/swagger")) -> None:
        super().__init__(path=list(path))

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        """The page (the schema is fetched by the page from ``/openapi.json``)."""
        return swagger_page(request.scope.get("root_path", ""))


@functools.lru_cache(maxsize=8)
def swagger_page(root_path: str = "") -> bytes:
    """The Swagger UI page for an app served under ``root_path`` (every URL in it is local).

    Configured as FastAPI's offline docs are (``BaseLayout``, the standalone preset from the
    bundle), and with ``validatorUrl: null``: Swagger UI's default validator badge is an image
    from another host.
    """
    base = html.escape(root_path, quote=True)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>loraplex API</title>
<link rel="icon" type="image/png" href="{base}{ASSETS_PATH}/favicon-32x32.png">
<link rel="stylesheet" href="{base}{ASSETS_PATH}/swagger-ui.css">
<style>body {{ margin: 0 }}</style>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{base}{ASSETS_PATH}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "{base}/openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}});
</script>
</body>
</html>
""".encode()


@functools.cache
def asset_bytes(name: str) -> bytes:
    """One file of Swagger UI's distribution, read once from the ``swagger-ui-bundle-v2`` package.

    Raises:
        APIError: 503 ``docs_unavailable`` when the package is not installed (a broken install:
            it is a runtime dependency).
    """
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        raise APIError(
            503,
            "the docs page's files are not installed (pip install swagger-ui-bundle-v2)",
            code="docs_unavailable",
        ) from None
    return (swagger_ui_path / name).read_bytes()


def _json_404(response: Response) -> Response:
    """Litestar's docs router answers unknown ``/docs/...`` paths with an HTML 404: made ours."""
    if response.status_code == 404:
        return error_response(404, "no such route", code="not_found")
    return response


def docs_setup(title: str, version: str) -> tuple[OpenAPIConfig, list[Any]]:
    """The app's OpenAPI configuration and the routes outside ``/docs`` (module doc).

    Args:
        title: The API's title (``info.title``).
        version: Its version (``info.version``).

    Returns:
        ``(openapi_config, route_handlers)``: pass the first as ``Litestar(openapi_config=)``,
        add the second to its route handlers.
    """
    schema = ApiSchema()

    @get("/openapi.json", opt=PUBLIC, include_in_schema=False, sync_to_thread=False)
    def openapi_json(request: Request) -> Response:
        """The OpenAPI schema, where vLLM and FastAPI serve it."""
        return Response(schema.json(request.app), media_type="application/json")

    @get(f"{ASSETS_PATH}/{{name:str}}", opt=PUBLIC, include_in_schema=False, sync_to_thread=False)
    def docs_asset(name: FromPath[str]) -> Response:
        """One of :data:`ASSETS` (404 for any other name)."""
        media_type = ASSETS.get(name)
        if media_type is None:
            raise not_found(f"no docs asset {name[:64]!r}")
        return Response(
            asset_bytes(name),
            media_type=media_type,
            headers={"Cache-Control": f"public, max-age={ASSET_MAX_AGE_S}"},
        )

    router = Router(
        DOCS_PATH,
        route_handlers=[],
        include_in_schema=False,
        opt=PUBLIC,
        after_request=_json_404,
    )
    config = OpenAPIConfig(
        title=title,
        version=version,
        openapi_router=router,
        render_plugins=[SwaggerPage(), SchemaJson(schema)],
    )
    return config, [openapi_json, docs_asset]
