"""The lens page's routes exist only with ``VLLM_LENS_PAGE=1``, serve the package's own files
under a policy that lets the page reach this server only, and add no API endpoint."""

import re
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_lens.frontend.http import install
from vllm_lens.sinks import config as sinks_config


def _app(monkeypatch, page: str | None) -> FastAPI:
    if page is None:
        monkeypatch.delenv("VLLM_LENS_PAGE", raising=False)
    else:
        monkeypatch.setenv("VLLM_LENS_PAGE", page)
    # register_api_routers marks the process as serving HTTP: undone after the test.
    monkeypatch.setattr(sinks_config, "_serves_http", sinks_config._serves_http)
    app = FastAPI()
    install._wrap_register_api_routers(lambda args, app: None)(SimpleNamespace(), app)
    return app


@pytest.mark.parametrize("page", [None, "0"])
def test_the_page_is_off_unless_the_operator_turns_it_on(monkeypatch, page):
    client = TestClient(_app(monkeypatch, page))
    assert client.get("/lens").status_code == 404
    assert client.get("/lens/lens.js").status_code == 404


def test_the_page_serves_its_three_files_and_nothing_else(monkeypatch):
    app = _app(monkeypatch, "1")
    client = TestClient(app)
    page = client.get("/lens")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    for name, kind in (("lens.js", "text/javascript"), ("lens.css", "text/css")):
        answer = client.get(f"/lens/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(kind)
        assert answer.headers["content-security-policy"] == policy
    for path in ("/lens/index.html", "/lens/page/lens.js", "/lens/other.js", "/lens/routes_page.py"):
        assert client.get(path).status_code == 404, path
    page_routes = {r.path for r in app.routes if r.path.startswith("/lens")}
    assert page_routes == {"/lens", "/lens/lens.js", "/lens/lens.css"}
    assert all(set(r.methods) == {"GET"} for r in app.routes if r.path in page_routes)
    # Everything the page loads is a path on this server: no URL with a scheme or host.
    html, script = page.text, client.get("/lens/lens.js").text
    assert not re.findall(r"(?:src|href)=\"(?!/lens/|data:)", html)
    assert "http://" not in script and "https://" not in script and "//" + "cdn" not in script
