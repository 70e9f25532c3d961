"""The dashboard (`art dashboard`, /dashboard on `art serve`) over a run folder written by real
training: its JSON API through a real loopback server and its auth on `art serve`. The page
itself in headless Chromium: test_dashboard_page.py."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from art.cli import main as cli_main
from art.dashboard.runs import TRAINING_WINDOW_S, list_runs
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service.local import LocalService
from art.storage.history import row_split
from tests.support.dashboard_run import AS_BROWSER, KEY, get

@pytest.mark.integration
def test_runs_history_and_steps(run, dashboard):
    root = run[2]
    page = get(f"{dashboard}/dashboard")
    assert page.status_code == 200 and "/dashboard/static/uPlot.iife.min.js" in page.text
    assert get(f"{dashboard}/dashboard/static/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot")
    history_rows = [json.loads(line) for line in (root / "dash" / "models" / "tiny" / "history.jsonl").open()]

    (listed,) = get(f"{dashboard}/dashboard/api/runs").json()["runs"]
    assert (listed["project"], listed["name"], listed["step"], listed["trainable"]) == ("dash", "tiny", 2, True)
    assert listed["reward"] == history_rows[1]["train/reward"] and listed["reward_step"] == 1

    history = get(f"{dashboard}/dashboard/api/runs/dash/tiny/history").json()
    assert [(r["step"], row_split(r)) for r in history["rows"]] == [(0, "train"), (1, "train"), (2, "val")]
    assert not any("split" in r for r in history["rows"])  # ART's readers allow only its keys
    assert all("train/reward" in r and "train/loss" in r for r in history["rows"][:2])
    again = get(f"{dashboard}/dashboard/api/runs/dash/tiny/history", params={"since": history["next"]}).json()
    assert again == {"rows": [], "next": history["next"], "reset": False}
    replaced = get(f"{dashboard}/dashboard/api/runs/dash/tiny/history", params={"since": history["next"] + 10}).json()
    assert replaced["reset"] and len(replaced["rows"]) == 3

    assert get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps").json() == {"train": [0, 1], "val": [2]}


@pytest.mark.integration
def test_a_steps_groups_trajectories_and_advantages(run, dashboard):
    step = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/train/1").json()
    assert [len(g["trajectories"]) for g in step["groups"]] == [4, 4] and step["scale_rewards"] is True
    for group in step["groups"]:
        rewards = [t["reward"] for t in group["trajectories"]]
        mean = sum(rewards) / 4
        std = (sum((r - mean) ** 2 for r in rewards) / 4) ** 0.5
        assert rewards == [0.0, 1.0, 0.0, 1.0] and not group["zero_variance"] and group["exceptions"] == []
        assert [t["advantage"] for t in group["trajectories"]] == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    first = step["groups"][0]["trajectories"][0]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
    assert first["messages"][1]["choice"] and first["messages"][1]["trained"] and first["metrics"]["tokens"] >= 1

    val = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/val/2").json()
    (group,) = val["groups"]
    assert group["zero_variance"] and [t["advantage"] for t in group["trajectories"]] == [0.0, 0.0]
    (exception,) = group["exceptions"]
    assert exception["type"] == "RuntimeError" and exception["message"] == "the tool crashed"
    messages = group["trajectories"][0]["messages"]
    assert messages[1]["tool_calls"] == [{"id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert messages[2]["role"] == "tool" and messages[2]["tool_call_id"] == "call_1" and messages[2]["content"] == "rain"


@pytest.mark.integration
def test_token_rows_carry_trained_flags_advantages_and_both_logprobs(run, dashboard):
    """The trainer's logprobs are the ones the training step recorded; the sampler and the
    trainer hold the same weights at that step, so on the CPU they agree closely."""
    root = run[2]
    lines = (root / "dash" / "models" / "tiny" / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()
    logged = json.loads(lines[1])
    choice = logged["messages_and_choices"][-1]
    step = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/train/1").json()
    advantage = step["groups"][0]["trajectories"][1]["advantage"]
    assert advantage > 0

    tokens = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/train/1/trajectories/1/tokens").json()
    trained = [t for t in tokens["tokens"] if t["trained"]]
    assert [t["id"] for t in trained] == choice["token_ids"] and tokens["trained_tokens"] == len(trained)
    assert [t["sampler_logprob"] for t in trained] == pytest.approx([c["logprob"] for c in choice["logprobs"]["content"]])
    assert all(t["advantage"] == pytest.approx(advantage) for t in trained)
    context = [t for t in tokens["tokens"] if not t["trained"]]
    assert context and all(t["advantage"] == 0.0 for t in context)
    assert [t["trainer_logprob"] for t in trained] == pytest.approx([t["sampler_logprob"] for t in trained], abs=2e-3)
    assert all(t["trainer_logprob"] is None for t in context) and tokens["trainer_logprob_note"] is None
    recorded = root / "dash" / "models" / "tiny" / "trajectories" / "train" / "0001.trainer_logprobs.jsonl"
    row = next(r for r in map(json.loads, recorded.read_text().splitlines()) if (r["group"], r["trajectory"]) == (0, 1))
    assert [v for v in row["logprobs"] if v is not None] == [t["trainer_logprob"] for t in trained]
    val = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/val/2/trajectories/0/tokens")
    assert val.status_code == 200 and "no trainer logprobs" in val.json()["trainer_logprob_note"]  # not trained
    assert tokens["has_text"] and "".join(t["text"] for t in context).count("Pick a token.") == 1


@pytest.mark.integration
@pytest.mark.parametrize("path, field", [
    ("/runs/a%5Cb/tiny/history", "project"),
    ("/runs/%2E%2E/tiny/history", "project"),
    ("/runs/dash/ti%20ny/history", "name"),
    ("/runs/dash/tiny/history?since=-1", "since"),
    ("/runs/dash/tiny/history?since=ten", "since"),
    ("/runs/dash/tiny/steps/%2E%2E/1", "split"),
    ("/runs/dash/tiny/steps/.hidden/1", "split"),
    ("/runs/dash/tiny/steps/train/one", "step"),
    ("/runs/dash/tiny/steps/train/-1", "step"),
    ("/runs/dash/tiny/steps/train/1/trajectories/x/tokens", "index"),
])
def test_bad_input_is_a_400_naming_the_field(dashboard, path, field):
    response = get(f"{dashboard}/dashboard/api{path}")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/api/runs/dash/nope/history", "/api/runs/dash/tiny/steps/train/7",
                                  "/api/runs/dash/tiny/steps/train/1/trajectories/8/tokens", "/static/..%2Froutes.py",
                                  "/api/runs/..%2F..%2Fetc/tiny/history", "/api/runs/dash/tiny/steps/..%2F..%2F/1",
                                  "/static/routes.py"])
def test_what_does_not_exist_is_a_404(dashboard, path):
    response = get(f"{dashboard}/dashboard{path}")
    assert response.status_code == 404, response.text


@pytest.mark.integration
def test_art_serve_puts_the_dashboard_behind_its_key(keyed):
    for path in ("/dashboard", "/dashboard/api/runs", "/dashboard/static/dashboard.js"):
        assert get(keyed + path).status_code == 401
        assert get(keyed + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = get(keyed + "/dashboard/api/runs", headers={"Authorization": f"Bearer {KEY}"})
    assert [(r["project"], r["name"]) for r in answer.json()["runs"]] == [("dash", "tiny")]
    assert "/dashboard" not in get(keyed + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]


def login_cookie(response: httpx.Response) -> tuple[str, set[str]]:
    """The `art_dashboard` cookie's value and its attributes, from a login's Set-Cookie."""
    first, *attributes = [part.strip() for part in response.headers["set-cookie"].split(";")]
    name, _, value = first.partition("=")
    assert name == "art_dashboard", response.headers["set-cookie"]
    return value, set(attributes)


@pytest.mark.integration
def test_without_a_credential_the_page_is_a_login_form_and_the_api_stays_json(keyed):
    for path in ("/dashboard", "/dashboard/"):
        form = get(keyed + path, headers=AS_BROWSER)
        assert form.status_code == 401 and form.headers["content-type"].startswith("text/html")
        assert '<form method="post" action="/dashboard/login">' in form.text
        assert 'name="key" type="password"' in form.text
        # Self-contained: nothing loaded from anywhere, no script.
        assert "src=" not in form.text and "href=" not in form.text and "<script" not in form.text
        assert "default-src 'none'" in form.headers["content-security-policy"]
    for path, headers in (("/dashboard", {}), ("/dashboard/api/runs", AS_BROWSER),
                          ("/dashboard/static/dashboard.js", AS_BROWSER), ("/dashboard/nowhere", AS_BROWSER)):
        answer = get(keyed + path, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", path
    bookmarked = get(keyed + "/dashboard/login", headers=AS_BROWSER)  # a GET of the form's URL: to the page
    assert bookmarked.status_code == 303 and bookmarked.headers["location"] == "/dashboard/"


@pytest.mark.integration
def test_the_login_form_sets_a_cookie_that_opens_the_dashboard_only(keyed):
    wrong = httpx.post(keyed + "/dashboard/login", data={"key": "dash-kez"}, timeout=30)
    assert wrong.status_code == 401 and "wrong key" in wrong.text and "set-cookie" not in wrong.headers
    assert 'action="/dashboard/login"' in wrong.text  # the form again, to try once more
    missing = httpx.post(keyed + "/dashboard/login", data={"other": KEY}, timeout=30)
    assert missing.status_code == 401 and "`key`" in missing.text and "set-cookie" not in missing.headers

    right = httpx.post(keyed + "/dashboard/login", data={"key": KEY}, timeout=30)
    assert right.status_code == 303 and right.headers["location"] == "/dashboard/"
    token, attributes = login_cookie(right)
    assert {"HttpOnly", "SameSite=Strict", "Path=/dashboard"} <= attributes and "Secure" not in attributes  # http
    assert len(token) == 64 and KEY not in token  # an HMAC of the key, not the key

    cookie = {"Cookie": f"art_dashboard={token}"}
    for path in ("/dashboard", "/dashboard/", "/dashboard/static/dashboard.js", "/dashboard/api/runs/dash/tiny/steps"):
        assert get(keyed + path, headers={**AS_BROWSER, **cookie}).status_code == 200, path
    page = get(keyed + "/dashboard/", headers={**AS_BROWSER, **cookie})
    assert 'action="/dashboard/logout"' in page.text  # the log-out button
    runs = get(keyed + "/dashboard/api/runs", headers=cookie).json()["runs"]
    assert [(r["project"], r["name"]) for r in runs] == [("dash", "tiny")]

    # The cookie opens /dashboard and nothing else; the token is no API key either.
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/art/models"),
                         ("GET", "/art/models/dash/tiny/step"), ("GET", "/openapi.json"), ("GET", "/dashboardx")):
        for headers in (cookie, {"Authorization": f"Bearer {token}"}):
            answer = httpx.request(method, keyed + path, headers=headers, json={"model": "x"}, timeout=30)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert get(keyed + "/health", headers=cookie).json() == {"status": "ok"}  # no details without the key
    assert get(keyed + "/dashboard/..%2F..%2Fv1/models", headers=cookie).status_code == 404
    assert get(keyed + "/dashboard/api/runs", headers={"Cookie": f"art_dashboard={KEY}"}).status_code == 401


@pytest.mark.integration
def test_logout_clears_the_cookie(keyed):
    with httpx.Client(base_url=keyed, headers=AS_BROWSER, timeout=30) as browser:  # keeps cookies as a browser does
        assert browser.post("/dashboard/login", data={"key": KEY}).status_code == 303
        assert browser.get("/dashboard/api/runs").status_code == 200
        out = browser.post("/dashboard/logout")
        assert out.status_code == 303 and out.headers["location"] == "/dashboard/"
        value, attributes = login_cookie(out)
        assert value == "" and {"Max-Age=0", "Path=/dashboard"} <= attributes
        assert not browser.cookies
        assert browser.get("/dashboard/api/runs").status_code == 401
        assert "/dashboard/login" in browser.get("/dashboard/").text


@pytest.mark.integration
def test_the_key_never_travels_in_the_url_and_the_login_body_is_bounded(keyed):
    for method, path in (("GET", f"/dashboard?key={KEY}"), ("GET", f"/dashboard/api/runs?key={KEY}"),
                         ("POST", f"/dashboard/login?key={KEY}")):
        answer = httpx.request(method, keyed + path, headers=AS_BROWSER, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "credentials_in_url", path
    big = httpx.post(keyed + "/dashboard/login", data={"key": KEY, "pad": "x" * 10_000}, timeout=30)
    assert big.status_code == 413 and "set-cookie" not in big.headers


@pytest.mark.integration
async def test_the_cookie_is_secure_when_the_login_came_over_https(run):
    local = LocalService(str(run[2]))
    app = create_serve_app(local, api_key=KEY, watchdog_s=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="https://testserver") as client:
        for path in ("/dashboard/login", "/dashboard/logout"):
            _, attributes = login_cookie(await client.post(path, data={"key": KEY}))
            assert "Secure" in attributes, path


@pytest.mark.integration
def test_without_a_key_there_is_no_login(run):
    local = LocalService(str(run[2]))
    with ServerThread(create_serve_app(local, watchdog_s=None)) as server:
        page = get(server.base_url + "/dashboard", headers=AS_BROWSER)
        assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
        assert "logout" not in page.text
        assert httpx.post(server.base_url + "/dashboard/login", data={"key": KEY}).status_code in (404, 405)


@pytest.mark.integration
def test_local_backends_own_server_serves_the_dashboard(run):
    backend = run[0]
    runs = get(f"{backend.server_url}/dashboard/api/runs").json()["runs"]
    assert [(r["project"], r["name"], r["step"]) for r in runs] == [("dash", "tiny", 2)]


@pytest.mark.integration
def test_status_is_training_while_a_checkpoint_is_written_or_history_grows(tmp_path):
    run_dir = tmp_path / "p" / "models" / "m"
    (run_dir / "checkpoints" / "0000").mkdir(parents=True)
    (run_dir / "model.json").write_text(json.dumps({"base_model": "x"}))
    (run_dir / "history.jsonl").write_text(json.dumps({"step": 0, "split": "train", "train/reward": 0.25}) + "\n")
    (tmp_path / "p" / "models" / "baseline").mkdir()  # a folder with neither file: not a run
    now = time.time()
    old = now - TRAINING_WINDOW_S - 5
    os.utime(run_dir / "history.jsonl", (old, old))
    (run,) = list_runs(tmp_path, now=now)
    assert (run["status"], run["step"], run["reward"]) == ("idle", 0, 0.25)
    assert list_runs(tmp_path, now=old + 1)[0]["status"] == "training"  # history appended a second ago
    (run_dir / "checkpoints" / ".tmp-0001-abc").mkdir()
    assert list_runs(tmp_path, now=now)[0]["status"] == "training"


def test_the_dashboard_command_refuses_other_interfaces(capsys):
    assert cli_main(["dashboard", "--host", "0.0.0.0", "--path", "nowhere"]) == 2
    assert "SSH tunnel" in capsys.readouterr().err
