"""Per-token logprobs without materialising [tokens, vocab] logits at once.

The model's trunk gives hidden states; the output projection and the log-softmax then run only
on the positions asked for, in chunks of `chunk_tokens`, each under activation checkpointing,
so only one chunk's logits exist at a time in the forward and again in the backward. With a
49k vocabulary that is the largest tensor of a step (4 bytes x 49152 per token). Models whose
head does more than a projection (e.g. Gemma's logit soft-capping) take the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from art.weights import base_of

CHUNK_TOKENS = 1024


def gathered_logprobs(
    model,
    ids: torch.Tensor,
    attention: torch.Tensor | None,
    sources: tuple[torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    with_entropy: bool = False,
) -> torch.Tensor:
    """log p(targets[k] | the context of slot sources[k]) for each k: [k]; with `with_entropy`,
    [2, k]: those and the entropy of each predicting distribution (from the same logits).

    ids: [rows, width]; attention: a 2D padding mask, a 4D additive mask (packed rows) or None
    (every row one sequence: plain causal attention);
    sources: (row index [k], column index [k]) of the hidden state that predicts each target.
    """
    chunk = _chunk_with_entropy if with_entropy else _chunk
    base = base_of(model)
    trunk, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    rows, columns = sources
    if trunk is None or head is None or getattr(base.config, "final_logit_softcapping", None):
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
        return chunk(lambda h: h, logits[rows, columns], targets)
    hidden = trunk(input_ids=ids, attention_mask=attention, position_ids=position_ids).last_hidden_state
    picked = hidden[rows, columns]  # [k, dim]
    pieces = []
    for start in range(0, picked.shape[0], chunk_tokens):
        h, t = picked[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            pieces.append(checkpoint(chunk, head, h, t, use_reentrant=False))
        else:
            pieces.append(chunk(head, h, t))
    if not pieces:
        return hidden.new_zeros((2, 0) if with_entropy else 0)
    return torch.cat(pieces, dim=-1)


def sequence_logprobs(
    model, ids: torch.Tensor, attention: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS, gather=gathered_logprobs
) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position of right-padded rows: [rows, tokens - 1].
    `gather`: what computes `gathered_logprobs` (a sharded trainer's goes through FSDP's root)."""
    rows, width = ids.shape
    row_index = torch.arange(rows, device=ids.device).repeat_interleave(width - 1)
    column_index = torch.arange(width - 1, device=ids.device).repeat(rows)
    values = gather(model, ids, attention, (row_index, column_index), ids[:, 1:].reshape(-1), chunk_tokens=chunk_tokens)
    return values.view(rows, width - 1)


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # [chunk, vocab]
    return -F.cross_entropy(logits, targets, reduction="none")


def _chunk_with_entropy(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[2, chunk]: log p(target) and H(p) = -sum_v p_v log p_v, from one log-softmax."""
    logp = torch.log_softmax(head(hidden).float(), dim=-1)  # [chunk, vocab]
    picked = logp.gather(1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.stack([picked, entropy])
