"""The form a browser gets instead of the dashboard on a keyed `art serve`: one password field for
the server's API key, posted to /dashboard/login (`art.dashboard.login` checks it).

The page is one self-contained document (inline styles, no script, nothing fetched), so it works
offline and under the strict Content-Security-Policy it is served with.
"""

from __future__ import annotations

import html

LOGIN_ACTION = "/dashboard/login"


def render(message: str | None = None) -> str:
    """The login form, with `message` (e.g. "wrong key") above the field when there is one."""
    notice = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>art dashboard: log in</title>
<style>
  body {{ margin: 0; min-height: 100vh; display: grid; place-items: center; background: #fafafa;
         color: #18181b; font: 14px system-ui, sans-serif; }}
  form {{ background: #fff; border: 1px solid #d4d4d8; border-radius: 6px; padding: 1.5rem; width: 20rem; }}
  h1 {{ font-size: 1.1rem; margin: 0 0 0.5rem; }}
  p {{ margin: 0 0 1rem; color: #71717a; }}
  .error {{ color: #b91c1c; font-weight: 600; }}
  label {{ display: block; margin-bottom: 0.25rem; }}
  input, button {{ font: inherit; box-sizing: border-box; width: 100%; padding: 6px 8px; border-radius: 4px;
                  border: 1px solid #d4d4d8; }}
  button {{ margin-top: 0.75rem; background: #1d4ed8; color: #fff; border-color: #1d4ed8; cursor: pointer; }}
</style>
</head>
<body>
<form method="post" action="{LOGIN_ACTION}">
  <h1>art dashboard</h1>
  <p>This server has an API key. Enter it to see the runs.</p>
  {notice}
  <label for="key">API key</label>
  <input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
  <button type="submit">Log in</button>
</form>
</body>
</html>
"""
