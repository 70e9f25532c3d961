"""The dashboard's HTTP routes, as an `APIRouter` any app can include.

    GET /dashboard  (and /dashboard/)                                       the page
    GET /dashboard/static/{file}                                            its script, styles, uPlot
    GET /dashboard/api/runs                                                 every run, with status
    GET /dashboard/api/runs/{project}/{name}/history?since=BYTES            history rows from a byte offset
    GET /dashboard/api/runs/{project}/{name}/steps                          {split: [steps with samples]}
    GET /dashboard/api/runs/{project}/{name}/steps/{split}/{step}           groups and trajectories
    GET /dashboard/api/runs/{project}/{name}/steps/{split}/{step}/trajectories/{index}/tokens

The routes read the storage root only, never a backend: the same router serves `art dashboard`
(no model loaded) and `art serve` (mounted behind its API key; `art.dashboard.login` adds
the browser's login, and `logout=True` a button for it on the page). Bad input is a 400 naming the
field (`project`, `name`, `split`, `step`, `index`, `since`) and a missing run or step a 404,
in OpenAI's error shape whatever app includes the router. Names are checked with the storage's
own `validate_name` before any path is built, so no request reaches outside the root. The
routes stay out of /openapi.json: they are a page for people, not part of the client API.
Handlers are plain functions, so FastAPI runs their file reads on its thread pool.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from art.dashboard import page
from art.dashboard.runs import list_runs, logged_steps, read_history, run_dir
from art.dashboard.samples import parse_index, read_step, trajectory_tokens
from art.errors import ArtValueError, ModelNotFoundError
from art.server.errors import error_object, error_response
from art.storage.layout import validate_name

STATIC = Path(__file__).parent / "static"
ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
}
"""The only files /dashboard/static serves: a name is looked up here, never joined to a path."""
MAX_OFFSET = 2**53


def dashboard_router(root: str | Path, *, logout: bool = False) -> APIRouter:
    """The dashboard over the runs stored under `root` (`<root>/<project>/models/<name>/`);
    `logout`: the page shows a button posting to /dashboard/logout (a server with a login)."""
    root = Path(root)
    router = APIRouter(prefix="/dashboard", include_in_schema=False)

    @router.get("", response_class=HTMLResponse)
    @router.get("/", response_class=HTMLResponse)  # where the login redirects: no extra hop
    def index() -> HTMLResponse:
        return HTMLResponse(page.render(root, logout=logout), headers={"cache-control": "no-cache"})

    @router.get("/static/{file}")
    def static(file: str):
        if file not in ASSETS:
            return _error(404, f"no static file {file!r}", "file")
        return FileResponse(STATIC / file, media_type=ASSETS[file], headers={"cache-control": "no-cache"})

    @router.get("/api/runs")
    def runs():
        return {"root": str(root), "now": time.time(), "runs": list_runs(root)}

    @router.get("/api/runs/{project}/{name}/history")
    def history(project: str, name: str, since: str = "0"):
        return _answer(
            lambda: read_history(run_dir(root, project, name).history, parse_index(since, "since", MAX_OFFSET))
        )

    @router.get("/api/runs/{project}/{name}/steps")
    def steps(project: str, name: str):
        return _answer(lambda: logged_steps(run_dir(root, project, name)))

    @router.get("/api/runs/{project}/{name}/steps/{split}/{step}")
    def step(project: str, name: str, split: str, step: str):
        def read():
            directory = run_dir(root, project, name)
            return read_step(directory, validate_name(split, "split"), parse_index(step, "step"))

        return _answer(read)

    @router.get("/api/runs/{project}/{name}/steps/{split}/{step}/trajectories/{index}/tokens")
    def tokens(project: str, name: str, split: str, step: str, index: str):
        def read():
            directory = run_dir(root, project, name)
            return trajectory_tokens(
                directory, validate_name(split, "split"), parse_index(step, "step"), parse_index(index, "index")
            )

        return _answer(read)

    return router


def _answer(read):
    """`read()`'s result, or the 400/404 its error stands for (the server's one mapping)."""
    try:
        return read()
    except (ModelNotFoundError, ArtValueError) as exc:
        return error_response(error_object(exc, "dashboard"))


def _error(status: int, message: str, param: str | None) -> JSONResponse:
    return error_response(
        {"status": status, "message": message, "type": "invalid_request_error", "param": param, "code": None}
    )
