"""Sampling throughput of our serving path against Hugging Face `generate` and llama.cpp.

    python benchmarks/engine_throughput.py [--max-tokens 64] [--shapes a,b,c] [--burst-max-tokens 100]
                                           [--skip-hf] [--skip-llama-cpp] [--tracing on]

Three request shapes, the same sampling settings everywhere (temperature 1, top_p 1, no top-k,
no min-p, end-of-sequence disabled so every completion has exactly max_tokens tokens):
  A  32 different chat prompts, n=1, sent concurrently (an agent's rollouts)
  B  4 prompts x n=8 (GRPO groups)
  C  ART's dev/yes_no_maybe.py burst: its 36 short prompts x 8 separate requests (288), all sent
     at once, --burst-max-tokens each (100, as that script asks); its clients give up after
     100 s, so ours' `seconds` (the last answer) should stay under that. hf: one batch of 288.
     Not in the default --shapes (about 10 minutes on 2 cores).
Systems, all in this one process on the default model:
  ours       `art.LocalBackend` + a registered `TrainableModel`: the official `openai` client over
             loopback HTTP, the engine behind it, the step-0 LoRA adapter (what RL rollouts use);
             also once more with the base model id (no adapter)
  hf         `model.generate` on one left-padded batch (B: num_return_sequences=8), float32 weights
             from `art.base_models.load`, `min_new_tokens` = max_tokens
  llama.cpp  llama-cpp-python on the same GGUF file, one request at a time as it serves them;
             EOS ids get a -inf `logit_bias`
tokens/s = completion tokens counted from the responses / wall seconds (time.perf_counter).
Prints a table, then one JSON line. Goal (the issue): >= 4x hf on both shapes, >= 2x llama.cpp on B;
on C, every answer inside the 100 s client timeout (issue 26).

Method: each system is warmed up with one short request (ours on the adapter and on the base
model id); then, shape by shape, every system is timed, so drift on a shared machine hits each
shape's systems alike. Ours sends `extra_body={"ignore_eos": True}` (vLLM's field); model "bench"
is the step-0 LoRA (`ours`), the base model id is `ours_base_model`. llama.cpp runs with
n_threads=os.cpu_count(); when `llama_cpp` cannot be imported or loaded, the JSON says
"status": "unavailable: <reason>" and the run goes on. Shape C is that script's worst case (every
answer 100 tokens, 28,800 in all; its own answers, EOS on, come to about 16,000); a CPU engine
decodes up to 256 rows at once for it (`max_num_seqs`' CPU default). JSON keys: shape_a / shape_b /
shape_c (ours_tok_s, hf_generate_tok_s, llama_cpp_tok_s, ratio_vs_hf, ratio_vs_llama_cpp,
completion_tokens and seconds per system; shape_c.inside_client_timeout), ours_base_model,
llama_cpp (status, how tokens were forced), settings and the environment (date, cpu_count,
torch_threads, versions). Dated runs: benchmarks/results/*-engine_throughput.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass

from _common import environment, ratio, table

import art

TOPICS = [
    "the water cycle", "how a bicycle stays upright", "photosynthesis", "the rules of chess",
    "why the sky is blue", "how vaccines work", "the history of the printing press", "black holes",
    "how to bake bread", "the French revolution", "how compilers work", "plate tectonics",
    "the life of bees", "how a refrigerator works", "the Roman empire", "why we dream",
    "how airplanes fly", "the game of go", "volcanoes", "how money is created",
    "the human heart", "the moon landing", "how batteries store energy", "coral reefs",
    "the invention of the telephone", "how rainbows form", "the Olympic games", "tides",
    "how glass is made", "the speed of light", "migrating birds", "how a piano makes sound",
]
PROMPTS = [f"Explain {topic} to a curious ten-year-old." for topic in TOPICS]


def _yes_no_maybe_prompts() -> list[str]:
    """The 36 prompts of ART's dev/yes_no_maybe.py ("respond with 'yes', 'no', 'maybe'", ...)."""
    orders = [["yes", "no", "maybe"], ["maybe", "yes", "no"], ["no", "yes", "maybe"], ["yes", "maybe", "no"],
              ["yes", "no"], ["maybe", "no"], ["no", "maybe"], ["no", "yes"], ["yes", "no"]]
    out = []
    for prefix in ("respond", "just respond"):
        for quoted in (True, False):
            for words in orders:
                shown = [f"'{w}'" if quoted else w for w in words]
                out.append(f"{prefix} with {', '.join(shown)}" if len(words) == 3
                           else f"{prefix} with {words[0]} or {words[1]}")
    return out


BURST_PROMPTS = [p for p in _yes_no_maybe_prompts() for _ in range(8)]  # 8 requests per prompt, as ART sends a group
BURST_CLIENT_TIMEOUT_S = 100  # yes_no_maybe.py's `timeout=100` on every request
SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # top-k and min-p off everywhere


@dataclass(frozen=True)
class Shape:
    name: str
    prompts: list[str]
    n: int
    max_tokens: int

    @property
    def completions(self) -> int:
        return len(self.prompts) * self.n


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


class Ours:
    """The real serving path: LocalBackend's HTTP server, the engine behind it, the openai client."""

    async def start(self, root: str) -> None:
        self.backend = art.LocalBackend(path=root)
        self.model = art.TrainableModel(name="bench", project="bench", base_model=art.DEFAULT_MODEL)
        await self.model.register(self.backend)
        self.client = self.model.openai_client()

    async def run(self, shape: Shape, model: str) -> tuple[int, float]:
        start = time.perf_counter()
        responses = await asyncio.gather(*(
            self.client.chat.completions.create(
                model=model, messages=chat(p), n=shape.n, max_tokens=shape.max_tokens,
                extra_body={"ignore_eos": True}, **SAMPLING)
            for p in shape.prompts))
        seconds = time.perf_counter() - start
        return sum(r.usage.completion_tokens for r in responses), seconds


class HFGenerate:
    """transformers `generate` on one padded batch: the baseline the issue names."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.model, self.tokenizer = art.base_models.load(art.DEFAULT_MODEL)  # plain float32, no peft
        self.tokenizer.padding_side = "left"
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}

    def run(self, shape: Shape) -> tuple[int, float]:
        start = time.perf_counter()
        texts = [self.tokenizer.apply_chat_template(chat(p), add_generation_prompt=True, tokenize=False)
                 for p in shape.prompts]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with self.torch.inference_mode():
            out = self.model.generate(  # [prompts * n, prompt_len + new]
                **batch, do_sample=True, top_k=0, max_new_tokens=shape.max_tokens,
                min_new_tokens=shape.max_tokens, num_return_sequences=shape.n,
                pad_token_id=self.tokenizer.pad_token_id, **SAMPLING)
        seconds = time.perf_counter() - start
        new = out[:, batch["input_ids"].shape[1]:].tolist()  # [prompts * n, new]
        return sum(_until_eos(row, self.eos_ids) for row in new), seconds


def _until_eos(row: list[int], eos_ids: set[int]) -> int:
    """Tokens sampled in a row: up to and including its first EOS (padding follows it)."""
    for i, token in enumerate(row):
        if token in eos_ids:
            return i + 1
    return len(row)


class LlamaCpp:
    """llama-cpp-python on the bundled GGUF, serving one request at a time."""

    def __init__(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(art.base_models.bundled_gguf(art.DEFAULT_MODEL)), n_ctx=2048,
                                   n_threads=os.cpu_count(), verbose=False, seed=0)
        # Every end-of-generation token is banned so completions run to max_tokens (as ignore_eos).
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        eog = [t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self.logit_bias = {t: float("-inf") for t in eog}

    def run(self, shape: Shape) -> tuple[int, float]:
        tokens, start = 0, time.perf_counter()
        for prompt in shape.prompts:
            for _ in range(shape.n):
                response = self.llm.create_chat_completion(
                    chat(prompt), max_tokens=shape.max_tokens, top_k=0, min_p=0.0,
                    logit_bias=self.logit_bias, **SAMPLING)
                tokens += response["usage"]["completion_tokens"]
        return tokens, time.perf_counter() - start


def rate(result: tuple[int, float] | None) -> float | None:
    return round(result[0] / result[1], 1) if result else None


async def main(args: argparse.Namespace) -> None:
    all_shapes = {"a": Shape("a", PROMPTS, 1, args.max_tokens), "b": Shape("b", PROMPTS[:4], 8, args.max_tokens),
                  "c": Shape("c", BURST_PROMPTS, 1, args.burst_max_tokens)}
    shapes = [all_shapes[s.strip()] for s in args.shapes.split(",") if s.strip()]
    warm = Shape("warm-up", PROMPTS[:1], 1, 4)

    # Load everything first, then time the systems shape by shape (drift on a shared machine
    # then hits each shape's numbers about equally).
    hf = None if args.skip_hf else HFGenerate()
    llama, llama_status = None, "skipped (--skip-llama-cpp)"
    if not args.skip_llama_cpp:
        try:
            llama, llama_status = LlamaCpp(), "ok"
        except Exception as exc:  # ImportError when not installed; anything the C library raises
            llama_status = f"unavailable: {type(exc).__name__}: {exc}"
    exporter = None
    if args.tracing == "on":  # every span recorded by the SDK and kept in memory (no network)
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from art.observability import tracing

        exporter = InMemorySpanExporter()
        tracing.configure(exporter=exporter)
    with tempfile.TemporaryDirectory(prefix="art-bench-") as root:
        ours = Ours()
        await ours.start(root)
        try:
            for model in ("bench", art.DEFAULT_MODEL):
                await ours.run(warm, model)
            for system in (hf, llama):
                if system is not None:
                    system.run(warm)
            results = {}
            for shape in shapes:
                print(f"shape {shape.name}: {len(shape.prompts)} prompts x n={shape.n}, "
                      f"max_tokens {shape.max_tokens} ...", flush=True)
                results[shape.name] = {
                    "ours": await ours.run(shape, "bench"),
                    "ours_base": await ours.run(shape, art.DEFAULT_MODEL),
                    "hf": hf.run(shape) if hf else None,
                    "llama_cpp": llama.run(shape) if llama else None,
                }
        finally:
            await ours.backend.close()

    rows, report = [], {"benchmark": "engine_throughput"}
    for name, r in results.items():
        ours_tps, hf_tps, llama_tps = rate(r["ours"]), rate(r["hf"]), rate(r["llama_cpp"])
        for label, key in [("ours (LoRA step 0)", "ours"), ("ours (base model id)", "ours_base"),
                           ("hf generate", "hf"), ("llama.cpp", "llama_cpp")]:
            tokens, seconds = r[key] or (None, None)
            rows.append([f"{name}  {label}", tokens, seconds, rate(r[key]),
                         ratio(ours_tps, rate(r[key])) if key not in ("ours", "ours_base") else None])
        report[f"shape_{name}"] = {
            "ours_tok_s": ours_tps, "hf_generate_tok_s": hf_tps, "llama_cpp_tok_s": llama_tps,
            "ratio_vs_hf": ratio(ours_tps, hf_tps), "ratio_vs_llama_cpp": ratio(ours_tps, llama_tps),
            "completion_tokens": {k: v[0] for k, v in r.items() if v},
            "seconds": {k: round(v[1], 1) for k, v in r.items() if v},
        }
        if name == "c":
            report["shape_c"]["inside_client_timeout"] = r["ours"][1] < BURST_CLIENT_TIMEOUT_S
    report["ours_base_model"] = {f"shape_{n}_tok_s": rate(r["ours_base"]) for n, r in results.items()}
    report["llama_cpp"] = {
        "status": llama_status,
        "how": "llama-cpp-python create_chat_completion, one request at a time; EOS forced off with "
               "logit_bias -inf on every end-of-generation id; tokens counted from usage"}
    report["settings"] = {
        "model": art.DEFAULT_MODEL, "max_tokens": args.max_tokens, **SAMPLING, "top_k": "off", "min_p": "off",
        "ignore_eos": True, "shapes": {s.name: f"{len(s.prompts)} prompts x n={s.n}, max_tokens {s.max_tokens}"
                                       for s in shapes},
        "goal": ">= 4x hf_generate on shapes a and b, >= 2x llama_cpp on shape b; shape c: seconds.ours "
                f"< {BURST_CLIENT_TIMEOUT_S} (the burst's client timeout)"}
    report["tracing"] = {"mode": args.tracing, "spans": len(exporter.get_finished_spans()) if exporter else 0}
    report.update(environment())
    print()
    print(table(["shape  system", "tokens", "seconds", "tok/s", "ours x"], rows))
    print(json.dumps(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens per completion")
    parser.add_argument("--shapes", default="a,b", help="comma-separated subset of a,b,c (c: the 288-request burst)")
    parser.add_argument("--burst-max-tokens", type=int, default=100,
                        help="completion tokens per request of shape c (yes_no_maybe.py asks 100)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers generate baseline")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="do not run the llama.cpp reference")
    parser.add_argument("--tracing", choices=["off", "on"], default="off",
                        help="on: OpenTelemetry spans recorded (in memory) for every request (tracing_overhead.py)")
    asyncio.run(main(parser.parse_args()))
