"""Grammar-constrained sampling: which tokens a sample may take next (llguidance).

A request whose `SamplingParams.grammar` is set (an llguidance grammar: a JSON schema or Lark,
built by `art.server.structured_output` from `response_format` or a forced tool call) gets one
matcher per sample. Before each draw the engine asks every constrained row's matcher for its
allowed tokens (one bitmask per row, filled in parallel by llguidance's Rust threads) and the
sampler draws among those only; after the draw each matcher consumes its token.

Reported logprobs stay those of the raw model distribution (unmasked, temperature 1), as for
any other request: they are what the trainer recomputes, so a constrained rollout trains like an
ordinary one. The mask only decides which token is drawn.

The library was chosen by measured per-token mask cost at batch 32 on the CPU
(benchmarks/grammar_libraries.py): llguidance ~0.25 ms per batch step, xgrammar ~0.13 ms,
outlines-core ~0.8 ms on average (2 ms inside free strings), against ~165 ms for one decode step
of the default model, so the cost does not separate the first two. llguidance installs with no
dependencies (xgrammar needs triton and apache-tvm-ffi) and takes Lark grammars with embedded
JSON schemas, which forced tool calls use. It is imported only when a grammar is used.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from art.errors import ArtValueError


class Grammars:
    """Grammar support for one tokenizer: validation, matchers and batched masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Width of the logits (the model's vocabulary, which may exceed the tokenizer's)."""
        self.eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None

    def _llguidance(self):
        """(llguidance module, LLTokenizer, LLExecutor), built once (the tokenizer takes ~0.5 s)."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:  # pragma: no cover - a dependency of the backend extra
            raise ArtValueError(
                "structured outputs need the `llguidance` package (pip install llguidance)", "response_format"
            ) from exc
        with self._lock:
            if self._ll_tokenizer is None:
                if not getattr(self.tokenizer, "is_fast", False):
                    raise ArtValueError(
                        "structured outputs need a fast (Rust) tokenizer; this model's is not", "response_format"
                    )
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids[0] if self.eos_ids else None
                )
                self._executor = llguidance.LLExecutor()
        return llguidance, self._ll_tokenizer, self._executor

    def check(self, grammar: str, field: str = "response_format") -> None:
        """Raise ArtValueError naming `field` when llguidance cannot compile `grammar`."""
        llguidance, tokenizer, _ = self._llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ArtValueError(f"the schema or grammar cannot be used: {'; '.join(messages)[:500]}", field)

    def matcher(self, grammar: str) -> Any:
        llguidance, tokenizer, _ = self._llguidance()
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def allowed(self, matchers: list[Any], device: torch.device | str = "cpu") -> torch.Tensor:
        """[len(matchers), vocab_size] bool on `device`: the tokens each matcher accepts next. A
        matcher in an error state, or one with nothing left, allows only end-of-sequence. The
        bitmask is filled on the CPU (llguidance writes host memory) and unpacked on `device`,
        so only 1/32 of the mask crosses to a GPU."""
        llguidance, _, executor = self._llguidance()
        import llguidance.torch as ll_torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(matchers), words, dtype=torch.int32, device="cpu")
        ll_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        allowed = unpack_bitmask(bitmask.to(device), self.vocab_size)
        empty = ~allowed.any(dim=1)
        if empty.any():
            eos = torch.tensor(self.eos_ids or [0], device=allowed.device)
            allowed[empty.nonzero().flatten()[:, None], eos] = True
        return allowed


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] with bit j of word w = token 32w+j -> bool [rows, vocab_size], on the
    bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def consume(matcher: Any, token: int) -> None:
    """Advance a matcher by the drawn token. A finished matcher (only end-of-sequence was left)
    ignores it; one that refuses it goes into its error state, and `allowed` then offers only
    end-of-sequence, so the sample ends instead of the engine failing."""
    if not matcher.is_stopped() and not matcher.is_error():
        matcher.consume_token(token)
