#!/usr/bin/env bash
# The GPU check: what the H200 test machine runs for this project, in one call of at most 6 minutes
# (GPU_CHECK_BUDGET_S, 360), in stages. Each stage has its own `timeout` and a failing or timed-out
# stage does not stop the next. Every JSON line a stage prints is appended to $OUT/gpu_check.jsonl
# the moment it is printed, with "stage", "commit" and "seconds" (since the stage started) added, so
# a stage that is killed keeps what it measured; each stage ends with a "status" line.
#   setup   pip install of .whl (none in smoke mode); GPU, versions, which packages import   ~10 s
#   graphs  benchmarks/graph_diagnosis.py: the graph test the first H200 run failed, under each SDPA
#           kernel, with eager-vs-eager and kernel-vs-math controls and the sizes: one verdict
#           line (test, refused, capture, kernel or ok)                                 <= 40 s
#   sanity  benchmarks/gpu_sanity.py: graphs replay = eager (warnings as errors around capture),
#           kernels per decode step and the SDPA kernel that ran (profiler), merged and unmerged
#           LoRA; one RL step through the public API with the weight-sync probe       <= 60 s
#   engine  benchmarks/engine_gpu.py: ours vs HF generate, SmolLM2 shape, grpo and wide,
#           ours_lora (unmerged) and ours_lora_merged, a JSON line per shape             <= 110 s
#   trainer benchmarks/trainer_gpu.py: trainer tokens/s and peak memory, LoRA r16, packed rows of
#           16k and 2k tokens, SmolLM2-135M, Qwen3-0.6B, Qwen2.5-1.5B and Qwen3-4B shapes (random
#           weights), a JSON line with `trainer_tok_s` per (model, layout)                <= 100 s
#   rl      benchmarks/vs_trl.py --device cuda: our RL step vs TRL's GRPOTrainer on a random-weight
#           SmolLM2 (random_weights.py), the letter_e reward (step times)         the time left
#   tests   pytest -m gpu tests/engine/test_cuda.py training/test_mixed_precision.py server/test_concurrency.py <= 60 s
#   vllm    pytest -m vllm tests/engine/test_vllm_engine.py (engine="vllm" on this device), only where
#           vLLM is installed (ART_VLLM_PYTHON, or vllm importable); skipped otherwise  what is left
#   summary one line of the numbers that matter, from gpu_check.jsonl
#
# Prepare on the development machine (package registries reachable) before each GPU run:
#   bash benchmarks/gpu_check.sh --prepare   # .whl/ (../shared/gpu/wheels.sh), .gpu_assets/ (+ commit)
# then through the device tool (machine start 2-4 min + this <= 6 min; see Budget below), and
# give_back right after unless rerunning at once:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=390)
# A rerun with less device time left: GPU_CHECK_BUDGET_S=180 bash benchmarks/gpu_check.sh (the
# stages at the end get what is left).
# Outputs ($OUT, else /tmp/gpu_check; at most 8 files come back): gpu_check.jsonl and one log per stage.
# Smoke test on a CPU, every stage at toy sizes in under 2 minutes:
#   GPU_CHECK_SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
# (engine_gpu's tiny model, the tiny Llama for the rl stage; TRL only where trl and datasets import).
#
# Budget: 15 minutes of device time for all tries, machine starts included. The first try is a start
# (2-4 min) + this call (<= 6 min): 8-10 min. A second try on the still-warm machine (it goes
# back after 30 s idle) needs no start: rerun at once with GPU_CHECK_BUDGET_S set to what is left
# less 1 min of margin, or give_back. timeout_s=390 is the 360 s budget plus 30 s for a stuck
# stage's kill grace and the summary; what $OUT holds comes back even if the call is stopped.
# Each stage's status line says ok, timeout, exit N or skipped; a stage cut short also shows the
# last lines of its log (vs_trl's per-step times, pytest's per-test results).
# What travels (64 MiB at most): the checkout (~1.6 MB), .whl (7.9 MB), .gpu_assets (3.4 MB:
# SmolLM2's config and tokenizer, and `git describe --always --dirty` in .gpu_assets/commit, as the
# device machine's copy has no .git). pyarrow (52.5 MiB), pandas, xxhash, fsspec and aiohttp, which
# TRL's `datasets` imports, come from the machine's image, not carried; the setup line reports them.
# Stage estimates and the CPU smoke timings: benchmarks/results/2026-12-02-gpu_check.md.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  mkdir -p .git/info  # wheels.sh appends to .git/info/exclude, which a fresh clone may lack
  rm -rf .whl  # one version of each wheel: two stop the whole install there
  # datasets 5.2.0 cannot build TRL's Dataset.from_list with pyarrow 24-26 (PicklingError on
  # pyarrow's MonthDayNano in its fingerprint); 4.8.5 can. pip merges the pin with wheels.sh's name.
  EXTRA_WHEELS="datasets==4.8.5 truststore ${EXTRA_WHEELS:-}" bash ../shared/gpu/wheels.sh
  # What the first H200 run (2026-12-04) found missing: truststore (httpcore2 imports it, so every
  # openai client failed) and llguidance (structured outputs and forced tool calls), whose wheel
  # for our pin needs glibc 2.31, a platform tag wheels.sh does not list.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 -d .whl "llguidance>=1.9,<2"
  grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
  source=$(.venv/bin/python -c "import art, art.base_models as b; print(b.resolve(art.DEFAULT_MODEL))")
  mkdir -p .gpu_assets/smollm2
  cp "$source"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
     .gpu_assets/smollm2/ 2>/dev/null || cp "$source"/{config.json,tokenizer.json,tokenizer_config.json} .gpu_assets/smollm2/
  git describe --always --dirty > .gpu_assets/commit  # the device machine's copy has no .git
  echo "commit $(cat .gpu_assets/commit)"
  du -sh .whl .gpu_assets
  exit 0
fi

py=${PYTHON:-python3}
smoke=${GPU_CHECK_SMOKE:-0}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
jsonl=$out/gpu_check.jsonl
: > "$jsonl"
if [ "$smoke" = 1 ]; then  # this checkout: its own commit first
  commit=$(git describe --always --dirty 2>/dev/null || cat .gpu_assets/commit 2>/dev/null || echo unknown)
else
  commit=$(cat .gpu_assets/commit 2>/dev/null || git describe --always --dirty 2>/dev/null || echo unknown)
fi
base_budget=$([ "$smoke" = 1 ] && echo 115 || echo 360)
budget=${GPU_CHECK_BUDGET_S:-$base_budget}
start=$(date +%s)
deadline=$(( start + budget ))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export ART_CACHE_DIR=/tmp/art-cache
[ -d .gpu_assets/smollm2 ] && export ART_TEST_TOKENIZER=$PWD/.gpu_assets/smollm2

# Reads a stage's output line by line: JSON lines go to gpu_check.jsonl at once (with stage, commit
# and seconds added) and to stdout; every line goes to the stage's log. The last line, __rc=N, is
# the stage's exit status: it becomes the stage's status line, with what the text lines told (the
# per-step lines of vs_trl, pytest's per-test results and summary) for a stage that was cut short.
FILTER='
import json, re, sys, time
name, commit, jsonl, log, began, check_began, limit = sys.argv[1:8]
began, check_began = float(began), float(check_began)
sys.stdin.reconfigure(errors="replace")
steps, tests, tail, lines, rc, summary = {}, {}, [], 0, None, None
def add(obj):
    obj.update(stage=name, commit=commit, seconds=round(time.time() - began, 1),
               since_start_s=round(time.time() - check_began, 1))
    text = json.dumps(obj)
    sink.write(text + "\n"); sink.flush()
    print(text if len(text) < 2000 else text[:2000] + " ...(full line in gpu_check.jsonl)", flush=True)
with open(log, "w") as txt, open(jsonl, "a") as sink:
    for line in iter(sys.stdin.readline, ""):
        line = line.rstrip("\n")
        if line.startswith("__rc="):
            rc = int(line[5:]); break
        txt.write(line + "\n"); txt.flush()
        obj, last = None, line.split("\r")[-1].strip()  # after a progress bar on the same line
        if last.startswith("{"):
            try: obj = json.loads(last)
            except ValueError: pass
        if isinstance(obj, dict):
            lines += 1; add(obj); continue
        if line.strip():
            tail = (tail + [line[-300:]])[-4:]
        for part in line.split("\r"):  # a progress bar may share the line
            m = re.match(r"(\S+) step (\d+): ([\d.]+) s", part.strip())
            if m:
                steps.setdefault(m[1], []).append(float(m[3]))
        m = re.match(r"(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)
        if m:
            tests.setdefault(m[2].lower(), []).append(m[1].split("::", 1)[1])
        if re.search(r"=+ .*\d+ (passed|failed|skipped|errors?|deselected).* in [\d.]+s", line):
            summary = line.strip("= ")
    status = "ok" if rc == 0 else "timeout" if rc in (124, 137) else "killed" if rc is None else f"exit {rc}"
    line = {"status": status, "limit_s": int(limit), "json_lines": lines}
    if status != "ok" or not lines:
        line["tail"] = tail
    if steps: line["step_seconds"] = steps
    if tests: line["tests"] = {k: (v if k != "passed" else len(v)) for k, v in tests.items()}
    if summary: line["pytest_summary"] = summary
    add(line)
'

# stage NAME MAX_SECONDS RESERVE_SECONDS COMMAND...: run COMMAND under `timeout`, for at most
# MAX_SECONDS and never past the deadline less RESERVE_SECONDS (kept for the stages after it;
# scaled down with a smaller GPU_CHECK_BUDGET_S, so the first stages keep their time).
stage() {
  local name=$1 cap=$2 reserve=$(( $3 * budget / base_budget )); shift 3
  local limit=$(( deadline - reserve - $(date +%s) ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  echo "== $name (limit ${limit}s)"
  if [ "$limit" -lt 10 ]; then
    $py -c 'import json, sys; print(json.dumps({"stage": sys.argv[1], "commit": sys.argv[2], "seconds": 0,
            "status": "skipped", "reason": f"{sys.argv[3]} s left for it of the {sys.argv[4]} s budget"}))' \
      "$name" "$commit" "$limit" "$budget" | tee -a "$jsonl"
    return
  fi
  # The status on a line of its own, also after output that did not end its line (a progress bar).
  { timeout -k 5 "$limit" "$@"; printf '\n__rc=%s\n' "$?"; } 2>&1 |
    $py -u -c "$FILTER" "$name" "$commit" "$jsonl" "$out/$name.txt" "$(date +%s.%N)" "$start" "$limit"
}

# What arrived: the GPU, the Python packages the stages import (and their versions).
SETUP='
import importlib, json, platform, subprocess
found = {}
for name in ["torch", "transformers", "peft", "fastapi", "uvicorn", "pydantic", "openai", "opentelemetry.trace",
             "trl", "datasets", "pyarrow", "pandas", "xxhash", "fsspec", "dill", "multiprocess", "art"]:
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", "ok")
    except Exception as exc:
        found[name] = f"missing: {type(exc).__name__}: {exc}"[:200]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip() or None
except (OSError, subprocess.SubprocessError):
    gpu = None
import torch
print(json.dumps({"gpu": gpu, "cuda_available": torch.cuda.is_available(), "python": platform.python_version(),
                  "packages": found}))
'

# Stage limits in seconds: the most each may take, and what it leaves for the stages after it.
if [ "$smoke" = 1 ]; then  #        setup  graphs sanity engine trainer rl  tests
  caps=(30 30 45 30 20 45 30);      reserves=(95 80 60 45 30 12 2)
else
  caps=(45 40 60 90 100 80 60);     reserves=(315 275 220 150 80 50 3)
fi

# -- setup --------------------------------------------------------------------------------
install='true'
if [ "$smoke" != 1 ]; then
  install="$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl"
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else  # the local environment has what it has
  export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export SETUP
stage setup "${caps[0]}" "${reserves[0]}" bash -c "$install || echo 'pip install failed'; exec $py -c \"\$SETUP\""

# -- 1. the graph test the first run failed, under each attention kernel -------------------------
stage graphs "${caps[1]}" "${reserves[1]}" $py benchmarks/graph_diagnosis.py

# -- 2. does it run at all ------------------------------------------------------------------
tiny=(); [ "$smoke" = 1 ] && tiny=(--tiny)
stage sanity "${caps[2]}" "${reserves[2]}" $py benchmarks/gpu_sanity.py "${tiny[@]}"

# -- 3. our engine vs HF generate -------------------------------------------------------------
# GPU_CHECK_ENGINE_ARGS: more flags, e.g. "--models smollm2,qwen1.5b --all-variants" (a longer run)
# shellcheck disable=SC2086
stage engine "${caps[3]}" "${reserves[3]}" $py benchmarks/engine_gpu.py "${tiny[@]}" ${GPU_CHECK_ENGINE_ARGS:-}

# -- 4. the trainer's tokens/s, LoRA r16, 16k packing -------------------------------------------
# GPU_CHECK_TRAINER_ARGS: e.g. "--models qwen3-4b --rows 4" (one size, longer steps)
# shellcheck disable=SC2086
stage trainer "${caps[4]}" "${reserves[4]}" $py benchmarks/trainer_gpu.py "${tiny[@]}" ${GPU_CHECK_TRAINER_ARGS:-}

# -- 5. one RL step vs TRL ----------------------------------------------------------------------
if [ "$smoke" = 1 ]; then  # the sanity stage's tiny Llama; TRL runs if this environment has it
  model=/tmp/gpu-check-tiny-model
  make_model="$py benchmarks/gpu_sanity.py --write-tiny $model"
  rl_args="--device cpu --steps 2 --prompts-per-step 2 --group-size 2 --max-tokens 8 --max-default-steps 2"
else
  model=/tmp/smollm2-random
  make_model="$py benchmarks/random_weights.py .gpu_assets/smollm2 $model --device cuda"
  rl_args="--device cuda --steps 3 --max-default-steps 2"
fi
stage rl "${caps[5]}" "${reserves[5]}" bash -c \
  "$make_model && exec $py benchmarks/vs_trl.py --model $model --reward letter_e $rl_args"

# -- 6. the gpu-marked tests (skipped on a CPU) ----------------------------------------------------
stage tests "${caps[6]}" "${reserves[6]}" $py -m pytest -v -rfE -m gpu -p no:cacheprovider \
  tests/engine/test_cuda.py tests/training/test_mixed_precision.py tests/server/test_concurrency.py

# -- 7. vLLM as the engine, where vLLM is installed ---------------------------------------------------
# Its CUDA wheel cannot travel to the GPU test machine (no registry there, 64 MiB carried), so this
# runs only on a machine that has it (ART_VLLM_PYTHON, or vllm in this Python), in what is left.
if [ -n "${ART_VLLM_PYTHON:-}" ] || $py -c "import vllm" 2>/dev/null; then
  stage vllm 300 0 $py -m pytest -v -rfE -m vllm -p no:cacheprovider tests/engine/test_vllm_engine.py
else
  $py -c 'import json, sys; print(json.dumps({"stage": "vllm", "commit": sys.argv[1], "seconds": 0,
          "status": "skipped", "reason": "vLLM is not installed here (ART_VLLM_PYTHON unset, no vllm module)"}))' \
    "$commit" | tee -a "$jsonl"
fi

# -- summary ----------------------------------------------------------------------------------------
$py - "$jsonl" "$commit" "$(( $(date +%s) - start ))" <<'PY' | tee -a "$jsonl"
import json, sys

path, commit, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = [json.loads(line) for line in open(path) if line.strip()]
summary = {"stage": "summary", "commit": commit, "seconds": seconds,
           "status": {l["stage"]: [l["status"], l["seconds"]] for l in lines if "status" in l}}


def take(line: dict) -> None:
    stage, part = line.get("stage"), line.get("part")
    if "packages" in line:
        summary["gpu"] = line["gpu"]
        summary["missing"] = sorted(k for k, v in line["packages"].items() if str(v).startswith("missing"))
    elif stage == "sanity" and part in ("graphs", "kernels", "train"):
        key = part + {True: "_merged", False: "_unmerged"}.get(line.get("merge_lora"), "")
        if "error" in line:
            summary[key] = {"error": line["error"][:300]}
        elif part == "graphs":
            stats = line["stats"]
            summary[key] = {"ok": line.get("ok"), "max_abs_diff": line["max_abs_diff_graph_vs_eager"],
                            **{k.split("/")[1]: v for k, v in stats.items() if "graph" in k},
                            "last_failure": line["last_failure"]}
        elif part == "kernels":
            decode, prefill = line["decode_step"], line["prefill_4x48"]
            summary[key] = {"decode_kernels": decode["cuda_kernels"],
                            "decode_attention": decode["attention_kernels"] or decode["sdpa_ops"],
                            "prefill_attention": prefill["attention_kernels"] or prefill["sdpa_ops"]}
        else:
            summary[key] = {k: line.get(k) for k in ("weight_sync_max_abs_diff", "peak_gpu_memory_gb", "wall_s")}
    elif stage == "graphs" and part == "graph_verdict":
        summary["graph_test"] = {"verdict": line["verdict"], "per_kernel": line["per_kernel"]}
    elif stage == "graphs" and part == "graph_test" and isinstance(line.get("graph_vs_eager"), dict):
        summary.setdefault("graph_test_max_diff", {})[line["sdpa"]] = line["graph_vs_eager"]["max"]
    elif stage == "trainer" and part == "trainer":
        summary.setdefault("trainer_tok_s", {})[f"{line['model']} {line['layout']}"] = (
            line.get("trainer_tok_s") or line.get("error", "")[:80], line.get("peak_gpu_memory_gib"))
    elif stage == "engine" and "shape" in line:
        ours = {k: v for k, v in line.items() if k.startswith("ours_") and isinstance(v, dict)}
        summary[f"engine_{line['model']}_{line['shape']}"] = {
            "tok_s": {"hf_generate": line["hf_generate"]["tok_s"], **{k: v["tok_s"] for k, v in ours.items()}},
            "ratio_vs_hf": line["ratio_vs_hf"], "share_of_limit": line["ours_share_of_limit"],
            "graphs_and_failures": {k: [v.get("engine/cuda_graphs"), v.get("engine/graph_failures")]
                                    for k, v in ours.items()},
            "memory_reserved_gb": {k: v.get("memory_reserved_gb") for k, v in ours.items()}}
    elif stage == "rl" and line.get("benchmark") == "vs_trl":
        summary["rl_step"] = {"trl_median_s": (line["trl"] or {}).get("median_step_s"),
                              "ours_median_s": line["ours_same_settings"]["median_step_s"],
                              "ratio_step_time": line["ratio_step_time"], "trl_status": line["trl_status"]}
    elif stage == "rl" and "step_seconds" in line and "rl_step" not in summary:
        summary["rl_step"] = {"partial_step_seconds": line["step_seconds"]}
    elif stage == "tests" and "status" in line:
        summary["tests"] = line.get("pytest_summary") or line.get("tests") or line["status"]


for line in lines:
    try:
        take(line)
    except (KeyError, TypeError, AttributeError) as exc:  # one odd line must not cost the summary
        summary.setdefault("summary_errors", []).append(f"{line.get('stage')}: {type(exc).__name__}: {exc}")
print(json.dumps(summary))
PY
