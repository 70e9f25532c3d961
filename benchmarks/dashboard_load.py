"""How fast the dashboard opens a long run: 1,000 steps x 32 trajectories, in headless Chromium.

    python benchmarks/dashboard_load.py [--steps 1000] [--groups 8] [--group-size 4] [--loads 3]

Synthesizes a run folder (history rows with 16 metrics, one trajectories file per step, each
trajectory a prompt and a 48-token sampled choice with logprobs), serves it with the
`art dashboard` app on loopback, and measures:
- server time of each API call the page makes (median of 5, over HTTP);
- in Chromium (Debian's chromium + chromedriver, selenium): the page's own timings per load,
  navigation start to the HTML's response end, to DOMContentLoaded, and to the reward curve drawn
  (`window.__dashboardRenderedAt`, set by dashboard.js once uPlot has drawn it); median of `loads`.
Goal: the curve drawn well under 1 s. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from _common import environment, table

METRICS = ["reward", "reward_std_dev", "exception_rate", "loss", "policy_loss", "kl", "entropy", "grad_norm",
           "clip_fraction", "learning_rate", "tokens", "trained_tokens", "num_groups", "skipped/zero_variance",
           "turns", "duration_s"]


def synthesize(root: Path, steps: int, groups: int, group_size: int, tokens: int = 48) -> Path:
    run = root / "bench" / "models" / "long"
    (run / "checkpoints").mkdir(parents=True)
    for step in range(0, steps + 1, 50):
        (run / "checkpoints" / f"{step:04d}").mkdir()
    (run / "model.json").write_text(json.dumps({"name": "long", "project": "bench", "base_model": "none/none"}))
    rng = random.Random(0)
    start = time.time() - steps * 30
    with open(run / "history.jsonl", "w") as history:
        for step in range(steps):
            reward = 1 - math.exp(-step / 300) + rng.gauss(0, 0.05)
            row = {"step": step, "split": "train", "recorded_at": start + 30 * step}
            row.update({f"train/{k}": rng.random() for k in METRICS})
            row["train/reward"] = reward
            history.write(json.dumps(row) + "\n")
    folder = run / "trajectories" / "train"
    folder.mkdir(parents=True)
    for step in range(steps):
        lines = []
        for g in range(groups):
            for _ in range(group_size):
                ids = [rng.randrange(49152) for _ in range(tokens)]
                choice = {"finish_reason": "length", "index": 0,
                          "message": {"role": "assistant", "content": " ".join(f"w{i}" for i in ids)},
                          "logprobs": {"content": [{"token": f"w{i}", "logprob": -rng.random(), "bytes": None,
                                                    "top_logprobs": []} for i in ids]},
                          "token_ids": ids, "prompt_token_ids": list(range(20))}
                lines.append(json.dumps({"messages_and_choices": [{"role": "user", "content": f"task {g}"}, choice],
                                         "reward": rng.random(), "metrics": {"turns": 1}, "group": g}))
        (folder / f"{step:04d}.jsonl").write_text("\n".join(lines) + "\n")
    return run


def server_times(base: str, steps: int) -> list[list]:
    calls = [("runs", "/dashboard/api/runs"), ("history (all rows)", "/dashboard/api/runs/bench/long/history"),
             ("steps list", "/dashboard/api/runs/bench/long/steps"),
             ("one step (32 trajectories)", f"/dashboard/api/runs/bench/long/steps/train/{steps - 1}"),
             ("tokens of one trajectory", f"/dashboard/api/runs/bench/long/steps/train/{steps - 1}/trajectories/0/tokens"),
             ("page HTML", "/dashboard")]
    rows = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for label, path in calls:
            times, size = [], 0
            for _ in range(5):
                t0 = time.perf_counter()
                response = client.get(path)
                times.append((time.perf_counter() - t0) * 1000)
                response.raise_for_status()
                size = len(response.content)
            rows.append([label, statistics.median(times), size / 1024])
    return rows


def browser_loads(base: str, loads: int) -> list[dict]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    out = []
    try:
        for _ in range(loads):
            browser.get("about:blank")
            browser.get(f"{base}/dashboard")
            WebDriverWait(browser, 60, poll_frequency=0.05).until(
                lambda b: b.execute_script("return window.__dashboardRenderedAt !== undefined"))
            timing = browser.execute_script("""
                const nav = performance.getEntriesByType('navigation')[0];
                const history = performance.getEntriesByType('resource').find(r => r.name.includes('/history'));
                return {html_ms: nav.responseEnd, dom_ready_ms: nav.domContentLoadedEventEnd,
                        history_fetch_ms: history ? history.responseEnd - history.startTime : null,
                        curve_drawn_ms: window.__dashboardRenderedAt,
                        points: Number(document.getElementById('chart-reward').dataset.points)};""")
            out.append(timing)
    finally:
        browser.quit()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args()
    from art.dashboard.app import create_dashboard_app
    from art.server.thread import ServerThread

    root = Path(tempfile.mkdtemp(prefix="art-dashboard-bench-"))
    try:
        t0 = time.perf_counter()
        run = synthesize(root, args.steps, args.groups, args.group_size)
        size_mb = sum(f.stat().st_size for f in run.rglob("*") if f.is_file()) / 2**20
        print(f"synthesized {args.steps} steps x {args.groups * args.group_size} trajectories "
              f"({size_mb:.0f} MiB) in {time.perf_counter() - t0:.1f} s", flush=True)
        with ServerThread(create_dashboard_app(root)) as server:
            calls = server_times(server.base_url, args.steps)
            loads = browser_loads(server.base_url, args.loads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert all(load["points"] == args.steps for load in loads), loads
    print(table(["server call", "median ms", "KiB"], calls))
    keys = ["html_ms", "history_fetch_ms", "dom_ready_ms", "curve_drawn_ms"]
    medians = {k: round(statistics.median(load[k] for load in loads), 1) for k in keys}
    print(table(["page load (Chromium)", "median ms"], [[k, medians[k]] for k in keys]))
    print(json.dumps({"benchmark": "dashboard_load", "steps": args.steps,
                      "trajectories_per_step": args.groups * args.group_size, "run_mib": round(size_mb),
                      "server_ms": {label: round(ms, 1) for label, ms, _ in calls}, "page_ms": medians,
                      "loads": loads, **environment()}))


if __name__ == "__main__":
    main()
