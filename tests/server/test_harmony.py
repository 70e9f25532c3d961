"""gpt-oss's harmony replies: the analysis channel comes back as the message's reasoning, the final
channel as its content, a message to `functions.NAME` as a tool call, streamed or not; and a
trajectory of such a reply trains on exactly the sampled ids.

The served model is a tiny gpt-oss (sinks, a sliding-window and a full-attention layer, routed
experts) whose tokenizer is SmolLM2's plus harmony's special tokens and a harmony chat template,
taught by a few hundred optimizer steps in the fixture to answer two prompts with a harmony reply:
the engine, the server and the parser then run as they do for the real model.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import art
from art.server import harmony
from art.service import probe
from art.training.sequences import sequences_of_trajectory
from tests.support import families

pytestmark = pytest.mark.integration

TEMPLATE = (
    "{%- if tools -%}<|start|>developer<|message|># Tools{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|end|>{%- endif -%}"
    "{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
"""Harmony's shape (gpt-oss's own template also renders the system and developer preambles)."""
ASK = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "<|channel|>analysis<|message|>The user asks a capital.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def test_the_channels_of_a_reply():
    reply = harmony.parse(ANSWER)
    assert (reply.reasoning, reply.content, reply.calls) == ("The user asks a capital.", "Paris.", [])
    call = harmony.parse(CALL)
    assert call.reasoning == "Use the tool." and call.content is None
    assert [c["function"] for c in call.calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    # The recipient may also stand in the role part of the header, before the channel.
    before = harmony.parse('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f'
                           '<|channel|>commentary json<|message|>{}<|call|>')
    assert [c["function"]["name"] for c in before.calls] == ["f"]
    # Cut short by the length limit: what it got so far counts.
    assert harmony.parse("<|channel|>analysis<|message|>Thinking about").reasoning == "Thinking about"
    assert harmony.parse("Just text.").content == "Just text."


def reply_logits(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1]


def predicted(model, prompt: list[int], reply: list[int]) -> list[int]:
    with torch.no_grad():
        return reply_logits(model, prompt, reply).argmax(-1).tolist()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss that answers ASK with ANSWER and WEATHER (with TOOLS) with CALL."""
    from transformers import AutoModelForCausalLM

    tok = families.tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*harmony.SPECIAL, harmony.CONSTRAIN]})
    tok.chat_template = TEMPLATE
    tok.eos_token = "<|return|>"
    config = families.config("gpt_oss", tok, eos_token_id=[tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    pairs = []
    for messages, reply, tools in ((ASK, ANSWER, None), (WEATHER, CALL, TOOLS)):
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        pairs.append((prompt, tok.encode(reply, add_special_tokens=False)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(200):  # about 40 steps
        if step % 10 == 0 and all(predicted(model, prompt, reply) == reply for prompt, reply in pairs):
            break
        loss = sum(torch.nn.functional.cross_entropy(reply_logits(model, prompt, reply), torch.tensor(reply))
                   for prompt, reply in pairs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the tiny gpt-oss did not learn its two replies")
    path = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


async def test_a_gpt_oss_reply_is_split_by_channel_and_trains(gpt_oss, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="oss", project="p", base_model=str(gpt_oss))
    await model.register(backend)
    client = model.openai_client()
    try:
        answer = (await client.chat.completions.create(model=model.name, messages=ASK, temperature=0,
                                                       max_tokens=40)).choices[0]
        assert answer.message.content == "Paris."
        assert answer.message.reasoning == answer.message.reasoning_content == "The user asks a capital."
        assert answer.finish_reason == "stop"

        called = (await client.chat.completions.create(model=model.name, messages=WEATHER, tools=TOOLS,
                                                       temperature=0, max_tokens=40)).choices[0]
        assert called.finish_reason == "tool_calls" and called.message.reasoning == "Use the tool."
        (call,) = called.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

        # Streamed: the token ids arrive as sampled, the channels at the end.
        chunks = [c async for c in await client.chat.completions.create(
            model=model.name, messages=ASK, temperature=0, max_tokens=40, stream=True)]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Paris."
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "The user asks a capital."
        streamed = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        assert streamed == answer.token_ids

        # The reply trains on exactly the ids sampled (the choice carries them), not on a re-rendering.
        trajectory = art.Trajectory(messages_and_choices=[*ASK, answer], reward=1.0)
        (sequence,) = sequences_of_trajectory(trajectory, Counter())
        assert sequence.token_ids == answer.prompt_token_ids + answer.token_ids
        assert [i for i, on in enumerate(sequence.trained) if on] == list(
            range(len(answer.prompt_token_ids), len(sequence.token_ids)))
        other = (await client.chat.completions.create(model=model.name, messages=ASK, temperature=1.5, seed=3,
                                                      max_tokens=40)).choices[0]
        group = art.TrajectoryGroup([trajectory, art.Trajectory(messages_and_choices=[*ASK, other], reward=0.0)])
        result = await backend.train(model, [group], learning_rate=1e-3)
        assert result.step == 1 and "nothing_to_train" not in result.metrics
        assert result.metrics[probe.METRIC] <= probe.TOLERANCE
    finally:
        await backend.close()
