"""Peak memory and wall time of one long prompt: our serving path against transformers' forward.

    python benchmarks/long_prompt.py [--lengths 1470,2920,5820] [--quick]

The same chat prompt (deterministic text, about N tokens after the chat template) on the
default model, on the CPU, float32 weights:
  ours  `art.LocalBackend` (in process, its default) + a registered `TrainableModel`; the
        official `openai` client (`model.openai_client()`) sends one chat completion with
        max_tokens=4 to the step-0 LoRA adapter, after a short warm-up request
  ours_no_prefix_cache  the same with engine_args enable_prefix_caching=False: the prefix
        cache keeps the prompt's keys and values for a next turn, which is one copy of them
        the forward alone does not hold
  hf    the model from `art.base_models.load`: one forward of the same prompt's token ids with
        logits_to_keep=1 (use_cache as its default) under torch.inference_mode, after a short
        warm-up forward
Each (system, length) runs in its own fresh subprocess, so none inherits memory another freed.
peak extra = VmHWM after the request - VmRSS just before it, with the high-water mark reset
("5" to /proc/self/clear_refs) and freed heap returned (malloc_trim) just before. Our backend
runs in this process, so the figure covers the server, the engine and the client together.
time = time.perf_counter around the request (ours: the whole HTTP call; hf: the forward).
Prints a table, then one JSON line. Engine settings are the defaults (prefill_tokens,
prefix_cache_tokens, max_model_len): this measures what a user gets.

The prompt is "Note i: <who> <did> <what> <where>." lines with co-prime strides (no two notes
repeat) plus a question: the fewest notes that reach the target length after the chat template;
both systems' prompt token counts are checked against it. --quick: one 300-token prompt (~30 s).
JSON keys: runs (per length: prompt_tokens; ours, ours_no_prefix_cache and hf_forward, each with
peak_extra_bytes, seconds, rss_before_bytes, prompt_tokens; memory_ratio,
memory_ratio_no_prefix_cache and time_ratio, all ours / hf), settings and the environment.
Dated runs: benchmarks/results/*-long_prompt.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import environment, ratio, table

import art

DEFAULT_LENGTHS = [1470, 2920, 5820]
OURS = {"ours": {}, "ours_no_prefix_cache": {"enable_prefix_caching": False}}  # system -> engine_args
QUICK_LENGTH = 300
WARMUP = [{"role": "user", "content": "Say hello."}]

SUBJECTS = ["The keeper of the lighthouse", "A tired courier", "The youngest baker", "An old sailor",
            "The village teacher", "A curious fox", "The night watchman", "A travelling musician",
            "The mayor's cousin", "A quiet librarian", "The blacksmith", "A student of botany",
            "The ferry captain"]
VERBS = ["carried", "painted", "forgot", "repaired", "counted", "hid", "sold", "described", "found",
         "borrowed", "measured"]
OBJECTS = ["a brass compass", "three loaves of rye bread", "the broken clock", "a map of the coast",
           "a basket of green apples", "the blue umbrella", "an unsigned letter", "two copper kettles",
           "the festival banner", "a jar of honey", "the spare key", "a bundle of candles"]
PLACES = ["near the harbour", "before sunrise", "in the market square", "after the storm",
          "behind the mill", "on the northern road", "during the fair", "under the old bridge",
          "beside the chapel", "at the edge of the forest"]


def sentence(i: int) -> str:
    """Note i: strides co-prime with the list lengths make every note a different combination."""
    return (f"Note {i + 1}: {SUBJECTS[i % 13]} {VERBS[(i * 3) % 11]} {OBJECTS[(i * 5) % 12]} "
            f"{PLACES[(i * 7) % 10]}.")


def messages(notes: int) -> list[dict]:
    text = " ".join(sentence(i) for i in range(notes))
    return [{"role": "user", "content": f"{text}\n\nWhich note first mentions the brass compass? Answer briefly."}]


def template_ids(tokenizer, chat: list[dict]) -> list[int]:
    """The prompt's token ids after the chat template (a list, not transformers 5's dict)."""
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)


def prompt_for(tokenizer, target: int) -> tuple[list[dict], int]:
    """The fewest notes whose chat-templated prompt has at least `target` tokens, and that count."""
    count = lambda n: len(template_ids(tokenizer, messages(n)))
    lo, hi = 1, 1
    while count(hi) < target:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    return messages(lo), count(lo)


# --- measuring, inside a child process --------------------------------------------------------

def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def memory_baseline() -> int:
    """Give freed memory back, reset the high-water mark to the current RSS; returns RSS in bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_since(baseline: int) -> int:
    return _status_kib("VmHWM") * 1024 - baseline


async def measure_ours(prompt: list[dict], engine_args: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="art-long-prompt-") as root:
        backend = art.LocalBackend(path=root)
        if not backend.in_process:  # the memory figure is this process's
            raise RuntimeError("LocalBackend no longer runs in process by default: measure the child")
        model = art.TrainableModel(name="long", project="bench", base_model=art.DEFAULT_MODEL,
                                   _internal_config={"engine_args": engine_args})
        await model.register(backend)
        client = model.openai_client()
        name = model.get_inference_name()
        await client.chat.completions.create(model=name, messages=WARMUP, max_tokens=4)
        baseline = memory_baseline()
        start = time.perf_counter()
        response = await client.chat.completions.create(model=name, messages=prompt, max_tokens=4)
        seconds = time.perf_counter() - start
        peak = peak_since(baseline)
        await backend.close()
    return {"peak_extra_bytes": peak, "seconds": round(seconds, 2), "rss_before_bytes": baseline,
            "prompt_tokens": response.usage.prompt_tokens, "completion_tokens": response.usage.completion_tokens}


def measure_hf(prompt: list[dict]) -> dict:
    import torch

    model, tokenizer = art.base_models.load(art.DEFAULT_MODEL)  # float32, as our CPU engine serves
    ids = lambda chat: torch.tensor([template_ids(tokenizer, chat)])
    warmup, input_ids = ids(WARMUP), ids(prompt)  # [1, tokens]
    with torch.inference_mode():
        model(input_ids=warmup, logits_to_keep=1)
        del warmup
        baseline = memory_baseline()
        start = time.perf_counter()
        out = model(input_ids=input_ids, logits_to_keep=1)
        seconds = time.perf_counter() - start
        peak = peak_since(baseline)
    assert out.logits.shape[1] == 1
    return {"peak_extra_bytes": peak, "seconds": round(seconds, 2), "rss_before_bytes": baseline,
            "prompt_tokens": input_ids.shape[1]}


def child(system: str, prompt_file: str) -> None:
    prompt = json.loads(Path(prompt_file).read_text())
    result = measure_hf(prompt) if system == "hf" else asyncio.run(measure_ours(prompt, OURS[system]))
    print(json.dumps(result), flush=True)


# --- the driver -------------------------------------------------------------------------------

def run_child(system: str, prompt: list[dict], workdir: str) -> dict:
    path = Path(workdir) / f"prompt-{system}.json"
    path.write_text(json.dumps(prompt))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", system, "--prompt-file", str(path)],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = round(time.perf_counter() - start, 1)
    return result


def gb(result: dict) -> float | None:
    return round(result["peak_extra_bytes"] / 1e9, 2) if "peak_extra_bytes" in result else None


def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    lengths = [QUICK_LENGTH] if args.quick else [int(x) for x in args.lengths.split(",") if x.strip()]
    tokenizer = AutoTokenizer.from_pretrained(art.base_models.resolve(art.DEFAULT_MODEL))
    runs, rows = [], []
    with tempfile.TemporaryDirectory(prefix="long-prompt-") as workdir:
        for target in lengths:
            prompt, tokens = prompt_for(tokenizer, target)
            ours, bare = run_child("ours", prompt, workdir), run_child("ours_no_prefix_cache", prompt, workdir)
            hf = run_child("hf", prompt, workdir)
            for name, result in (("ours", ours), ("ours_no_prefix_cache", bare), ("hf", hf)):
                if "prompt_tokens" in result and result["prompt_tokens"] != tokens:
                    result["warning"] = f"{name} counted {result['prompt_tokens']} prompt tokens, the template {tokens}"
            run = {"target_tokens": target, "prompt_tokens": tokens, "ours": ours, "ours_no_prefix_cache": bare,
                   "hf_forward": hf,
                   "memory_ratio": ratio(ours.get("peak_extra_bytes"), hf.get("peak_extra_bytes")),
                   "memory_ratio_no_prefix_cache": ratio(bare.get("peak_extra_bytes"), hf.get("peak_extra_bytes")),
                   "time_ratio": ratio(ours.get("seconds"), hf.get("seconds"))}
            runs.append(run)
            rows.append([f"{tokens:,}", gb(ours), ours.get("seconds"), gb(bare), gb(hf), hf.get("seconds"),
                         run["memory_ratio"], run["memory_ratio_no_prefix_cache"], run["time_ratio"]])
            print(f"{tokens} tokens: ours {ours}, hf {hf}", file=sys.stderr, flush=True)
    print(table(["prompt tokens", "ours peak extra GB", "ours s", "no prefix cache GB", "hf peak extra GB", "hf s",
                 "memory ours/hf", "no prefix cache/hf", "time ours/hf"], rows))
    print(json.dumps({"benchmark": "long_prompt", "runs": runs,
                      "settings": {"model": art.DEFAULT_MODEL, "max_tokens": 4, "dtype": "float32",
                                   "engine_config": "defaults", "served": "step-0 LoRA adapter"},
                      **environment()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="target prompt lengths in tokens after the chat template, comma-separated")
    parser.add_argument("--quick", action="store_true", help=f"one short prompt ({QUICK_LENGTH} tokens)")
    parser.add_argument("--child", choices=[*OURS, "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.prompt_file)
    else:
        main(args)
