"""A real `art serve` subprocess on a loopback port, and the rollouts the remote tests train on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

import art
from tests.support.fakes import rollout  # the same rollout as the local loop's test

SRC = Path(__file__).resolve().parents[2] / "src"


async def gather(model, step: int) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=100 * step + i) for i in range(4)) for _ in range(2)],
        pbar_desc=None,
    )


def start_server(root: Path, log: Path, *args: str, env: dict | None = None,
                 models_dir: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m art serve --port 0 ...`; the URL comes from its first line, then /health.
    `models_dir`: where the test's model folder lies (a server only loads paths under one)."""
    if models_dir is not None:
        args = (*args, "--models-dir", str(models_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(
            [sys.executable, "-m", "art", "serve", "--host", "127.0.0.1", "--port", "0", "--path", str(root), *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )
    deadline = time.monotonic() + 60
    url = None
    while True:
        text = log.read_text()
        if url is None and "listening on http://" in text:
            url = text.split("listening on ")[1].split()[0]
        try:
            if url is not None and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"art serve did not start:\n{log.read_text()}")
        time.sleep(0.1)


def stop_server(process: subprocess.Popen, log: Path) -> str:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return log.read_text()
