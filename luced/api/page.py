"""The web page at `/`: chat, status and plots, served from package data (luced/api/static).

There is no build step: the files are what the browser runs, plain ES modules and the
libraries they import (static/vendor/, pinned versions with their licences; docs/web.md
says which and why). They are read once, when the app is made, into a table from URL
path to bytes; a request can name only what is in the table, so no path from a client
ever reaches the file system.

Every file goes out with a Content-Security-Policy that allows scripts, styles and
connections only from this origin, no inline script or style, no plug-ins and no
framing: text that a model writes, rendered as markdown, cannot run. The page itself is
public (it holds nothing secret); the JSON it fetches wants the API key like any client.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from aiohttp import web

from luced.api.fields import APIError

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",  # a .js file is run only as JavaScript
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag): a new version is seen at once
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}


class _File:
    def __init__(self, body: bytes, content_type: str) -> None:
        self.body = body
        self.content_type = content_type
        self.etag = hashlib.sha256(body).hexdigest()[:16]


def load_files(root: Traversable | None = None) -> dict[str, _File]:
    """Every servable file under static/, by its path relative to it."""
    root = root or resources.files("luced.api") / "static"
    files: dict[str, _File] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                walk(child, name + "/")
            elif (kind := CONTENT_TYPES.get(_suffix(child.name))) is not None:
                files[name] = _File(child.read_bytes(), kind)

    walk(root, "")
    return files


def _suffix(name: str) -> str:
    return name[name.rfind(".") :] if "." in name else ".txt"  # LICENSE -> text


def add_routes(app: web.Application) -> None:
    files = load_files()

    def send(request: web.Request, name: str) -> web.Response:
        f = files.get(name)
        if f is None:
            raise APIError(404, f"no file {request.path!r}")
        headers = {**HEADERS, "ETag": f'"{f.etag}"'}
        if request.headers.get("If-None-Match") == f'"{f.etag}"':
            return web.Response(status=304, headers=headers)
        return web.Response(body=f.body, headers={**headers, "Content-Type": f.content_type})

    async def index(request: web.Request) -> web.Response:
        return send(request, "index.html")

    async def static(request: web.Request) -> web.Response:
        return send(request, request.match_info["name"])

    app.add_routes([web.get("/", index), web.get("/static/{name:.+}", static)])
