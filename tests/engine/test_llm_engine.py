"""The batched engine against the plain reference sampler, on a tiny model with adapters."""

import asyncio
import time

import pytest
import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.llm_engine import LLMEngine
from art.engine.reference import ReferenceSampler
from art.errors import ArtValueError
from tests.support.fakes import randomize_lora


@pytest.fixture(scope="module", params=[False, True], ids=["exact-batches", "bucketed-batches"])
def setup(tiny_model_path, tmp_path_factory, request):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    model.eval()
    checkpoint = tmp_path_factory.mktemp("ckpt") / "0001"
    randomize_lora(model, seed=1)
    model.save_pretrained(str(checkpoint))  # step 1's weights on disk
    randomize_lora(model, seed=2)  # the live adapter now holds step 2
    adapters = AdapterSet(model, live_step=2)
    # Bucketed: decode batches padded to bucket sizes, the static shapes CUDA graphs replay.
    engine = LLMEngine(model, tokenizer, adapters=adapters, max_num_seqs=16, prefix_cache_tokens=4096,
                       pad_batches=request.param)
    reference = ReferenceSampler(model, tokenizer, adapters=adapters)
    return engine, reference, checkpoint


ADAPTERS = {
    "base": None,
    "live": AdapterRef("tiny", None, None),
    "step1": AdapterRef("tiny@1", None, 1),  # path filled in per test
}


def cases(checkpoint):
    prompts = [[1, 5, 9], list(range(100, 109)), list(range(200, 217)), list(range(300, 330))]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    seeded = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    nucleus = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=5, seed=3, top_logprobs=2)
    truncated = SamplingParams(n=2, temperature=1.2, top_k=5, min_p=0.02, top_p=0.95, max_tokens=5, seed=4)
    refs = {"base": None, "live": ADAPTERS["live"], "step1": AdapterRef("tiny@1", checkpoint, 1)}
    out = []
    for i, prompt in enumerate(prompts):
        for j, (label, ref) in enumerate(refs.items()):
            out.append((prompt, [greedy, seeded, nucleus, truncated][(i + j) % 4], ref, label))
    return out


async def test_engine_matches_reference_in_mixed_batches(setup):
    engine, reference, checkpoint = setup
    work = cases(checkpoint)
    results = await asyncio.gather(*[engine.generate(p, params, ref) for p, params, ref, _ in work])
    with engine.lock:
        expected = [reference.generate(p, params, ref) for p, params, ref, _ in work]
    served_steps = set()
    for (prompt, params, ref, label), got, want in zip(work, results, expected):
        assert len(got) == params.n
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, (label, prompt[:3], params)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert g.finish_reason == w.finish_reason and g.text == w.text
            assert g.step == w.step
            if params.top_logprobs:
                assert [[t for t, _ in alt] for alt in g.top_logprobs] == [[t for t, _ in alt] for alt in w.top_logprobs]
            served_steps.add(g.step)
    assert served_steps == {None, 1, 2}  # base, checkpoint 1 and the live step 2 were all served
    # Different adapters really give different outputs for the same prompt.
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = [await engine.generate([1, 5, 9], greedy, ref) for ref in (None, ADAPTERS["live"], work[2][2])]
    assert len({tuple(o[0].logprobs) for o in outs}) == 3


async def test_shared_prefixes_are_prefilled_once_and_change_nothing(setup):
    engine, reference, _ = setup
    prompt = list(range(400, 440))
    params = SamplingParams(temperature=0, max_tokens=5)
    computed, seen = engine.runner.prefill_computed_tokens, engine.prompt_tokens
    group = await asyncio.gather(*[engine.generate(prompt, params, ADAPTERS["live"]) for _ in range(4)])
    longer = await engine.generate(prompt + [7, 8, 9], params, ADAPTERS["live"])
    assert engine.prompt_tokens - seen == 4 * len(prompt) + len(prompt) + 3
    # The group's prompt is computed once; the longer prompt only computes its last tokens.
    assert engine.runner.prefill_computed_tokens - computed <= len(prompt) + 3 + 1
    others = [list(range(500, 540)) + [i] * 5 for i in range(3)]  # one shared 40-token prefix
    computed = engine.runner.prefill_computed_tokens
    varied = await asyncio.gather(*[engine.generate(p, params, ADAPTERS["live"]) for p in others])
    assert engine.runner.prefill_computed_tokens - computed <= 41 + 3 * 6
    with engine.lock:
        want = reference.generate(prompt, params, ADAPTERS["live"])[0]
        want_longer = reference.generate(prompt + [7, 8, 9], params, ADAPTERS["live"])[0]
    assert all(g[0].token_ids == want.token_ids for g in group)
    assert longer[0].token_ids == want_longer.token_ids
    assert longer[0].logprobs == pytest.approx(want_longer.logprobs, abs=1e-4)
    with engine.lock:
        want_varied = [reference.generate(p, params, ADAPTERS["live"])[0] for p in others]
    for got, want in zip(varied, want_varied):
        assert got[0].token_ids == want.token_ids
        assert got[0].logprobs == pytest.approx(want.logprobs, abs=1e-4)


async def test_overload_queues_and_impossible_requests_are_refused(setup):
    engine, _, _ = setup
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, ignore_eos=True)
    depths = []
    tasks = [asyncio.ensure_future(engine.generate([1, 2, 3], params, None)) for _ in range(8)]
    while not all(t.done() for t in tasks):
        depths.append(engine.queue_depth)
        assert engine.running <= 16
        await asyncio.sleep(0.005)
    assert max(depths) > 0  # 8 x 4 samples > 16 rows: some waited
    assert all(len(c.token_ids) == 24 for t in tasks for c in t.result())
    with pytest.raises(ArtValueError) as info:
        await engine.generate([1, 2, 3], SamplingParams(n=17), None)
    assert info.value.field == "n"


async def test_stop_fails_unfinished_requests_and_ends_the_thread(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from art.errors import BackendError

    engine = LLMEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                       AutoTokenizer.from_pretrained(tiny_model_path), max_num_seqs=1)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    tasks = [asyncio.ensure_future(engine.generate([1, 2, 3], params, None)) for _ in range(3)]
    await asyncio.sleep(0.2)
    await asyncio.to_thread(engine.stop)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert sum(isinstance(r, BackendError) for r in results) >= 2  # the queued ones at least
    assert not engine._thread.is_alive()
    with pytest.raises(BackendError):
        await engine.generate([1, 2, 3], params, None)


def test_an_answer_for_a_closed_event_loop_leaves_the_engine_running(tiny_model_path):
    """A caller's loop may close before its answer is ready (a script that raised): the answer
    is dropped and the engine thread goes on serving others."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = LLMEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                       AutoTokenizer.from_pretrained(tiny_model_path), max_num_seqs=2)
    try:
        async def leave_early() -> None:
            asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True), None))
            await asyncio.sleep(0.05)  # submitted; asyncio.run then cancels it and closes the loop

        asyncio.run(leave_early())
        for _ in range(3000):  # until the abandoned request has finished and its answer was delivered
            if not engine.running and not engine.queue_depth:
                break
            time.sleep(0.01)
        assert engine._thread.is_alive()

        async def ask():
            return await asyncio.wait_for(engine.generate([1, 2, 3], SamplingParams(max_tokens=4), None), 60)

        assert len(asyncio.run(ask())[0].token_ids) <= 4
    finally:
        engine.stop()


def test_bad_engine_limits_are_refused_by_name(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(ArtValueError) as info:
        LLMEngine(model, tokenizer, max_num_seqs=0, kv_cache_bytes=-5, max_model_len=True)
    assert info.value.field == "engine_args.max_num_seqs"  # the first, in EngineConfig's field order
    assert "max_model_len" in str(info.value) and "kv_cache_bytes" in str(info.value)
    LLMEngine(model, tokenizer, prefix_cache_tokens=0).stop()  # no prefix cache is allowed


async def test_architectures_the_decoder_does_not_cover_run_through_transformers(tiny_model_path):
    """A GPT-2 model goes through HFRunner (transformers' forward) and still matches the reference."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from art.engine.hf_runner import HFRunner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer),
                                       n_positions=256, eos_token_id=tokenizer.eos_token_id)).eval()
    engine = LLMEngine(model, tokenizer, max_num_seqs=8)
    try:
        assert isinstance(engine.runner, HFRunner)
        reference = ReferenceSampler(model, tokenizer)
        prompts = [[1, 5, 9], list(range(100, 112)), [1, 5, 9, 4]]
        params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=11)
        results = await asyncio.gather(*[engine.generate(p, params, None) for p in prompts])
        for prompt, got in zip(prompts, results):
            want = reference.generate(prompt, params, None)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            for g, w in zip(got, want):
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    finally:
        engine.stop()


async def test_rows_finishing_in_every_position_move_at_most_one_row_each(setup):
    """Eight rows that finish one per step, at every position of the batch (first, last, middle):
    each freed slot takes the last running row (one copy per finished row), and every token and
    logprob is still the reference's."""
    engine, reference, _ = setup
    lengths = [3, 8, 1, 6, 2, 7, 4, 5]  # request i finishes after lengths[i] tokens; rows join in this order
    prompts = [[11 + i, 40, 41, 42 + i] for i in range(len(lengths))]
    work = [(p, SamplingParams(temperature=1.0, max_tokens=n, seed=100 + i, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    moved = engine.runner.stats()["engine/kv_rows_moved"]
    with engine.paused():  # all eight wait, then join the batch in one step, in this order
        tasks = [asyncio.ensure_future(engine.generate(p, params, ADAPTERS["live"])) for p, params in work]
        while engine.queue_depth < len(work):
            await asyncio.sleep(0.001)
    results = await asyncio.gather(*tasks)
    moved = engine.runner.stats()["engine/kv_rows_moved"] - moved
    with engine.lock:
        expected = [reference.generate(p, params, ADAPTERS["live"]) for p, params in work]
    for (got,), (want,), n in zip(results, expected, lengths):
        assert len(got.token_ids) == n and got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    # The 1-token request ends at its prefill; moving every later row down at each of the other
    # finishes would copy 10 rows. Swap-remove copies one when the finished row is not the last.
    assert 0 < moved <= len(lengths) - 2


async def test_a_long_prompt_is_prefilled_in_blocks_beside_running_rows(setup):
    """With prefill_tokens=32 a 150-token prompt is prefilled in five blocks while another request
    decodes (100 tokens: far from done when the long one is, about 15 steps after it started);
    both match the reference. A prefill that fails (here an injected out-of-memory) fails its own
    request only: the running one finishes."""
    _, reference, _ = setup
    model, tokenizer = reference.model, reference.stopping.tokenizer
    engine = LLMEngine(model, tokenizer, adapters=reference.adapters, max_num_seqs=8, prefill_tokens=32)
    try:
        running_params = SamplingParams(temperature=1.0, max_tokens=100, seed=5, ignore_eos=True)  # still running
        long_prompt = [(7 * i) % 250 + 3 for i in range(150)]
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=6, ignore_eos=True)
        running = asyncio.ensure_future(engine.generate([1, 2, 3], running_params, ADAPTERS["live"]))
        while engine.steps < 3:
            await asyncio.sleep(0.01)
        (got,) = await engine.generate(long_prompt, params, ADAPTERS["live"])
        assert not running.done()  # it was decoding meanwhile
        (got_running,) = await running
        with engine.lock:
            (want,) = reference.generate(long_prompt, params, ADAPTERS["live"])
            (want_running,) = reference.generate([1, 2, 3], running_params, ADAPTERS["live"])
        assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert got_running.token_ids == want_running.token_ids

        real_prefill = engine.runner.prefill

        def out_of_memory_for_long_prompts(prompts, prefixes, adapter_names):
            if max(map(len, prompts)) > 100:
                raise MemoryError("injected: the long prompt does not fit")
            return real_prefill(prompts, prefixes, adapter_names)

        engine.runner.prefill = out_of_memory_for_long_prompts
        running = asyncio.ensure_future(engine.generate([1, 2, 3], running_params, ADAPTERS["live"]))
        start = engine.steps
        while engine.steps < start + 3:
            await asyncio.sleep(0.01)
        with pytest.raises(MemoryError, match="injected"):
            await engine.generate(long_prompt + [9], params, ADAPTERS["live"])
        assert not running.done()
        (again,) = await running
        assert again.token_ids == want_running.token_ids  # untouched by the other request's failure
    finally:
        engine.stop()
