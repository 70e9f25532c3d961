"""When a completion ends and what its text is; shared by the engine and the reference."""

from __future__ import annotations

from art.engine.base import SamplingParams


class StopChecker:
    def __init__(self, model, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = _eos_ids(model, tokenizer)

    def check(self, params: SamplingParams, prompt_len: int, ids: list[int]) -> tuple[str, str] | None:
        """(finish_reason, text) once `ids` is complete, else None. A matched stop string is
        cut from the text (the sampled ids are kept whole, for training)."""
        if ids[-1] in self.eos_ids and not params.ignore_eos:
            return "stop", self._text(ids)
        if params.stop:
            text = self._text(ids)
            tail = max(0, len(text) - max(len(s) for s in params.stop) - 16)  # only the tail can hold a new match
            hits = [at for at in (text.find(s, tail) for s in params.stop) if at >= 0]
            if hits:
                return "stop", text[: min(hits)]
        if len(ids) >= params.max_tokens or prompt_len + len(ids) >= self.max_model_len:
            return "length", self._text(ids)
        return None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _eos_ids(model, tokenizer) -> set[int]:
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
