"""The decode case the CUDA graph tests compare graphs and eager decoding on (tests/engine/test_cuda.py),
shared with benchmarks/graph_diagnosis.py, which runs it under each attention kernel."""

from __future__ import annotations

import torch

from art.engine.adapters import LIVE

PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 41)), [3, 1, 4, 1, 5, 9, 2, 6]]
LONG_PROMPTS = [list(range(1, 301)), list(range(50, 320)), list(range(7, 290))]


def decode_steps(runner, steps: int = 6, long: bool = False) -> torch.Tensor:
    """Prefill three prompts and decode `steps` tokens: the stacked logits [steps, 3, vocab].
    `long`: prompts of 270-300 tokens, so the steps attend over a width past the narrowest (256).
    (Every position a step can see is written: unwritten ones hold whatever an earlier layout
    left there, which differs between two runners.)"""
    prompts = LONG_PROMPTS if long else PROMPTS
    out = []
    with torch.inference_mode():
        _, staged = runner.prefill(prompts, [(0, None)] * 3, [LIVE] * 3)
        runner.add(staged, [0, 1, 2])
        for step in range(steps):
            tokens = [(17 * step + 5 * r) % 250 for r in range(3)]
            out.append(runner.decode(tokens, [len(p) + step for p in prompts], [LIVE] * 3).clone())
    return torch.stack(out)
