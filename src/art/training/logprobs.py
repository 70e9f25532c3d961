"""Per-token logprobs of a batch without materialising [tokens, vocab] logits at once.

The model's trunk gives hidden states; the output projection and the log-softmax then run on
chunks of `chunk_tokens` positions, each under activation checkpointing, so only one chunk's
logits exist at a time in the forward and again in the backward. With a 49k vocabulary that
is the largest tensor of a step (4 bytes x 49152 per token). Models whose head does more than
a projection (e.g. Gemma's logit soft-capping) take the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from art.training.loss import token_logprobs

CHUNK_TOKENS = 1024


def sequence_logprobs(model, ids: torch.Tensor, attention: torch.Tensor,
                      chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position: [rows, tokens - 1]."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if trunk is None or head is None or getattr(base.config, "final_logit_softcapping", None):
        logits = model(input_ids=ids, attention_mask=attention).logits  # [rows, tokens, vocab]
        return token_logprobs(logits[:, :-1], ids[:, 1:])
    hidden = trunk(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]  # [rows, tokens-1, dim]
    rows, tokens, dim = hidden.shape
    flat_hidden = hidden.reshape(-1, dim)  # [rows * (tokens-1), dim]
    flat_targets = ids[:, 1:].reshape(-1)
    pieces = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h = flat_hidden[start:start + chunk_tokens]
        t = flat_targets[start:start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            pieces.append(checkpoint(_chunk, head, h, t, use_reentrant=False))
        else:
            pieces.append(_chunk(head, h, t))
    return torch.cat(pieces).view(rows, tokens)


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # [chunk, vocab]
    return -F.cross_entropy(logits, targets, reduction="none")
