"""The dashboard (`art dashboard`, /dashboard on `art serve`) over a run folder written by real
training: its JSON API through a real loopback server, its auth on `art serve`, and the page
itself in headless Chromium (curves, samples, trained tokens, a new step without reload)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

import art
from art.cli import main as cli_main
from art.dashboard.app import create_dashboard_app
from art.dashboard.runs import TRAINING_WINDOW_S, list_runs
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service.local import LocalService
from art.storage.history import row_split

SHOTS = os.environ.get("ART_DASHBOARD_SHOTS")
"""A folder to copy the browser test's screenshots to (they are always saved under tmp_path)."""


LONG_CONTEXT_LINES = 60
"""Group 1's prompt has this many lines of rules: its trained tokens lie below the token view's fold."""


async def rollout(model: art.TrainableModel, seed: int, rules: int = 0) -> art.Trajectory:
    prompt = "Pick a token." + "".join(f"\nrule {i}" for i in range(rules))
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed)
    # Alternating rewards: every group has a spread, so every trained token has an advantage.
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=float(seed % 2),
                          metrics={"tokens": len(completion.choices[0].token_ids)},
                          metadata={"scenario": f"game {seed}", "secret": seed % 7})


async def train_step(model: art.TrainableModel, step: int) -> None:
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i, rules=LONG_CONTEXT_LINES * g)
                             for i in range(4)) for g in range(2)],
        pbar_desc=None)
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


@pytest.fixture(scope="module")
async def run(tiny_model_path, tmp_path_factory):
    """Two training steps of dash/tiny, and a val step whose group had a failed rollout and equal
    rewards; the backend stays open so a test can train a third step while the page is open."""
    root = tmp_path_factory.mktemp("runs")
    backend = art.LocalBackend(path=str(root))
    model = art.TrainableModel(name="tiny", project="dash", base_model=str(tiny_model_path))
    await model.register(backend)
    for step in range(2):
        await train_step(model, step)
    tool_turn = [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    await model.log([art.TrajectoryGroup([art.Trajectory(messages_and_choices=tool_turn, reward=0.5) for _ in range(2)],
                                         exceptions=[RuntimeError("the tool crashed")])], split="val")
    yield backend, model, root
    await backend.close()


@pytest.fixture(scope="module")
def dashboard(run):
    with ServerThread(create_dashboard_app(run[2])) as server:
        yield server.base_url


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=30, **kwargs)


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


KEY = "dash-key"
AS_BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
"""What a browser's Accept says when it opens a page."""


@pytest.fixture(scope="module")
def keyed(run):
    """`art serve --api-key dash-key` over the test's runs, on a loopback port."""
    local = LocalService(str(run[2]))
    with ServerThread(create_serve_app(local, api_key=KEY, watchdog_s=None)) as server:
        yield server.base_url


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


# -- the page in a browser ------------------------------------------------------------------


def chromium():
    """A headless Chromium driver, or a skip saying what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium / chromium-driver are not installed (scripts/setup.sh --tests installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1700"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def browser_helpers(browser, folder: Path, shots: list[Path]):
    """shoot(name): a screenshot into `folder` (listed in `shots`); wait_for(condition, what):
    poll until `condition()` is truthy, failing with `what` after 60 s; an element that went
    stale or missing while the page changed counts as not yet."""
    from selenium.common.exceptions import (NoSuchElementException, StaleElementReferenceException,
                                            WebDriverException)
    from selenium.webdriver.support.ui import WebDriverWait

    def shoot(name: str) -> None:
        shots.append(folder / f"{name}.png")
        browser.save_screenshot(str(shots[-1]))

    def settled(condition):
        # Chrome reports an element of a page being replaced (a form just submitted) either as stale
        # or as a node that "does not belong to the document": both mean not yet.
        try:
            return condition()
        except WebDriverException as error:
            if "does not belong to the document" in str(error):
                return False
            raise

    def wait_for(condition, what: str):
        return WebDriverWait(browser, 60, poll_frequency=0.2,
                             ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                             ).until(lambda _: settled(condition), message=what)

    return shoot, wait_for


def keep(shots: list[Path]) -> None:
    """Copy the screenshots to `ART_DASHBOARD_SHOTS`, when set."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            shutil.copy(shot, Path(SHOTS) / shot.name)


@pytest.mark.integration
async def test_the_page_shows_curves_samples_tokens_and_a_new_step_live(run, dashboard, tmp_path):
    from selenium.webdriver.common.by import By

    model = run[1]
    browser = chromium()
    shots: list[Path] = []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)

    def points(chart: str) -> int:
        return int(browser.find_element(By.ID, chart).get_attribute("data-points"))

    try:
        browser.get(f"{dashboard}/dashboard")
        row = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-run="dash/tiny"]'), "the run is listed")
        assert "idle" in row[0].text or "training" in row[0].text
        wait_for(lambda: points("chart-reward") == 2, "the reward curve has one point per step")
        assert points("chart-loss") == 2
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-reward canvas")
        shoot("curves")

        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '#steps button[data-step="1"]'), "step 1 is listed")
        browser.find_element(By.CSS_SELECTOR, '#steps button[data-step="1"]').click()
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#groups .trajectory")) == 8, "8 trajectories")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .group")) == 2
        browser.find_element(By.CSS_SELECTOR, '.filters button[data-filter="best"]').click()
        best = browser.find_elements(By.CSS_SELECTOR, "#groups .trajectory")
        assert [b.get_attribute("data-reward") for b in best] == ["1", "1"]
        browser.find_element(By.CSS_SELECTOR, '.filters button[data-filter="all"]').click()
        shoot("samples")

        browser.find_element(By.CSS_SELECTOR, '.trajectory[data-index="1"] .show-tokens').click()
        trained = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '#token-text .tok[data-trained="1"]'),
                           "trained tokens are shown")
        assert all(t.get_attribute("class") == "tok pos" for t in trained)
        colour = trained[0].value_of_css_property("background-color")
        assert colour.startswith("rgba(22, 163, 74"), colour  # green: positive advantage
        context = browser.find_elements(By.CSS_SELECTOR, '#token-text .tok[data-trained="0"]')
        assert context and context[0].value_of_css_property("background-color") == "rgba(0, 0, 0, 0)"
        title = trained[0].get_attribute("title")  # the hover: sampler, trainer and their difference
        assert re.search(r"sampler logprob -?\d+\.\d{4}\ntrainer logprob -?\d+\.\d{4}\ndifference .* -?\d\.\d{5}",
                         title), title
        assert "|trainer − sampler| logprob mean" in browser.find_element(By.ID, "tokens-title").text
        browser.execute_script("document.getElementById('tokens').scrollIntoView()")
        shoot("tokens")

        browser.execute_script("window.scrollTo(0, 0); window.__noReload = true")
        await train_step(model, 2)  # while the page is open
        wait_for(lambda: points("chart-reward") == 3, "the new step is drawn")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '#steps button[data-step="2"]'), "step 2 is listed")
        assert browser.execute_script("return window.__noReload") is True  # the same page, not reloaded
        shoot("live")
    finally:
        browser.quit()
        keep(shots)



@pytest.mark.integration
def test_a_browser_logs_in_to_a_keyed_server_with_the_form(keyed, tmp_path):
    from selenium.webdriver.common.by import By

    browser = chromium()
    shots: list[Path] = []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)

    def log_in(key: str) -> None:
        field = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, 'input[name="key"][type="password"]'),
                         "the login form is shown")[0]
        field.send_keys(key)
        browser.find_element(By.CSS_SELECTOR, 'button[type="submit"]').click()

    try:
        browser.get(f"{keyed}/dashboard")
        log_in("not-the-key")
        wait_for(lambda: "wrong key" in browser.find_element(By.TAG_NAME, "body").text, "a wrong key is named")
        shoot("login-wrong-key")
        log_in(KEY)
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-run="dash/tiny"]'), "the run is listed")
        assert browser.current_url.split("#")[0] == f"{keyed}/dashboard/"  # the fragment holds the place shown
        (cookie,) = browser.get_cookies()
        assert cookie["name"] == "art_dashboard" and cookie["httpOnly"] and KEY not in cookie["value"]
        shoot("logged-in")
        browser.find_element(By.CSS_SELECTOR, "form.logout button").click()
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, 'input[name="key"]'), "logged out: the form again")
        assert not browser.get_cookies()
    finally:
        browser.quit()
        keep(shots)


# -- what a new user met in the browser (issue 26) --------------------------------------------

LONG_RUN = "guess-the-number/qwen2.5-3b-instruct-grpo-lr1e-5-run-042"
"""A run named as users name them: longer than the runs column was wide."""
EVALS_RUN = "logged/evals"


@pytest.fixture(scope="module")
def crowded(run, tmp_path_factory):
    """A dashboard over three runs: dash/tiny, the same run under LONG_RUN, and, the newest, an
    evaluation logged from elsewhere (a history of val rows only, in ART's metric taxonomy)."""
    root = tmp_path_factory.mktemp("crowded")
    source = run[2] / "dash" / "models" / "tiny"
    for key in ("dash/tiny", LONG_RUN):
        project, name = key.split("/")
        shutil.copytree(source, root / project / "models" / name)  # keeps the files' times: older
    evals = root / "logged" / "models" / "evals"
    evals.mkdir(parents=True)
    rows = [{"step": s, "split": "val", "recorded_at": time.time(), "training_step": s, "val/reward": 0.25 * s,
             "data/step_num_trajectories": 4, "time/step_wall_s": 1.5, "time/cum/wall_s": 1.5 * (s + 1)}
            for s in range(3)]
    (evals / "history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with ServerThread(create_dashboard_app(root)) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def page_browser():
    """One headless Chromium for the tests below; each opens the page afresh."""
    browser = chromium()
    yield browser
    browser.quit()


def open_page(browser, url: str) -> None:
    """A fresh load even when only the URL's fragment differs from the page shown."""
    browser.get("about:blank")
    browser.get(url)


def fragment(browser) -> dict[str, str]:
    """The page's URL state: its fragment's parameters."""
    from urllib.parse import parse_qsl, urlsplit

    return dict(parse_qsl(urlsplit(browser.current_url).fragment))


def show_step(browser, wait_for, step: int) -> None:
    """Click a train step's button and wait until its groups replace those shown before."""
    from selenium.webdriver.common.by import By

    button = f'#steps button[data-step="{step}"]'
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, button), f"step {step} is listed")
    browser.find_element(By.CSS_SELECTOR, button).click()
    wait_for(lambda: f"train step {step}:" in browser.find_element(By.ID, "groups").text, f"step {step} is shown")


UNSEEN_CELLS = """
const unseen = [];
for (const cell of document.querySelectorAll('#runs th, #runs td')) {
  const range = document.createRange();
  range.selectNodeContents(cell);
  const boxes = [...range.getClientRects()].filter((r) => r.width > 0 && r.height > 0);
  const hidden = (x, y) => {
    if (x < 0 || y < 0 || x > innerWidth || y > innerHeight) return true;
    const hit = document.elementFromPoint(x, y);
    return !hit || !cell.contains(hit);
  };
  const covered = boxes.some((r) => hidden(r.left + 1, r.top + r.height / 2) || hidden(r.right - 1, r.top + r.height / 2));
  if (covered || cell.scrollWidth > cell.clientWidth) unseen.push(cell.textContent.trim() || cell.innerHTML);
}
return unseen;
"""
"""The Runs table's cells whose content is cut off, outside the window or covered by another element."""


@pytest.mark.integration
@pytest.mark.parametrize("width, height", [(1400, 900), (1920, 1080)])
def test_the_runs_table_shows_every_column_whole(crowded, page_browser, tmp_path, width, height):
    from selenium.webdriver.common.by import By

    browser, shots = page_browser, []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)
    reward = next(r["reward"] for r in get(f"{crowded}/dashboard/api/runs").json()["runs"]
                  if f"{r['project']}/{r['name']}" == LONG_RUN)
    try:
        browser.set_window_size(width, height)
        open_page(browser, f"{crowded}/dashboard")
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")) == 3, "three runs are listed")
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{LONG_RUN}"]')
        assert row.find_elements(By.TAG_NAME, "td")[3].text == f"{reward:.3f}"  # every digit
        shoot(f"runs-{width}")
        assert browser.execute_script(UNSEEN_CELLS) == []
    finally:
        browser.set_window_size(1400, 1700)
        keep(shots)


@pytest.mark.integration
def test_a_trajectory_shows_its_metadata(run, dashboard, page_browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser, shots = page_browser, []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)
    try:
        open_page(browser, f"{dashboard}/dashboard")
        show_step(browser, wait_for, 1)
        shown = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '.trajectory[data-index="1"] .metadata'),
                         "trajectory 1 shows its metadata")
        text = shown[0].text  # seed 101: step 1, group 0, member 1
        assert "scenario" in text and "game 101" in text and "secret" in text and "3" in text, text
        shoot("metadata")
    finally:
        keep(shots)


@pytest.mark.integration
def test_the_metric_chart_opens_on_the_reward(dashboard, crowded, page_browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser = page_browser
    _, wait_for = browser_helpers(browser, Path("."), [])

    def chart_metric() -> str | None:
        return browser.find_element(By.ID, "chart-metric").get_attribute("data-metric")

    open_page(browser, f"{dashboard}/dashboard")
    wait_for(lambda: chart_metric() == "train/reward", "the metric chart opens on train/reward")
    select = Select(browser.find_element(By.ID, "metric"))
    assert select.first_selected_option.get_attribute("value") == "train/reward"
    names = [o.get_attribute("value") for o in select.options]
    assert "train/loss" in names and "data/step_num_trajectories" in names and "training_step" not in names
    select.select_by_value("train/loss")  # the rest stay pickable
    wait_for(lambda: chart_metric() == "train/loss", "the picked metric is drawn")
    assert int(browser.find_element(By.ID, "chart-metric").get_attribute("data-points")) >= 2

    open_page(browser, f"{crowded}/dashboard")  # the newest run there logged val rows only
    wait_for(lambda: chart_metric() == "val/reward", "without train/reward, the chart opens on val/reward")


@pytest.mark.integration
def test_samples_open_on_the_latest_step(dashboard, page_browser):
    from selenium.webdriver.common.by import By

    browser = page_browser
    _, wait_for = browser_helpers(browser, Path("."), [])
    latest = max(get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps").json()["train"])
    open_page(browser, f"{dashboard}/dashboard")
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#groups .trajectory")) == 8,
             "the latest step's trajectories are shown without a click")
    assert browser.find_element(By.CSS_SELECTOR, "#steps button.on").get_attribute("data-step") == str(latest)
    assert f"train step {latest}:" in browser.find_element(By.ID, "groups").text


@pytest.mark.integration
def test_the_url_links_a_run_split_step_and_trajectory(dashboard, crowded, page_browser, tmp_path):
    from urllib.parse import urlencode

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser, shots = page_browser, []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)

    def step_on() -> str | None:
        buttons = browser.find_elements(By.CSS_SELECTOR, "#steps button.on")
        return buttons[0].get_attribute("data-step") if buttons else None

    def tokens_title() -> str:
        section = browser.find_element(By.ID, "tokens")
        return "" if section.get_attribute("hidden") else browser.find_element(By.ID, "tokens-title").text

    try:
        link = urlencode({"run": "dash/tiny", "split": "train", "step": 0, "trajectory": 5})
        open_page(browser, f"{dashboard}/dashboard#{link}")
        wait_for(lambda: "train step 0 · trajectory #5" in tokens_title(), "the linked trajectory's tokens are open")
        assert step_on() == "0" and "train step 0:" in browser.find_element(By.ID, "groups").text
        assert browser.find_elements(By.CSS_SELECTOR, '.trajectory.selected[data-index="5"]')
        shoot("linked")

        browser.find_element(By.CSS_SELECTOR, '#steps button[data-step="1"]').click()
        wait_for(lambda: fragment(browser) == {"run": "dash/tiny", "split": "train", "step": "1"}, "step 1 in the URL")
        wait_for(lambda: step_on() == "1" and tokens_title() == "", "step 1 shown, no trajectory open")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '.trajectory[data-index="2"] .show-tokens'), "step 1")
        browser.find_element(By.CSS_SELECTOR, '.trajectory[data-index="2"] .show-tokens').click()
        wait_for(lambda: fragment(browser).get("trajectory") == "2", "the opened trajectory in the URL")
        Select(browser.find_element(By.ID, "split")).select_by_value("val")
        wait_for(lambda: fragment(browser) == {"run": "dash/tiny", "split": "val", "step": "2"}, "val's latest step")
        wait_for(lambda: step_on() == "2" and "val step 2:" in browser.find_element(By.ID, "groups").text, "val shown")

        browser.back()  # back to train step 1 with trajectory 2 open
        wait_for(lambda: "train step 1 · trajectory #2" in tokens_title(), "back: trajectory 2 of step 1")
        assert step_on() == "1" and Select(browser.find_element(By.ID, "split")).first_selected_option.text == "train"
        browser.back()
        wait_for(lambda: step_on() == "1" and tokens_title() == "", "back: step 1, no trajectory")
        browser.back()
        wait_for(lambda: step_on() == "0" and "train step 0 · trajectory #5" in tokens_title(), "back: the link")
        browser.forward()
        wait_for(lambda: step_on() == "1" and tokens_title() == "", "forward: step 1")

        open_page(browser, f"{crowded}/dashboard#{urlencode({'run': LONG_RUN, 'split': 'train', 'step': 0})}")
        wait_for(lambda: browser.find_element(By.ID, "samples-run").text == LONG_RUN, "the linked run's samples")
        wait_for(lambda: step_on() == "0", "the linked run's step")
        assert browser.find_element(By.CSS_SELECTOR, "#runs tr.focus").get_attribute("data-run") == LONG_RUN
        shoot("linked-run")
        browser.find_element(By.CSS_SELECTOR, 'tr[data-run="dash/tiny"] a.run-name').click()
        wait_for(lambda: browser.find_element(By.ID, "samples-run").text == "dash/tiny", "a clicked run's samples")
        wait_for(lambda: fragment(browser).get("run") == "dash/tiny" and fragment(browser).get("step"), "its URL")
        browser.back()
        wait_for(lambda: browser.find_element(By.ID, "samples-run").text == LONG_RUN and step_on() == "0",
                 "back: the linked run and step")
    finally:
        keep(shots)


@pytest.mark.integration
def test_the_token_view_opens_at_the_first_trained_token(dashboard, page_browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser, shots = page_browser, []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)
    first_trained_in_view = """
        const box = document.getElementById('token-text');
        const first = box.querySelector('.tok[data-trained="1"]');
        if (!first || box.scrollHeight < 2 * box.clientHeight) return false;  // a long context
        const t = first.getBoundingClientRect(), b = box.getBoundingClientRect();
        return t.top >= b.top && t.bottom <= b.bottom && t.top >= 0 && t.bottom <= innerHeight;"""
    try:
        browser.set_window_size(1400, 900)
        open_page(browser, f"{dashboard}/dashboard")
        show_step(browser, wait_for, 1)
        browser.find_element(By.CSS_SELECTOR, '.trajectory[data-index="5"] .show-tokens').click()
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '#token-text .tok[data-trained="1"]'), "tokens shown")
        wait_for(lambda: browser.execute_script(first_trained_in_view), "the first trained token is in view")
        shoot("tokens-at-first-trained")
    finally:
        browser.set_window_size(1400, 1700)
        keep(shots)


# -- a linked trajectory (issue 45) -----------------------------------------------------------


def one_trajectory_link(base: str, step: int, index: int) -> str:
    return f"{base}/dashboard#run=dash/tiny&split=train&step={step}&trajectory={index}"


@pytest.mark.integration
def test_a_linked_trajectory_shows_its_messages_and_tokens_without_scrolling_the_document(
        dashboard, page_browser, tmp_path):
    """`&trajectory=0` opens step 0 with trajectory 0 marked, its messages and its tokens. The
    token view is scrolled to inside <main>, never by scrolling the document (a scrolled document
    is what Chromium's headless --screenshot draws blank)."""
    from selenium.webdriver.common.by import By

    browser, shots = page_browser, []
    shoot, wait_for = browser_helpers(browser, tmp_path, shots)
    step = get(f"{dashboard}/dashboard/api/runs/dash/tiny/steps/train/0").json()
    expected = step["groups"][0]["trajectories"][0]
    assert expected["index"] == 0
    try:
        open_page(browser, one_trajectory_link(dashboard, 0, 0))
        wait_for(lambda: "train step 0 · trajectory #0" in browser.find_element(By.ID, "tokens-title").text,
                 "the linked trajectory's tokens are open")
        (shown,) = browser.find_elements(By.CSS_SELECTOR, '.trajectory.selected[data-index="0"]')
        messages = shown.find_elements(By.CSS_SELECTOR, ".msg")
        assert len(messages) == len(expected["messages"]) >= 2
        for node, message in zip(messages, expected["messages"]):
            assert node.get_attribute("class").split()[1] == f"role-{message['role']}"
            assert node.find_element(By.TAG_NAME, "pre").get_attribute("textContent") == message["content"]
        assert browser.find_elements(By.CSS_SELECTOR, '#token-text .tok[data-trained="1"]')
        shoot("linked-trajectory-0")
        # The token view was brought into view by scrolling <main>; the document stayed at the top.
        assert browser.execute_script("return document.scrollingElement.scrollTop") == 0
        assert browser.execute_script("return document.querySelector('main').scrollTop") > 0
        assert browser.execute_script(
            "const r = document.getElementById('tokens').getBoundingClientRect(); return r.top < innerHeight")
    finally:
        keep(shots)


def headless_screenshot(url: str, path: Path, size: str = "1400,1700") -> list[str]:
    """The command line that takes a screenshot of the dashboard in headless Chromium, as root
    (--no-sandbox); --virtual-time-budget lets the page's fetches answer before the shot."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--virtual-time-budget=10000", f"--window-size={size}", f"--screenshot={path}", url]


@pytest.mark.integration
@pytest.mark.parametrize("index", [0, 5])
def test_a_headless_screenshot_of_a_linked_trajectory_is_not_blank(dashboard, tmp_path, index):
    """Issue 45: the one-trajectory link drew blank, three times in three, in `chromium --headless
    --screenshot` (the page had scrolled the document to the token view)."""
    import subprocess

    image = pytest.importorskip("PIL.Image", reason="Pillow (with matplotlib, the test extra) reads the shot")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (scripts/setup.sh --tests installs it)")
    shot = tmp_path / f"trajectory-{index}.png"
    done = subprocess.run(headless_screenshot(one_trajectory_link(dashboard, 1, index), shot),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    keep([shot])
    with image.open(shot) as png:
        pixels = png.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50, f"a blank screenshot: {colours[:5]}"
        # The header is drawn at the top (a blank shot is the page's background everywhere).
        top = pixels.crop((0, 0, 400, 40)).getcolors(maxcolors=1 << 16)
        assert top is None or len(top) > 5
