"""``/docs`` and ``/openapi.json`` (issue 31): no key, no CDN, bearer schemes, the real error body.

A live gateway over the instant engine, as ``serve`` runs it. Oracles: ``openapi-spec-validator``
for the schema (OpenAPI 3.1), ``jsonschema`` for the server's own error bodies against the
schema's ``Error``, the ``swagger-ui-bundle-v2`` package's files for the assets.
"""

import re
from html.parser import HTMLParser
from urllib.parse import urlsplit

import httpx
import jsonschema
import pytest

from loraplex.gateway.cli import build_parser
from loraplex.gateway.commands.serve import gateway_config_from_args
from tests.gateway.live import ADMIN_KEY, LiveGateway
from tests.gateway.test_app_basics import assert_openai_error

PAGES = ("/docs", "/docs/swagger")
SCHEMAS = {"/openapi.json": "application/json", "/docs/openapi.json": "application/vnd.oai"}
PUBLIC_ROUTES = {("/health", "get"), ("/version", "get")}
ADMIN_ROUTES = re.compile(r"^/(admin/|metrics$)")


def instant_live(data, **config):
    from bench.fake_engine import InstantEngine

    return LiveGateway(InstantEngine("instant"), data, **config)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    with instant_live(tmp_path_factory.mktemp("docs") / "data") as live:
        live.key = live.create_tenant("acme")["api_key"]
        yield live


@pytest.fixture(scope="module")
def schema(gw):
    with gw.client() as c:
        return c.get("/openapi.json").json()


class Links(HTMLParser):
    """Every URL a page loads or links (src, href) and its inline scripts' text."""

    def __init__(self):
        super().__init__()
        self.urls, self.scripts, self._in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v is not None]
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def test_docs_and_schema_answer_without_a_key_and_with_any(gw):
    keys = [None, ADMIN_KEY, gw.key, "lpx-not-a-key"]
    for key in keys:
        with gw.client(key) as c:
            for page in PAGES:
                r = c.get(page)
                assert r.status_code == 200, (page, key, r.text[:200])
                assert r.headers["content-type"].startswith("text/html")
            bodies = []
            for path, media in SCHEMAS.items():
                r = c.get(path)
                assert r.status_code == 200 and r.headers["content-type"].startswith(media)
                bodies.append(r.json())
            assert bodies[0] == bodies[1]  # one schema at both addresses
    # a bad key on /docs is not a failed authentication (no throttle, no 401)
    assert gw.state.auth_throttle.retry_after("127.0.0.1") is None


def test_the_page_loads_only_local_files_and_they_are_served(gw):
    from swagger_ui_bundle import swagger_ui_path

    with gw.client() as c:
        page = c.get("/docs").text
        links = Links()
        links.feed(page)
        assert not re.search(r"(?i)\b(?:https?:)?//", page), "a URL to another host"
        assert links.urls and all(u.startswith("/") and not u.startswith("//") for u in links.urls)
        types = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
        for url in links.urls:
            r = c.get(url)
            assert r.status_code == 200, url
            name = urlsplit(url).path.rsplit("/", 1)[1]
            assert r.headers["content-type"].startswith(types[name[name.rindex(".") :]]), url
            assert r.content == (swagger_ui_path / name).read_bytes(), url
        # the script the page runs fetches the schema from here, and finds it
        (script,) = [s for s in links.scripts if "SwaggerUIBundle(" in s]
        (schema_url,) = re.findall(r'url: "([^"]+)"', script)
        assert "validatorUrl: null" in script  # Swagger UI's default badge is another host's
        assert c.get(schema_url).json()["openapi"].startswith("3.1")
    assert {urlsplit(u).path for u in links.urls} >= {
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
    }


@pytest.mark.parametrize(
    "path",
    [
        "/docs/redoc",
        "/docs/nothing.json",
        "/docs/assets/index.html",
        "/docs/assets/swagger-ui-bundle.js.map",
        "/docs/assets/..%2F..%2F__init__.py",
        "/docs/assets/%2e%2e",
    ],
)
def test_anything_else_under_docs_is_an_openai_404(gw, path):
    with gw.client() as c:
        assert_openai_error(c.get(path), 404)


def test_the_schema_is_valid_openapi_31(schema):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(schema)
    assert schema["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema["paths"])
    assert not {"/docs", "/openapi.json"} & set(schema["paths"])


def operations(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if isinstance(op, dict) and "responses" in op:
                yield path, method, op


def test_each_route_names_the_bearer_key_it_takes(schema):
    schemes = schema["components"]["securitySchemes"]
    assert {name: (s["type"], s["scheme"]) for name, s in schemes.items()} == {
        "tenant_key": ("http", "bearer"),
        "admin_key": ("http", "bearer"),
    }
    seen = set()
    for path, method, op in operations(schema):
        seen.add((path, method))
        if (path, method) in PUBLIC_ROUTES:
            assert "security" not in op, path
        elif ADMIN_ROUTES.match(path):
            assert op["security"] == [{"admin_key": []}], path
        else:
            assert op["security"] == [{"tenant_key": []}], path
    assert PUBLIC_ROUTES <= seen


def test_errors_are_documented_with_the_body_the_api_sends(gw, schema):
    error_schema = schema["components"]["schemas"]["Error"]
    for path, method, op in operations(schema):
        errors = {s: r for s, r in op["responses"].items() if s[0] in "45" or s == "default"}
        assert "default" in errors, path
        if (path, method) not in PUBLIC_ROUTES:
            assert {"401", "403", "429", "503"} <= set(errors), (path, method)
        if method in ("post", "put"):
            assert "400" in errors, (path, method)
        for status, response in errors.items():
            media = response["content"]["application/json"]["schema"]
            assert media == {"$ref": "#/components/schemas/Error"}, (path, method, status)
    assert '"status_code"' not in str(schema).replace("'", '"')  # Litestar's own body: gone
    # what the server really sends on errors validates against the documented schema
    jsonschema.Draft202012Validator.check_schema(error_schema)
    validate = jsonschema.Draft202012Validator(error_schema).validate
    tenant = {"Authorization": f"Bearer {gw.key}"}
    with httpx.Client(base_url=gw.base_url, timeout=30) as c:
        sent = [
            c.get("/v1/models"),
            c.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
            c.post("/v1/chat/completions", content=b"{", headers=tenant),
            c.post("/v1/chat/completions", json={"model": "instant"}, headers=tenant),
            c.get("/v1/nothing", headers=tenant),
        ]
    assert [r.status_code for r in sent] == [401, 403, 400, 400, 404]
    for r in sent:
        validate(r.json())
    example = error_schema["examples"][0]
    validate(example)


def test_serve_flag_closes_them(tmp_path):
    parser = build_parser()
    assert gateway_config_from_args(parser.parse_args(["serve"]), "m").docs is True
    for flag in ("--disable-docs", "--disable-fastapi-docs"):
        config = gateway_config_from_args(parser.parse_args(["serve", flag]), "m")
        assert config.docs is False
    with instant_live(tmp_path / "data", docs=False) as live, live.client() as c:
        for path in (*PAGES, *SCHEMAS, "/docs/assets/swagger-ui.css"):
            assert_openai_error(c.get(path), 404)
        assert c.get("/health").status_code == 200
