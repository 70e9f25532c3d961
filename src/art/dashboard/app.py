"""`art dashboard`: the dashboard on its own, over a storage folder, with no model loaded.

It only reads the run folders, so it can watch runs trained by another process (a script with
`LocalBackend`, or `art serve`) on the same disk. Loopback by default: it has no key, so
anyone who reaches the port reads every run's samples.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from art.dashboard.routes import dashboard_router

DEFAULT_PORT = 7990


def create_dashboard_app(root: str | Path) -> FastAPI:
    """A FastAPI app with the dashboard router; `/` redirects to the page."""
    app = FastAPI(title="art dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(dashboard_router(root))

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    return app


def serve_dashboard(*, host: str, port: int, path: str) -> None:
    """Bind, print the address, serve until interrupted."""
    import uvicorn

    from art.server.thread import bind, url_for

    sock, port = bind(host, port)
    url = url_for(host, port)
    print(f"art dashboard: {url}/dashboard (runs under {Path(path).resolve()})", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_dashboard_app(path), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
