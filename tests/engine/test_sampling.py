"""`sample_next`'s truncations (top_k, min_p, top_p) on logits whose ranks are known."""

import torch

from art.engine.base import SamplingParams
from art.engine.sampling import make_generator, sample_next

# Token 0 is the most likely, then 1, 2, ...: probabilities ~ 0.43, 0.21, 0.12, 0.07, ...
LOGITS = -0.6 * torch.arange(32, dtype=torch.float32)


def drawn(params: SamplingParams, draws: int = 400) -> set[int]:
    """The tokens `params` draws from LOGITS over `draws` seeds (one row per seed, one batch)."""
    logits = LOGITS.repeat(draws, 1)
    generators = [make_generator(11, i) for i in range(draws)]
    tokens, _, _ = sample_next(logits, [params] * draws, generators)
    return set(tokens.tolist())


def test_top_k_draws_only_the_k_most_likely_tokens():
    assert drawn(SamplingParams(top_k=3)) == {0, 1, 2}
    assert drawn(SamplingParams(top_k=1)) == {0}
    assert len(drawn(SamplingParams(top_k=0))) > 3  # 0 keeps the whole distribution


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    # 0.6 * k below the top logit: token k keeps exp(-0.6 k) of token 0's probability.
    assert drawn(SamplingParams(min_p=0.25)) == {0, 1, 2}  # exp(-1.2) = 0.30 kept, exp(-1.8) = 0.17 not
    assert drawn(SamplingParams(min_p=1.0)) == {0}


def test_truncations_compose_and_temperature_applies_first():
    # Temperature 3 flattens the logits (token k keeps exp(-0.2 k)), so min_p 0.25 keeps tokens 0-6;
    # top_k 4 then keeps 0-3.
    assert drawn(SamplingParams(temperature=3.0, min_p=0.25)) == set(range(7))
    assert drawn(SamplingParams(temperature=3.0, min_p=0.25, top_k=4)) == {0, 1, 2, 3}


def test_rows_keep_their_own_truncation_and_report_raw_logprobs():
    params = [SamplingParams(top_k=1), SamplingParams(top_k=2, seed=1), SamplingParams(min_p=1.0)]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(5)])
    tokens, logprobs, _ = sample_next(logits, params, [make_generator(3, i) for i in range(3)])
    assert tokens[0] == 0 and tokens[1] in (30, 31) and tokens[2] == 5
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(logprobs, raw.gather(1, tokens[:, None]).squeeze(1))


def test_a_rows_draw_does_not_depend_on_its_neighbours_settings():
    # Near-uniform over a large vocabulary: a draw lands on a neighbouring token if anything
    # re-normalises the row. Each row, batched with rows that cut differently, draws what it
    # draws alone (the reference sampler's case).
    logits = 0.01 * torch.randn(2, 50_000, generator=torch.Generator().manual_seed(0))
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=2_000),
             SamplingParams(temperature=1.3, min_p=0.5)]
    for seed in range(10):
        rows = logits.repeat(2, 1)  # [4, vocab]: every kind once
        batched, _, _ = sample_next(rows, kinds, [make_generator(seed, i) for i in range(4)])
        for i, params in enumerate(kinds):
            alone, _, _ = sample_next(rows[i:i + 1], [params], [make_generator(seed, i)])
            assert alone.item() == batched[i].item(), (seed, params)
