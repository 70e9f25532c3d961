"""Choose the next token of every row at once; shared by the engine and the reference sampler.

Sampling draws one uniform per row from that sample's own generator and inverts the row's
CDF, so a seeded request gets the same tokens whatever else is in the batch. Reported logprobs
are those of the raw distribution (temperature 1), as vLLM reports.
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
    # Each row's distribution is computed from its own settings only, so a seeded request draws
    # the same tokens whatever else shares the batch (a neighbour's top_p must not renormalise it).
    if plain := [i for i in sampled if _untruncated(params[i])]:
        index = torch.tensor(plain, device=device)
        tokens[index] = _draw(_plain_probs(logits, logprobs, index, allowed), [generators[i] for i in plain])
    if shaped := [i for i in sampled if not _untruncated(params[i])]:
        index = torch.tensor(shaped, device=device)
        tokens[index] = _draw(
            _shaped_probs(logits, index, [params[i] for i in shaped], allowed), [generators[i] for i in shaped]
        )
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [rows]
    top: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
    want = max(p.top_logprobs for p in params)
    if want:
        values, ids = torch.topk(logprobs, want, dim=-1)
        top_values, top_ids = values.cpu().tolist(), ids.cpu().tolist()  # one copy each, not two per row
        for i, p in enumerate(params):
            if p.top_logprobs:
                top[i] = list(zip(top_ids[i][: p.top_logprobs], top_values[i][: p.top_logprobs]))
    return tokens, chosen, top


def _untruncated(params: SamplingParams) -> bool:
    """Temperature 1 and nothing cut: the raw distribution itself is drawn from."""
    return params.temperature == 1 and params.top_p == 1 and params.top_k <= 0 and params.min_p == 0


def _plain_probs(
    logits: torch.Tensor, logprobs: torch.Tensor, index: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """[len(index), vocab]: the raw distribution (unnormalised under a grammar: the draw scales)."""
    probs = logprobs[index].exp()
    if allowed is not None:
        probs = probs * allowed[index]
        starved = probs.sum(dim=-1) < 1e-30  # every allowed token underflowed: renormalise in log space
        if starved.any():
            rows_starved = index[starved]
            probs[starved] = torch.softmax(
                logits[rows_starved].masked_fill(~allowed[rows_starved], float("-inf")), dim=-1
            )
    return probs


def _shaped_probs(
    logits: torch.Tensor, index: torch.Tensor, params: list[SamplingParams], allowed: torch.Tensor | None
) -> torch.Tensor:
    """[len(index), vocab]: temperature, then vLLM's order of cuts (min_p, top_k, top_p), each
    only on the rows that ask for it."""
    device, dtype = logits.device, logits.dtype
    temps = torch.tensor([p.temperature for p in params], dtype=dtype, device=device)
    scaled = logits[index] / temps[:, None]
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed[index], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if asks := [j for j, p in enumerate(params) if p.min_p > 0]:
        rows = torch.tensor(asks, device=device)
        probs[rows] = _min_p(probs[rows], torch.tensor([params[j].min_p for j in asks], dtype=dtype, device=device))
    if asks := [j for j, p in enumerate(params) if p.top_k > 0]:
        rows = torch.tensor(asks, device=device)
        probs[rows] = _top_k(probs[rows], [params[j].top_k for j in asks])
    if asks := [j for j, p in enumerate(params) if p.top_p < 1]:
        rows = torch.tensor(asks, device=device)
        probs[rows] = _nucleus(probs[rows], torch.tensor([params[j].top_p for j in asks], dtype=dtype, device=device))
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF draw of one token per row, with one uniform from each row's own generator."""
    cdf = probs.cumsum(dim=-1)  # [rows, vocab]
    # The generators live on the CPU (seeded, reproducible anywhere): one uniform each, then one copy.
    u = torch.cat([torch.rand(1, generator=g, dtype=cdf.dtype) for g in generators]).to(cdf.device)
    target = (u * cdf[:, -1]).clamp(min=torch.finfo(cdf.dtype).tiny)[:, None]
    return torch.searchsorted(cdf, target).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep per row the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop per row the tokens less likely than min_p times its most likely one."""
    floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    kept = probs.masked_fill(probs < floor, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _top_k(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep per row its k most likely tokens; ties at the k-th are kept."""
    ks = [min(k, probs.shape[-1]) for k in top_k]
    values = torch.topk(probs, max(ks), dim=-1).values  # [rows, max k], descending
    kth = values.gather(1, torch.tensor(ks, device=probs.device)[:, None] - 1)  # [rows, 1]
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(-1, keepdim=True)
