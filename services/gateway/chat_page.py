"""The browser chat page at `/`: plain files shipped in the package (static/), no build step.

Only the files named in FILES are served (no path from the URL ever reaches the file system).
The page carries a strict Content-Security-Policy: scripts and styles from this origin only,
so even a rendering bug could not run script that arrived in model output.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway.errors import APIError

FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# Revalidate each time (the files are tiny): an upgraded server never serves a stale page.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


@cache
def _read(name: str) -> bytes:
    return resources.files("rill.services.gateway").joinpath("static", name).read_bytes()


def _file(name: str) -> Response:
    headers = dict(HEADERS)
    if name == "index.html":
        headers["Content-Security-Policy"] = CSP
    return Response(_read(name), media_type=FILES[name], headers=headers)


async def index(request: Request) -> Response:
    return _file("index.html")


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        raise APIError(f"No static file {name!r}.", 404)
    return _file(name)


def routes() -> list[Route]:
    return [Route("/", index, methods=["GET", "HEAD"]),
            Route("/static/{name}", static, methods=["GET", "HEAD"])]
