"""The backend on a CUDA GPU: bf16 serving against the reference, CUDA graph replay against eager
decoding, memory errors. (Learning in bf16 with trainer/engine agreement is
tests/training/test_mixed_precision.py; serving during a step is tests/server/test_concurrency.py; both run
on CUDA too when there is one.)

Skipped without CUDA (`benchmarks/gpu_check.sh` runs them on the H200). The same code runs on
the CPU in the rest of the suite; these check what only a GPU exercises.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import art
from art.engine.adapters import LIVE, AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.config import EngineConfig
from art.engine.llm_engine import LLMEngine
from art.engine.static_runner import StaticRunner
from art.errors import ArtValueError
from art.service import probe
from tests.support.decoding import decode_steps
from tests.support.models import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16_TOLERANCE = probe.HALF_TOLERANCE


def cuda_lora_model(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to("cuda")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model_path)


async def test_bf16_engine_with_graphs_matches_the_reference(tiny_model_path):
    """32 greedy steps per prompt: each engine token is the reference's argmax up to a bf16 tie,
    and its logprob (teacher-forced through transformers) is within the bf16 tolerance."""
    model, tokenizer = cuda_lora_model(tiny_model_path)
    adapters = AdapterSet(model)
    engine = LLMEngine(model, tokenizer, adapters=adapters, max_num_seqs=16, enforce_eager=False)
    try:
        assert engine.config.on_cuda and engine.config.dtype == "bfloat16" and engine.runner.graphs is not None
        prompts = [[1, 5, 9], list(range(100, 120)), list(range(200, 207)), [7] * 30]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        live = AdapterRef("tiny", None, None)
        results = await asyncio.gather(*[engine.generate(p, params, live) for p in prompts])
        assert engine.runner.graphs.replays > 0
        for prompt, (got,) in zip(prompts, results):
            ids = torch.tensor([prompt + got.token_ids], device="cuda")
            with torch.no_grad():
                reference = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            chosen = reference.gather(1, torch.tensor(got.token_ids, device="cuda")[:, None])[:, 0]
            assert (reference.max(-1).values - chosen).max() <= BF16_TOLERANCE  # greedy, up to ties
            assert (chosen - torch.tensor(got.logprobs, device="cuda")).abs().max() <= BF16_TOLERANCE
    finally:
        engine.stop()


def test_graph_replay_equals_eager_decoding():
    """The first H200 run failed this one (max difference 0.69 on 98.8% of the logits);
    `benchmarks/graph_diagnosis.py` runs the same case under each SDPA kernel with controls."""
    model = tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16)
    runs = {}
    for eager in (False, True):
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=eager).resolve(model),
                              max_model_len=128)
        runs[eager] = (decode_steps(runner, steps=8), runner)
    graphs = runs[False][1].graphs
    assert graphs.failures == 0, graphs.last_failure
    assert graphs.replays == 8 and len(graphs.graphs) >= 1 and runs[True][1].graphs is None
    torch.testing.assert_close(runs[False][0], runs[True][0], atol=1e-3, rtol=0)


@pytest.mark.integration
async def test_kv_cache_that_does_not_fit_names_the_knob(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="big", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_args": {"gpu_memory_utilization": 0.001}})
    with pytest.raises(ArtValueError) as info:
        await model.register(backend)
    assert info.value.field == "engine_args.gpu_memory_utilization" and "max_model_len" in str(info.value)
    await backend.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_graphs_on_a_second_device_record_the_step_from_any_thread():
    """An engine on cuda:1, its decode steps run from a new thread (which starts on device 0):
    the graphs record real work (replays equal eager decoding) instead of an empty graph."""
    import threading

    model = tiny_model("llama").to(device="cuda:1", dtype=torch.bfloat16)
    results = {}

    def run(eager: bool) -> None:
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(device="cuda:1", enforce_eager=eager).resolve(model),
                              max_model_len=128)
        results[eager] = (decode_steps(runner), runner)

    for eager in (False, True):
        thread = threading.Thread(target=run, args=(eager,))
        thread.start()
        thread.join()
    graphs = results[False][1].graphs
    assert graphs.replays == 6 and graphs.failures == 0 and graphs.graphs
    torch.testing.assert_close(results[False][0], results[True][0], atol=1e-3, rtol=0)


def test_capture_while_another_thread_allocates_and_syncs():
    """Another model's thread (here: allocations, frees, .item() syncs in a loop) runs while this
    engine records its graphs at start and lazily at a wider width: no capture fails."""
    import threading

    stop = threading.Event()

    def busy() -> None:  # no CUDA RNG: a draw from the default generator while another thread records raises
        while not stop.is_set():
            x = torch.full((1 << 20,), 0.5, device="cuda")
            float(x.sum())
            del x

    other = threading.Thread(target=busy)
    other.start()
    try:
        model = tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16)
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=False).resolve(model), max_model_len=512)
        started = len(runner.graphs.graphs)
        wide = decode_steps(runner, long=True)  # positions past 256: a wider width, recorded now
    finally:
        stop.set()
        other.join()
    assert started > 1 and len(runner.graphs.graphs) > started and runner.graphs.failures == 0
    eager = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=True).resolve(model), max_model_len=512)
    torch.testing.assert_close(wide, decode_steps(eager, long=True), atol=1e-3, rtol=0)


def test_an_empty_graph_is_refused_and_that_shape_decodes_eagerly():
    """A capture that records nothing (as one on another device's stream does) fails the replay
    check: that shape decodes eagerly, correctly, and the failure is counted."""
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    runner = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=False).resolve(model), max_model_len=512)
    real = runner.decoder.forward

    def nothing_while_capturing(*args, out=None, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            return out  # records no kernel: an empty graph
        return real(*args, out=out, **kwargs)

    runner.decoder.forward = nothing_while_capturing
    got = decode_steps(runner, long=True)  # width 512: not captured at start
    failure = runner.graphs.last_failure
    assert runner.graphs.failures >= 1 and ("empty" in failure or "does not compute the step" in failure)
    eager = StaticRunner(model, AdapterSet(model), EngineConfig(enforce_eager=True).resolve(model), max_model_len=512)
    torch.testing.assert_close(got, decode_steps(eager, long=True), atol=1e-3, rtol=0)


def test_kv_sizing_counts_memory_the_allocator_holds_and_leaves_a_share_for_a_second_model():
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(enforce_eager=True, gpu_memory_utilization=0.3).resolve(model)
    first = StaticRunner(model, AdapterSet(model), config, max_model_len=512)
    positions = first.kv_positions
    del first  # its cache goes back to PyTorch's allocator, not to the device
    again = StaticRunner(model, AdapterSet(model), config, max_model_len=512)
    assert again.kv_positions == pytest.approx(positions, rel=0.05)  # not smaller for the cached blocks
    second = StaticRunner(model, AdapterSet(model), config, max_model_len=512)
    assert 0.5 * 0.7 * positions < second.kv_positions < 0.9 * positions  # a share of what the first left


def test_a_model_served_through_transformers_gets_a_kv_budget_on_cuda(tiny_model_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer), n_positions=256,
                                       eos_token_id=tokenizer.eos_token_id)).to("cuda", torch.bfloat16).eval()
    engine = LLMEngine(model, tokenizer, max_num_seqs=8, gpu_memory_utilization=0.2)
    try:
        assert engine.runner.kv_positions > 0 and engine.scheduler.max_kv_tokens == engine.runner.kv_positions
    finally:
        engine.stop()
    with pytest.raises(ArtValueError) as info:
        LLMEngine(model, tokenizer, gpu_memory_utilization=1e-6)
    assert info.value.field == "engine_args.gpu_memory_utilization"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_the_tool_agents_shape_matches_transformers(tiny_model_path, dtype):
    """What the tool agent sends, on a LoRA model: 8 prompts of about 260 tokens sharing a 250-token
    prefix (the shared prefix prefilled once, then masked blocks behind it at a width that is not a
    multiple of 16), decoded greedily with graphs across the narrowest width (256 -> 512). Every
    token's logprob is transformers' on the same tokens, and is its argmax up to a tie."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.fakes import randomize_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype).to("cuda")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    randomize_lora(model, seed=5)
    engine = LLMEngine(model, AutoTokenizer.from_pretrained(tiny_model_path), adapters=AdapterSet(model),
                       max_num_seqs=16, enforce_eager=False)
    tolerance = 2e-3 if dtype == torch.float32 else BF16_TOLERANCE
    common = [(37 * i) % 900 + 50 for i in range(250)]
    prompts = [common + [1000 + i, 1100 + 3 * i, 1200 + i] + [7] * i for i in range(8)]
    try:
        assert engine.runner.graphs is not None
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        results = await asyncio.gather(*[engine.generate(p, params, AdapterRef("tiny", None, None)) for p in prompts])
        assert engine.runner.graphs.replays > 0 and engine.runner.graphs.failures == 0
        for prompt, (got,) in zip(prompts, results):
            ids = torch.tensor([prompt + got.token_ids], device="cuda")
            with torch.no_grad():
                reference = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            chosen = reference.gather(1, torch.tensor(got.token_ids, device="cuda")[:, None])[:, 0]
            assert float((reference.max(-1).values - chosen).max()) <= tolerance  # greedy, up to ties
            assert float((chosen - torch.tensor(got.logprobs, device="cuda")).abs().max()) <= tolerance
    finally:
        engine.stop()


async def test_a_step_published_from_the_trainers_thread_reaches_only_the_requests_after_it(tiny_model_path):
    """On CUDA the engine decodes on a stream of its own while the trainer's thread writes the live
    adapter on its thread's stream (`serving_while_training`, with graphs). A request decoding when
    the trainer publishes step 2 ends on step 1's weights; one admitted after samples step 2.
    float32, so the references are exact to kernel noise and a mix-up shows."""
    import threading

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.fakes import randomize_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to("cuda")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    randomize_lora(model, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt, live = [5, 9, 13, 200], AdapterRef("tiny", None, None)

    def lora_state() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    def reference(state: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
        now = lora_state()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in state:
                    param.copy_(state[name])
            logits = model(input_ids=torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1]
            for name, param in model.named_parameters():
                if name in now:
                    param.copy_(now[name])
        return logits.log_softmax(-1).gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].cpu()

    engine = LLMEngine(model, tokenizer, adapters=AdapterSet(model, live_step=1), max_num_seqs=8, dtype="float32",
                       enforce_eager=False)
    try:
        assert engine.config.on_cuda and engine.runner.graphs is not None and engine.serves_while_training
        step1 = lora_state()
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)  # decoding all through the step
        short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        published = {}

        def train_and_publish() -> None:
            """The trainer's thread: queued work on its own stream, then the writes, then the publish."""
            x = torch.randn(2048, 2048, device="cuda")
            for _ in range(10):
                x = (x @ x).tanh()  # the trainer's stream is busy while the engine's decodes
            randomize_lora(model, seed=6)
            published["step2"] = lora_state()
            with engine.lock:
                published["running"] = engine.running
                engine.weights_updated(2)

        with engine.serving_while_training():
            stream = engine.stream(prompt, long, live)
            seen = []
            async for item in stream:
                seen += item.token_ids
                if len(seen) >= 3:
                    break
            during = (await engine.generate(prompt, short, live))[0]
            trainer = threading.Thread(target=train_and_publish)
            trainer.start()
            await asyncio.to_thread(trainer.join)
            after = (await engine.generate(prompt, short, live))[0]
            spanning = [item async for item in stream][-1][0]
    finally:
        engine.stop()

    assert published["running"] == 1  # the long request was decoding when step 2 was published
    assert during.step == 1 and spanning.step == 1 and after.step == 2 and len(spanning.token_ids) == 500
    step2 = published["step2"]
    torch.testing.assert_close(torch.tensor(spanning.logprobs), reference(step1, spanning.token_ids), atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(during.logprobs), reference(step1, during.token_ids), atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(after.logprobs), reference(step2, after.token_ids), atol=2e-3, rtol=0)
    assert (reference(step2, spanning.token_ids) - torch.tensor(spanning.logprobs)).abs().max() > 5e-2
