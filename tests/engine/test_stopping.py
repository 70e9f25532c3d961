"""Stop strings on text decoded a few tokens at a time (`art.engine.stopping`): the same finishing
token and text as decoding the whole completion at every step, on the real SmolLM2 tokenizer
with characters that span several tokens."""

from __future__ import annotations

import random

import pytest

from art.engine.base import SamplingParams
from art.engine.stopping import IncrementalText, StopChecker

PIECES = ["Hello", " world", "!", " héllo", " wörld", " 你好", "世界", " 🎉🎉", " naïve", " – ", "“quoted”",
          "\n\n", "  ", " 3.14", "<|im_end|>", " done.", "é", "ß", "👍🏽", " STOP", "END"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def completions(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Random completions: pieces of text as the tokenizer splits them, with random ids between
    (which may be stray bytes of characters never completed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < 40:
            if rng.random() < 0.8:
                ids += tokenizer.encode(rng.choice(PIECES), add_special_tokens=False)
            else:
                ids.append(rng.randrange(len(tokenizer)))
        out.append(ids)
    return out


def test_incremental_text_is_the_full_decode_whenever_that_ends_in_a_whole_character(tokenizer):
    for ids in completions(tokenizer, 30, seed=0):
        text = IncrementalText(tokenizer)
        for k in range(1, len(ids) + 1):
            got, full = text.update(ids[:k]), tokenizer.decode(ids[:k], skip_special_tokens=True)
            assert full.startswith(got)  # never ahead, never different
            if not full.endswith("\ufffd"):
                assert got == full, (ids[:k], got, full)


@pytest.mark.parametrize("stop", [["!"], [" wörld"], ["你好"], ["🎉"], ["\n\n", "STOP"], ["é"], [" done.", "ß"]])
def test_stop_strings_end_at_the_same_token_with_the_same_text(tokenizer, stop):
    class NoModel:  # StopChecker reads end-of-sequence ids from a model's configs
        config = generation_config = None

    checker = StopChecker(NoModel(), tokenizer, max_model_len=10_000)
    params = SamplingParams(max_tokens=200, stop=stop, ignore_eos=True)
    ended = 0
    for ids in completions(tokenizer, 25, seed=1):
        text = IncrementalText(tokenizer)
        for k in range(1, len(ids) + 1):
            want = checker.check(params, 5, ids[:k])  # the whole completion decoded (the reference's way)
            got = checker.check(params, 5, ids[:k], text)
            assert got == want, (stop, ids[:k])
            if want is not None:
                ended += 1
                break
    assert ended >= 5  # the stop strings really were met
