#!/usr/bin/env bash
# The GPU check: everything the H200 test machine runs for this project, in one call of at most
# 8 minutes, ending with one JSON line. Stages (each under its own time limit; a failing stage
# does not stop the others):
#   1. the `gpu`-marked tests (tests/test_cuda.py, test_mixed_precision.py, test_concurrency.py)
#   2. benchmarks/engine_gpu.py: our engine vs HF generate, SmolLM2-135M and Qwen2.5-1.5B shapes
#   3. benchmarks/vs_trl.py --device cuda: our RL step vs TRL's GRPOTrainer (random SmolLM2 weights,
#      the letter_e reward: step times, not learning)
# Prepare on the development machine (package registries reachable), once per checkout:
#   bash benchmarks/gpu_check.sh --prepare      # .whl/ (../shared/gpu/wheels.sh) and .gpu_assets/
# then through the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=540)
# Full outputs land in $OUT (the device tool brings them back), or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  bash ../shared/gpu/wheels.sh
  grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
  source=$(.venv/bin/python -c "import art, art.base_models as b; print(b.resolve(art.DEFAULT_MODEL))")
  mkdir -p .gpu_assets/smollm2
  cp "$source"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
     .gpu_assets/smollm2/ 2>/dev/null || cp "$source"/{config.json,tokenizer.json,tokenizer_config.json} .gpu_assets/smollm2/
  du -sh .whl .gpu_assets
  exit 0
fi

# GPU_CHECK_SMOKE=1 PYTHON=.venv/bin/python: the same stages at toy sizes, to try the script on a CPU.
py=${PYTHON:-python3}
smoke=${GPU_CHECK_SMOKE:-0}
engine_args=(); trl_args=(--device cuda --steps 6 --max-default-steps 30); device=cuda
if [ "$smoke" = 1 ]; then
  engine_args=(--tiny); device=cpu
  trl_args=(--device cpu --steps 2 --prompts-per-step 2 --group-size 2 --max-tokens 8 --max-default-steps 2)
fi
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
start=$(date +%s)
if [ "$smoke" = 1 ]; then  # the local environment has everything
  export PYTHONPATH=$PWD/src:$PWD
else
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/pip.txt" 2>&1 || echo "pip install failed (see pip.txt)"
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
export ART_TEST_TOKENIZER=$PWD/.gpu_assets/smollm2 ART_CACHE_DIR=/tmp/art-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"

echo "== 1. gpu tests"
timeout 210 $py -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda.py tests/test_mixed_precision.py \
  tests/test_concurrency.py > "$out/tests.txt" 2>&1
echo "tests exit $?"; tail -n 3 "$out/tests.txt"

echo "== 2. engine vs HF generate"
timeout 200 $py benchmarks/engine_gpu.py "${engine_args[@]}" > "$out/engine_gpu.txt" 2>&1
echo "engine_gpu exit $?"; grep -v '^{' "$out/engine_gpu.txt" | tail -n 22

echo "== 3. RL step vs TRL"
left=$(( 470 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  $py benchmarks/random_weights.py .gpu_assets/smollm2 /tmp/smollm2-random --device $device > "$out/random_weights.txt" 2>&1
  timeout "$left" $py benchmarks/vs_trl.py --model /tmp/smollm2-random --reward letter_e "${trl_args[@]}" \
    > "$out/vs_trl.txt" 2>&1
  echo "vs_trl exit $?"; grep -v '^{' "$out/vs_trl.txt" | tail -n 8
else
  echo "skipped: ${left}s left" | tee "$out/vs_trl.txt"
fi

$py - "$out" "$(( $(date +%s) - start ))" <<'PY'
import json, re, sys
from pathlib import Path
out, seconds = Path(sys.argv[1]), int(sys.argv[2])

def last_json(name):
    path = out / name
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None

tests = (out / "tests.txt").read_text(errors="replace") if (out / "tests.txt").exists() else ""
summary = [l.strip("= ") for l in tests.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", l)]
engine = last_json("engine_gpu.txt")
trl = last_json("vs_trl.txt")
print(json.dumps({
    "gpu_check": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
    "seconds": seconds,
    "tests": summary[-1] if summary else "no summary (see tests.txt)",
    "engine_ratio_vs_hf": {m: {s: r[s]["ratio_vs_hf"] for s in ("grpo", "wide") if s in r}
                           for m, r in (engine or {}).get("results", {}).items()},
    "engine_share_of_limit": {m: {s: r[s]["ours_share_of_limit"] for s in ("grpo", "wide") if s in r}
                              for m, r in (engine or {}).get("results", {}).items()},
    "engine_goals_met": (engine or {}).get("goals_met"),
    "rl_step": None if not trl else {"trl_median_s": (trl["trl"] or {}).get("median_step_s"),
                                     "ours_median_s": trl["ours_same_settings"]["median_step_s"],
                                     "ratio_step_time": trl["ratio_step_time"], "trl_status": trl["trl_status"]},
}))
PY
