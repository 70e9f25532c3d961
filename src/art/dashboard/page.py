"""The dashboard's HTML shell: the layout and the root it shows; `static/dashboard.js` fills it.

Everything the page loads is served by the dashboard itself (uPlot is vendored under
`static/`), so it works on a machine with no internet. Asset URLs carry the files' modification
times, so a browser never runs a stale script after an upgrade. On a keyed `art serve` the header
has a log-out button (the login itself is `login_page`).
"""

from __future__ import annotations

import html
from pathlib import Path

STATIC = Path(__file__).parent / "static"


def _asset(name: str) -> str:
    return f"/dashboard/static/{name}?v={int((STATIC / name).stat().st_mtime)}"


LOGOUT_FORM = (
    '<form class="logout" method="post" action="/dashboard/logout"><button type="submit">log out</button></form>'
)
"""A form, not a script: the cookie is HttpOnly, and posting needs no JavaScript."""


MAIN = """<main>
  <aside>
    <h2>Runs</h2>
    <table id="runs"><thead><tr><th></th><th>run</th><th>step</th><th>reward</th><th>status</th></tr></thead>
      <tbody></tbody></table>
    <p id="no-runs" class="muted" hidden>No runs under this folder yet: train a model with
      <code>art.LocalBackend(path=...)</code> pointing here.</p>
  </aside>
  <section id="charts">
    <div class="controls">
      <label>x axis <select id="xmode"><option value="step">step</option>
        <option value="time">wall-clock</option></select></label>
      <label>metric <select id="metric"></select></label>
    </div>
    <div class="chart-box"><h3>reward (mean &plusmn; std within groups)</h3>
      <div id="chart-reward" class="chart" data-points="0"></div></div>
    <div class="chart-box"><h3>loss</h3><div id="chart-loss" class="chart" data-points="0"></div></div>
    <div class="chart-box"><h3 id="metric-title">metric</h3>
      <div id="chart-metric" class="chart" data-points="0"></div></div>
  </section>
  <section id="samples">
    <h2>Samples <span id="samples-run" class="muted"></span></h2>
    <div class="controls">
      <label>split <select id="split"></select></label>
      <span class="filters">show
        <button data-filter="all" class="on">all</button><button data-filter="best">best</button><button
        data-filter="worst">worst</button><button data-filter="exceptions">exceptions</button><button
        data-filter="zero">zero-variance groups</button></span>
    </div>
    <div id="steps" class="steps"></div>
    <div id="groups"></div>
  </section>
  <section id="tokens" hidden>
    <h2>Tokens <span id="tokens-title" class="muted"></span> <button id="tokens-close">close</button></h2>
    <p class="legend"><span class="tok pos">trained, advantage &gt; 0</span> <span class="tok neg">trained,
      advantage &lt; 0</span> <span class="tok zero">trained, advantage 0</span> <span class="tok ctx">not
      trained</span>. Hover a token for its sampler logprob, the trainer's (recorded by the training
      step) and their difference: a large difference means the trainer does not see what the sampler
      sampled from.</p>
    <div id="token-text" class="token-text"></div>
  </section>
</main>"""
"""The page's body: the runs table, the charts, the samples and the token view (static; the script fills them)."""


def render(root: Path, *, logout: bool = False) -> str:
    where = html.escape(str(Path(root).resolve()))
    logout_form = LOGOUT_FORM if logout else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>art dashboard</title>
<link rel="stylesheet" href="{_asset("uPlot.min.css")}">
<link rel="stylesheet" href="{_asset("dashboard.css")}">
</head>
<body>
<header>
  <h1>art dashboard</h1>
  <span class="root" title="storage root">{where}</span>
  <span id="updated" class="muted"></span>
  {logout_form}
</header>
{MAIN}
<script src="{_asset("uPlot.iife.min.js")}"></script>
<script src="{_asset("dashboard.js")}"></script>
</body>
</html>
"""
