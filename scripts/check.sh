#!/usr/bin/env bash
# The style and type checks of src/art, run before the tests by .ci/run and the README's test
# command: ruff's lint and its formatter (settings in pyproject.toml), then mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src/art
.venv/bin/ruff format --check src/art
.venv/bin/mypy
