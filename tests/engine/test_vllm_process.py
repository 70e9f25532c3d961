"""The vLLM server process dies with the backend: on `stop()`, and when the process that started
it is killed with SIGKILL (no cleanup runs then: the bootstrap sees its pipe close). A stand-in
module plays the server here (`tests/support/stand_in_server.py`, a child process of its own as
vLLM's engine core is), so this checks our process handling in a second, without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from art.engine.vllm_process import VLLMInstall, VLLMServer, cli_args, find_vllm
from art.errors import ArtValueError, BackendError
from tests.support.vllm import ROOT, group_gone

pytestmark = pytest.mark.integration

STAND_IN = VLLMInstall(sys.executable, "stand-in", frozenset())


def test_cli_args_are_vllms_command_line():
    assert cli_args({"max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": False, "seed": None,
                     "structured_outputs_config": {"backend": "guidance"}, "served_model_name": ["a", "b"]}) == [
        "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
        "--structured-outputs-config", '{"backend": "guidance"}', "--served-model-name", "a", "b"]


def test_stop_ends_the_whole_process_group(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    server = VLLMServer(STAND_IN, {}, tmp_path / "vllm.log", module="tests.support.stand_in_server")
    server.start()
    assert server.alive() and server.failure() is None
    pgid = server.process.pid
    server.stop()
    assert group_gone(pgid) and "was stopped" in server.failure()


def test_the_server_dies_with_a_parent_killed_by_sigkill(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from art.engine.vllm_process import VLLMInstall, VLLMServer
server = VLLMServer(VLLMInstall(sys.executable, "stand-in", frozenset()), {{}}, Path({str(tmp_path / 'vllm.log')!r}),
                    module="tests.support.stand_in_server")
server.start()
print(server.process.pid, flush=True)
time.sleep(3600)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    assert group_gone(pgid), (tmp_path / "vllm.log").read_text()


def test_a_server_that_exits_while_starting_is_an_error_quoting_its_log(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    server = VLLMServer(STAND_IN, {"port_typo": 1}, tmp_path / "vllm.log", module="no_such_module_here")
    with pytest.raises(BackendError, match="(?s)exited while starting.*No module named") as failed:
        server.start()
    assert str(tmp_path / "vllm.log") in str(failed.value)


def test_a_python_without_vllm_says_how_to_install_it():
    with pytest.raises(ArtValueError, match="setup_vllm.sh") as failed:
        find_vllm(sys.executable if not _has_vllm() else "/nonexistent/python")
    assert failed.value.field == "engine"


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
