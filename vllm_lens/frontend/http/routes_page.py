"""The lens page: ``GET /lens`` and its two static files, when the operator sets
``VLLM_LENS_PAGE=1`` (runs in: front end).

The page is three files shipped in the package (``page/``), with no build step. It calls the
server's own HTTP API as any client does, so admission, limits and the names-only rule for
SAEs apply to it unchanged; this router adds no other endpoint. Every answer carries a
Content-Security-Policy that lets the page load and connect to this server only. The page
has no authentication of its own: whoever reaches the port can use it (and the API it calls).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

__all__ = ["router"]

router = APIRouter()

#: The files the page is made of, by the name it is fetched under, with their media type.
_FILES = {"index.html": "text/html; charset=utf-8", "lens.js": "text/javascript; charset=utf-8",
          "lens.css": "text/css; charset=utf-8"}

#: The page may load scripts, styles and data from this server only, and nothing may frame it.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


def _file(name: str) -> Response:
    body = resources.files(__package__).joinpath("page", name).read_bytes()
    return Response(body, media_type=_FILES[name],
                    headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                             "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


@router.get("/lens", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/lens/lens.js", include_in_schema=False)
async def script() -> Response:
    return _file("lens.js")


@router.get("/lens/lens.css", include_in_schema=False)
async def style() -> Response:
    return _file("lens.css")
