"""When a completion ends and what its text is; shared by the engine and the reference."""

from __future__ import annotations

from collections.abc import Sequence

from art.engine.base import FinishReason, SamplingParams


class StopChecker:
    def __init__(self, model, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_token_ids(model, tokenizer)

    def check(
        self, params: SamplingParams, prompt_len: int, ids: list[int], text: IncrementalText | None = None
    ) -> tuple[FinishReason, str] | None:
        """(finish_reason, text) once `ids` is complete, else None. A matched stop string is
        cut from the text (the sampled ids are kept whole, for training). With `text` (the
        sample's own), stop strings are looked for in text decoded a few tokens at a time;
        without it the whole completion is decoded at every call (the reference sampler)."""
        if ids[-1] in self.eos_ids and not params.ignore_eos:
            return "stop", self._text(ids)
        if params.stop:
            if text is not None:
                checked = len(text.text)
                sofar = text.update(ids)
                at = first_stop(sofar, params.stop, max(0, checked - max(map(len, params.stop))))
            else:  # only the tail can hold a new match
                sofar = self._text(ids)
                at = first_stop(sofar, params.stop, max(0, len(sofar) - max(map(len, params.stop)) - 16))
            if at is not None:
                if text is None:
                    return "stop", sofar[:at]
                whole = self._text(ids)  # once, at the end: the text exactly as a full decode gives it
                cut = first_stop(whole, params.stop, 0)
                return "stop", whole[:cut] if cut is not None else sofar[:at]
        if len(ids) >= params.max_tokens or prompt_len + len(ids) >= self.max_model_len:
            return "length", self._text(ids)
        return None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    """A sample's text, extended by decoding only its newest tokens (vLLM's incremental
    detokenization): each call decodes the tokens since the last complete character, and text
    ending in an incomplete UTF-8 sequence ("\ufffd") waits for the next token. Decoding the
    whole completion every step would be O(length^2) per sample."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] are decoded already, kept as context for the next ones
        self._read = 0

    def update(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        new = decode(ids[self._prefix :], skip_special_tokens=True)
        if not new.endswith("\ufffd"):
            old = decode(ids[self._prefix : self._read], skip_special_tokens=True)
            if len(new) > len(old) and new.startswith(old):
                self.text += new[len(old) :]
                self._prefix, self._read = self._read, len(ids)
            elif new != old:  # the context decoded differently (a tokenizer's clean-up): decode it all once
                self.text = decode(ids, skip_special_tokens=True)
                self._prefix = self._read = len(ids)
        return self.text


def first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Where the earliest stop string at or after `start` begins in `text` (None: nowhere)."""
    hits = [at for at in (text.find(s, start) for s in stops) if at >= 0]
    return min(hits) if hits else None


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
