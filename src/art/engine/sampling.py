"""Choose the next token of every row at once; shared by the engine and the reference sampler.

Sampling draws one uniform per row from that sample's own generator and inverts the row's
CDF, so a seeded request gets the same tokens whatever else is in the batch. Reported logprobs are those of the raw distribution (temperature 1), as vLLM reports.
"""

from __future__ import annotations

import random

import torch

from art.engine.base import SamplingParams


def make_generator(seed: int | None, sample_index: int) -> torch.Generator:
    generator = torch.Generator()
    value = random.getrandbits(63) if seed is None else (seed * 1_000_003 + sample_index) % (2**63)
    generator.manual_seed(value)
    return generator


def sample_next(
    logits: torch.Tensor,  # [rows, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
    allowed: torch.Tensor | None = None,  # [rows, vocab] bool: a grammar's mask; None allows all
) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]]]]:
    """Returns (tokens [rows], their raw logprobs [rows], top alternatives per row).

    With `allowed`, tokens are drawn from the distribution renormalised over the allowed ones;
    the logprobs and alternatives reported are still the raw, unmasked ones."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    rows = logits.shape[0]
    device = logits.device
    if allowed is not None:
        allowed = allowed.to(device)
    tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    if greedy:
        index = torch.tensor(greedy, device=device)
        scores = logits[index] if allowed is None else logits[index].masked_fill(~allowed[index], float("-inf"))
        tokens[index] = torch.argmax(scores, dim=-1)
    if sampled:
        index = torch.tensor(sampled, device=device)
        if all(params[i].temperature == 1 and params[i].top_p == 1 for i in sampled):
            probs = logprobs[index].exp()  # [sampled, vocab]
            if allowed is not None:  # renormalised by the draw below (it scales by the total)
                probs = probs * allowed[index]
                starved = probs.sum(dim=-1) < 1e-30  # every allowed token underflowed: renormalise in log space
                if starved.any():
                    rows_starved = index[starved]
                    probs[starved] = torch.softmax(
                        logits[rows_starved].masked_fill(~allowed[rows_starved], float("-inf")), dim=-1)
        else:
            temps = torch.tensor([params[i].temperature for i in sampled], dtype=logits.dtype, device=device)
            top_p = torch.tensor([params[i].top_p for i in sampled], dtype=logits.dtype, device=device)
            scaled = logits[index] / temps[:, None]
            if allowed is not None:
                scaled = scaled.masked_fill(~allowed[index], float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            if any(params[i].top_p < 1 for i in sampled):
                probs = _nucleus(probs, top_p)
        # Inverse-CDF draw with one uniform per sample from its own generator.
        cdf = probs.cumsum(dim=-1)  # [sampled, vocab]
        # The generators live on the CPU (seeded, reproducible anywhere): one uniform each, then one copy.
        u = torch.cat([torch.rand(1, generator=generators[i], dtype=cdf.dtype) for i in sampled]).to(device)
        target = (u * cdf[:, -1]).clamp(min=torch.finfo(cdf.dtype).tiny)[:, None]
        drawn = torch.searchsorted(cdf, target).squeeze(1)
        tokens[index] = drawn.clamp(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [rows]
    top: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
    want = max(p.top_logprobs for p in params)
    if want:
        values, ids = torch.topk(logprobs, want, dim=-1)
        values, ids = values.cpu().tolist(), ids.cpu().tolist()  # one copy each, not two per row
        for i, p in enumerate(params):
            if p.top_logprobs:
                top[i] = list(zip(ids[i][: p.top_logprobs], values[i][: p.top_logprobs]))
    return tokens, chosen, top


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep per row the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)
