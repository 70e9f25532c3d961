"""The dashboard page in headless Chromium, over the run tests/dashboard/conftest.py trains:
curves, samples, trained tokens, a new step without reload, links and screenshots."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from art.dashboard.app import create_dashboard_app
from art.server.thread import ServerThread
from tests.support.dashboard_run import KEY, get, train_step

SHOTS = os.environ.get("ART_DASHBOARD_SHOTS")
"""A folder to copy the browser test's screenshots to (they are always saved under tmp_path)."""


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
