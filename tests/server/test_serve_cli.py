"""The `art` command: `art serve` refuses an open bind without a key; the client stays light."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from art.cli import is_loopback

SRC = Path(__file__).resolve().parents[2] / "src"


def run(*args: str) -> subprocess.CompletedProcess:
    """`python *args` with our sources and without ART_API_KEY."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("ART_API_KEY", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "gpu-box.example"])
def test_open_bind_without_a_key_is_refused(host, tmp_path):
    result = run("-m", "art", "serve", "--host", host, "--port", "0", "--path", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert "refusing" in result.stderr and "ART_API_KEY" in result.stderr and "--api-key" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


@pytest.mark.integration
def test_help_and_console_script():
    result = run("-m", "art", "serve", "--help")
    assert result.returncode == 0 and "--api-key" in result.stdout and "ART_API_KEY" in result.stdout
    script = Path(sys.executable).parent / "art"
    if script.exists():  # installed by `pip install -e .` ([project.scripts])
        assert subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60).returncode == 0


@pytest.mark.integration
def test_remote_client_imports_no_server_or_torch():
    code = (
        "import sys, art\n"
        "backend = art.Backend(base_url='http://127.0.0.1:9', api_key='sekrit-42')\n"
        "assert type(backend) is art.RemoteBackend and 'sekrit-42' not in repr(backend)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'fastapi', 'uvicorn') if m in sys.modules)\n"
        "assert not heavy, f'imported {heavy}'\n"
    )
    result = run("-c", code)
    assert result.returncode == 0, result.stderr


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.integration
def test_sigterm_mid_step_abandons_it_in_one_line(tiny_model_path, tmp_path):
    """SIGTERM while a training step runs: the step stops and rolls back at once, the client's
    stream ends with an error that says so, the log says in one line what became of the step
    (no traceback), and the server exits without waiting out uvicorn's graceful timeout."""
    from tests.support.fakes import groups_of_choices
    from tests.support.servers import start_server

    root, log = tmp_path / "server", tmp_path / "serve.log"
    process, url = start_server(root, log, models_dir=tiny_model_path.parent)
    try:
        body = {"name": "m", "project": "p", "trainable": True, "base_model": str(tiny_model_path)}
        assert httpx.post(f"{url}/art/models", json=body, timeout=120).status_code == 200
        groups = [g.for_logging() for g in groups_of_choices(seed=3)]
        quick = httpx.post(f"{url}/art/models/p/m/train", json={"trajectory_groups": groups}, timeout=120)
        assert json.loads(quick.text.splitlines()[-1]) == {**json.loads(quick.text.splitlines()[-1]),
                                                           "type": "result", "step": 1}
        before = _files(root / "p" / "models" / "m" / "checkpoints")
        # Hundreds of optimizer steps: far longer than the test waits.
        slow = {"trajectory_groups": groups, "options": {"epochs": 100, "mini_batches": 8}}
        lines = []
        with httpx.stream("POST", f"{url}/art/models/p/m/train", json=slow, timeout=60) as response:
            stream = response.iter_lines()
            for line in stream:
                lines.append(json.loads(line))
                if lines[-1]["type"] == "gradient_step":
                    break
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            lines += [json.loads(line) for line in stream]
        process.wait(timeout=30)
        exited_after = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert lines[-1]["type"] == "error", lines[-1]
    error = lines[-1]["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"], error
    assert "abandoned" in error["message"] and "stays at step 1" in error["message"], error
    assert exited_after < 8, (exited_after, output)  # uvicorn alone waited out its 10 s graceful timeout
    assert "shutting down: training step of p/m abandoned; the model stays at step 1" in output, output
    assert "Traceback" not in output and "CancelledError" not in output, output
    assert _files(root / "p" / "models" / "m" / "checkpoints") == before
