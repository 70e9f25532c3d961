"""The engine's own decoder (static runner) against transformers + peft, for every architecture it
covers: prefill after a cached prefix, decode steps, rows moving down when others finish, and
the three ways of applying adapters (merged live weights, one adapter, a mixed batch)."""

from __future__ import annotations

import pytest
import torch

from art.engine.adapters import BASE, LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.decoder import unsupported_reason
from art.engine.static_runner import StaticRunner
from tests.support.models import VOCAB, tiny_model


def expected_logits(model, ids: list[int], adapter: str) -> torch.Tensor:
    """transformers + peft, the whole sequence at once, no cache: logits [tokens, vocab]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), adapter_names=[adapter]).logits[0].log_softmax(-1)


@pytest.mark.parametrize("pad,prefill_tokens", [(False, 4096), (True, 4096), (False, 7)],
                         ids=["exact", "bucketed", "prefill-in-blocks"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_decoder_matches_transformers(arch, pad, prefill_tokens):
    """`prefill_tokens=7` prefills three prompts in blocks of two tokens (one at a time after a
    cached prefix): every block attends over what earlier blocks wrote, and each row's logits
    come from the block holding its last token."""
    model = tiny_model(arch)
    assert unsupported_reason(model) is None
    config = EngineConfig(pad_batches=pad, prefill_tokens=prefill_tokens).resolve()
    runner = StaticRunner(model, AdapterSet(model), config, max_model_len=128)
    prompts = [[5, 9, 13, 200, 7, 3, 44, 61, 2], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
               [5, 9, 13, 200, 7, 3, 100]]
    with torch.inference_mode():
        for names in ([LIVE] * 3, [BASE] * 3, [LIVE, BASE, "other"]):
            # Prompt 2 shares 6 tokens with prompt 0: prefill it after that prefix, cached from a
            # pass with prompt 2's adapter (keys and values depend on the weights).
            _, first = runner.prefill(prompts[:1], [(0, None)], names[2:])
            cached = runner.prompt_kv(first, 0)
            logits, staged = runner.prefill(prompts, [(0, None), (0, None), (6, cached)], names)
            for row, prompt in enumerate(prompts):
                want = expected_logits(model, prompt, names[row])[-1]
                torch.testing.assert_close(logits[row].log_softmax(-1), want, atol=1e-4, rtol=0)
            runner.add(staged, [0, 1, 2])
            sequences = [list(p) for p in prompts]
            rows = [0, 1, 2]
            for step in range(6):
                tokens = [int(torch.randint(VOCAB, (1,))) for _ in rows]
                for r, t in zip(rows, tokens):
                    sequences[r].append(t)
                positions = [len(sequences[r]) - 1 for r in rows]
                out = runner.decode(tokens, positions, [names[r] for r in rows])
                for i, r in enumerate(rows):
                    want = expected_logits(model, sequences[r], names[r])[-1]
                    torch.testing.assert_close(out[i].log_softmax(-1), want, atol=1e-4, rtol=0, msg=f"{names}, row {r}")
                if step == 2:  # row 0 finishes: rows 1 and 2 move down a slot
                    runner.keep([1, 2])
                    rows = [1, 2]
            runner.clear()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_masked_prefill_with_keys_repeated_per_head_is_the_grouped_one(arch):
    """CUDA's way of a masked prefill (keys repeated per query head, for the memory-efficient
    kernel) gives the CPU's (SDPA's grouped heads), after a cached prefix and in blocks."""
    model = tiny_model(arch)
    prompts = [[5, 9, 13, 200, 7, 3, 44, 61, 2], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    out = []
    for repeat in (False, True):
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(prefill_tokens=8).resolve(), max_model_len=128)
        runner.decoder.repeat_kv = repeat
        with torch.inference_mode():
            _, first = runner.prefill([prompts[0][:6]], [(0, None)], [LIVE])
            logits, _ = runner.prefill(prompts, [(6, runner.prompt_kv(first, 0)), (0, None)], [LIVE, LIVE])
        out.append(logits)
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(out[1][row].log_softmax(-1), expected_logits(model, prompt, LIVE)[-1],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("repeat_kv", [False, True], ids=["grouped", "repeated"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefill_blocks_behind_earlier_positions_run_causal_and_exact(arch, repeat_kv, monkeypatch):
    """A block behind a short shared cached prefix takes SDPA's causal kernel with zero queries in
    front; a block behind more than half its length (a long prompt's later blocks) takes a mask.
    Every way gives transformers' logits. (Mistral's 6-token window always needs the mask.)"""
    import torch.nn.functional as F

    from art.engine.static_runner import CAUSAL_BEHIND

    assert CAUSAL_BEHIND == 0.5  # the expected paths below follow from it
    model = tiny_model(arch)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q.shape[2], attn_mask is None and is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    long = [(13 * i) % 290 + 5 for i in range(40)]
    shared = long[:4]
    pair = [shared + [7, 8, 9, 10, 11, 12, 13, 14, 15], shared + [20, 21, 22, 23, 24]]  # the same 4 cached
    out = {}
    for prefill_tokens in (8, 16):
        runner = StaticRunner(model, AdapterSet(model), EngineConfig(prefill_tokens=prefill_tokens).resolve(),
                              max_model_len=128)
        runner.decoder.repeat_kv = repeat_kv
        with torch.inference_mode():
            calls.clear()
            if prefill_tokens == 8:  # blocks of 8: the first causal, the four behind it masked
                out["long"], _ = runner.prefill([long], [(0, None)], [LIVE])
            else:  # blocks of 8 tokens per row: 8 behind 4 (causal), then 1 behind 12 (masked)
                _, first = runner.prefill([shared + [0]], [(0, None)], [LIVE])
                prefix = runner.prompt_kv(first, 0)
                calls.clear()
                out["pair"], _ = runner.prefill(pair, [(4, prefix), (4, prefix)], [LIVE, LIVE])
            out[prefill_tokens] = list(calls)
    torch.testing.assert_close(out["long"][0].log_softmax(-1), expected_logits(model, long, LIVE)[-1],
                               atol=1e-4, rtol=0)
    for row, prompt in enumerate(pair):
        torch.testing.assert_close(out["pair"][row].log_softmax(-1), expected_logits(model, prompt, LIVE)[-1],
                                   atol=1e-4, rtol=0)
    if arch == "llama":  # (query length, zero queries included; causal) per layer (2) and block
        assert out[8] == [(8, True)] * 2 + [(8, False)] * 8
        assert out[16] == [(12, True)] * 2 + [(2, False)] * 2  # 1 token: the grouped decode layout


def test_merged_weights_follow_weight_updates_and_the_base_stays_exact():
    """Live-only batches run on a prepared merged copy; after `weights_changed` it is rebuilt from the
    new adapter, and the shared base weights are never touched."""
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    runner = StaticRunner(model, AdapterSet(model), EngineConfig(merge_lora=True).resolve(), max_model_len=128)
    prompt = [5, 9, 13, 200, 7]
    with torch.inference_mode():
        old, _ = runner.prefill([prompt], [(0, None)], [LIVE])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.default" in name:
                param.add_(0.5)  # what an optimizer step does: in place
    with torch.inference_mode():
        stale, _ = runner.prefill([prompt], [(0, None)], [LIVE])
        runner.weights_changed(all_weights=False)
        new, _ = runner.prefill([prompt], [(0, None)], [LIVE])
    want = expected_logits(model, prompt, LIVE)[-1]
    torch.testing.assert_close(stale, old)  # without the notice the merged copy is stale...
    torch.testing.assert_close(new[0].log_softmax(-1), want, atol=1e-4, rtol=0)  # ...with it, it is current
    assert (new - old).abs().max() > 0.1
    after = {n: p.detach() for n, p in model.named_parameters() if "base_layer" in n}
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_unsupported_architectures_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    reason = unsupported_reason(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)))
    assert reason is not None and "gpt2" in reason
