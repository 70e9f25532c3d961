"""Chat messages -> token ids with the assistant's tokens marked: the one place training renders text.

GRPO never re-tokenises: it trains the ids the engine sampled (`art.training.sequences`). SFT
rows are text, so the backend renders them with the model's chat template, the way the OpenAI
routes render a prompt (`art.chat_template`: `ChatMessage.for_template`, `template_messages` and
`prompt_ids`: the same message normalisation, for templates that do not know tools the same
Hermes text for tool calls, results and the tool preamble, and the same template call). What
SFT teaches is then exactly what serving later shows and parses. Nothing here knows HTTP.

The template rule. Let R(m, g) be the token ids of `apply_chat_template(m, tools,
add_generation_prompt=g)`. The tokens of assistant message k are those from
len(R(messages[:k], True)) (the prompt the engine would sample turn k after) to
len(R(messages[:k+1], False)), cut just after the last stop token (EOS, end of turn) in that
span: sampling ends there, so what a template writes after it (ChatML's newline) is context,
as a `{% generation %}` block marks it. Each rendering must extend the previous one token for
token (R(messages[:k], True) a prefix of R(messages[:k+1], False), itself a prefix of
R(messages, False)); a template that renders earlier turns differently once later ones exist
(one that drops earlier reasoning, say) cannot say which tokens are the assistant's, and gets
an ArtValueError naming the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from art.chat_template import ChatMessage, prompt_ids, template_messages
from art.errors import ArtValueError, TrajectoryError


@dataclass
class RenderedChat:
    token_ids: list[int]  # [tokens] the whole conversation as the template renders it
    trained: list[bool]  # [tokens] True for the assistant tokens to train


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    assistant_turns: str = "all",
    stop_ids: set[int] | None = None,
    where: str = "messages",
) -> RenderedChat:
    """Render one conversation and mark the assistant tokens to train.

    `assistant_turns`: "all" or "last". An assistant message with OpenAI's fine-tuning key
    `"weight": 0` is context either way. `stop_ids`: the ids that end a turn (default the
    tokenizer's EOS). `where` prefixes the field named by errors.
    """
    stop_ids = stop_ids if stop_ids is not None else {tokenizer.eos_token_id}
    normalised, train = _normalise(messages, where)
    turns = [k for k, message in enumerate(normalised) if message["role"] == "assistant" and train[k]]
    if assistant_turns == "last":
        turns = turns[-1:] if turns and turns[-1] == _last_assistant(normalised) else []
    if not turns:
        raise TrajectoryError(
            f"{where} has no assistant message to train (assistant_turns={assistant_turns!r})", field=where
        )
    full = _render(tokenizer, normalised, tools, False, where)
    trained = [False] * len(full)
    for k in turns:
        prompt = _render(tokenizer, normalised[:k], tools, True, where)
        with_turn = _render(tokenizer, normalised[: k + 1], tools, False, where)
        if with_turn[: len(prompt)] != prompt or full[: len(with_turn)] != with_turn:
            raise ArtValueError(
                f"{where}[{k}]: the chat template does not render this conversation incrementally (the tokens "
                "before this assistant message change once it or later messages are added), so its tokens "
                "cannot be told apart; SFT needs a template whose renderings of a conversation's prefixes "
                "extend one another",
                field=f"{where}[{k}]",
            )
        end = len(with_turn)
        stops = [i for i in range(len(prompt), end) if with_turn[i] in stop_ids]
        if stops:
            end = stops[-1] + 1
        for i in range(len(prompt), end):
            trained[i] = True
    return RenderedChat(full, trained)


def chat_template_input(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, where: str = "messages"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The (messages, tools) `render_chat` hands the template for the whole conversation, e.g.
    to compare with the template's own `return_assistant_tokens_mask`."""
    return template_messages(tokenizer, _normalise(messages, where)[0], tools, None)


def _normalise(messages: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], list[bool]]:
    """Template dicts of the messages, and per message whether it may be trained (weight != 0)."""
    out, train = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TrajectoryError(
                f"{where}[{i}] is a {type(message).__name__}, not a message dict", field=f"{where}[{i}]"
            )
        weight = message.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise TrajectoryError(
                f"{where}[{i}].weight must be 0 or 1 (OpenAI's fine-tuning format), got {weight!r}",
                field=f"{where}[{i}].weight",
            )
        try:
            parsed = ChatMessage.model_validate({k: v for k, v in message.items() if k != "weight"})
        except ValidationError as exc:
            problem = exc.errors()[0]
            at = ".".join(str(part) for part in problem["loc"])
            raise TrajectoryError(
                f"{where}[{i}]{'.' + at if at else ''}: {problem['msg']}", field=f"{where}[{i}]{'.' + at if at else ''}"
            ) from None
        out.append(parsed.for_template())
        train.append(weight == 1)
    return out, train


def _last_assistant(messages: list[dict[str, Any]]) -> int | None:
    return max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=None)


def _render(tokenizer, messages: list[dict[str, Any]], tools, generation_prompt: bool, where: str) -> list[int]:
    """R(messages, generation_prompt): token ids, as the OpenAI routes compute a prompt's."""
    as_template, template_tools = template_messages(tokenizer, messages, tools, None)
    return prompt_ids(tokenizer, as_template, template_tools, add_generation_prompt=generation_prompt, where=where)
