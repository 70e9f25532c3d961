"""A plain, unbatched sampler: one sample at a time, the whole sequence recomputed per token.

Slow and obviously correct; the engine's tests compare against it token for token. It uses
the same sampling, grammar, stopping and adapter code as the engine, and no KV cache.
"""

from __future__ import annotations

import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, Completion, SamplingParams
from art.engine.grammar import Grammars, consume
from art.engine.sampling import make_generator, sample_next
from art.engine.stopping import StopChecker


class ReferenceSampler:
    def __init__(self, model, tokenizer, *, adapters: AdapterSet | None = None, max_model_len: int | None = None):
        self.model = model
        self.adapters = adapters or AdapterSet(model)
        self.device = next(model.parameters()).device
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.stopping = StopChecker(model, tokenizer, min(max_model_len or limit, limit))
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.stopping.eos_ids)

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None) -> list[Completion]:
        name, step = self.adapters.acquire(adapter)
        try:
            return [self._one(prompt, params, name, step, i) for i in range(params.n)]
        finally:
            self.adapters.release(name)

    def _one(self, prompt, params, name, step, index) -> Completion:
        generator = make_generator(params.seed, index)
        matcher = self.grammars.matcher(params.grammar) if params.grammar else None
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        while True:
            with self.adapters.activate([name]) as extra:
                logits = (
                    self.model(input_ids=torch.tensor([prompt + ids], device=self.device), **extra)
                    .logits[:, -1]
                    .float()
                )
            allowed = self.grammars.allowed([matcher], logits.device) if matcher is not None else None
            token, logprob, alternatives = sample_next(logits, [params], [generator], allowed)
            if matcher is not None:
                consume(matcher, int(token[0]))
            ids.append(int(token[0]))
            logprobs.append(float(logprob[0]))
            if params.top_logprobs:
                top.append(alternatives[0])
            done = self.stopping.check(params, len(prompt), ids)
            if done:
                return Completion(ids, logprobs, done[1], done[0], top, step=step)
