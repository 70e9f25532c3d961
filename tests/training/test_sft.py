"""SFT: the chat-template rule for which tokens are trained, the loss, the step counter and
resume, locally and over `art serve` (RemoteBackend against the real app)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import art
from art.serve import create_serve_app
from art.service.local import LocalService
from art.training.chat_tokens import chat_template_input, render_chat
from art.training.optimizer_mode import switch_optimizer_mode
from art.utils.sft import create_lr_schedule, create_sft_dataset_iterator, iterate_file, train_sft_from_file

# ChatML as SmolLM2 writes it, with `{% generation %}` around what the assistant samples.
GENERATION_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# A template that renders `tools` and `tool_calls` itself (it mentions tools), also marked.
TOOL_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}"
    "{%- for call in message.get('tool_calls', []) -%}"
    "{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SINGLE = [{"role": "user", "content": "What is the capital of Tasmania?"}, {"role": "assistant", "content": "Hobart"}]
MULTI_WITH_TOOLS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Hobart?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Hobart"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15°C, partly cloudy"},
    {"role": "assistant", "content": "It's 15°C and partly cloudy in Hobart."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "I can only see today's weather."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def template_mask(tokenizer, messages, tools):
    """The template's own {% generation %} mask, on the messages `render_chat` hands it."""
    as_template, template_tools = chat_template_input(tokenizer, messages, tools)
    out = tokenizer.apply_chat_template(as_template, tools=template_tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


@pytest.mark.parametrize("template", [GENERATION_TEMPLATE, TOOL_TEMPLATE], ids=["hermes-text-tools", "template-tools"])
@pytest.mark.parametrize("messages,tools", [(SINGLE, None), (MULTI_WITH_TOOLS, TOOLS)], ids=["single", "multi-tools"])
def test_trained_tokens_are_the_templates_assistant_mask(tokenizer, template, messages, tools):
    tokenizer.chat_template = template
    ids, mask = template_mask(tokenizer, messages, tools)
    assert sum(mask) > 0
    rendered = render_chat(tokenizer, messages, tools)
    assert rendered.token_ids == ids
    assert rendered.trained == mask
    trained_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    if tools:  # the call is trained in the text form serving parses back into tool_calls
        assert "get_weather" in trained_text and "Hobart" in trained_text and "15°C" in trained_text
        assert "partly cloudy in Hobart" in trained_text and "What's the weather" not in trained_text


def test_assistant_turn_choice_weights_and_errors_naming_the_field(tokenizer, tiny_model_path):
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(tiny_model_path)  # SmolLM2's own template (no generation marks)
    everything = render_chat(smol, MULTI_WITH_TOOLS, TOOLS)
    last = render_chat(smol, MULTI_WITH_TOOLS, TOOLS, assistant_turns="last")
    decoded = smol.decode([i for i, m in zip(last.token_ids, last.trained) if m])
    assert decoded == "I can only see today's weather.<|im_end|>"
    assert last.token_ids == everything.token_ids and sum(last.trained) < sum(everything.trained)
    weighted = [dict(m, weight=0) if m.get("content") == "I can only see today's weather." else m
                for m in MULTI_WITH_TOOLS]
    without_last = render_chat(smol, weighted, TOOLS)
    assert sum(without_last.trained) == sum(everything.trained) - sum(last.trained)
    with pytest.raises(art.TrajectoryError) as info:
        render_chat(smol, weighted, TOOLS, assistant_turns="last")
    assert info.value.field == "messages"
    with pytest.raises(art.TrajectoryError) as info:
        render_chat(smol, [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    assert info.value.field == "messages[1].role"
    with pytest.raises(art.TrajectoryError) as info:
        render_chat(smol, [dict(SINGLE[0]), dict(SINGLE[1], weight=0.5)])
    assert info.value.field == "messages[1].weight"


@pytest.mark.integration
def test_learning_rate_schedules_and_option_errors():
    assert create_lr_schedule(4, 1e-3, "constant") == [1e-3] * 4
    linear = create_lr_schedule(5, 1e-3, "linear", warmup_steps=1)
    assert linear == pytest.approx([1e-3, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0], abs=1e-12)
    cosine = create_lr_schedule(6, 1e-3, "cosine", warmup_steps=2)
    assert cosine[:3] == pytest.approx([5e-4, 1e-3, 1e-3]) and cosine[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))
    from art.training.sft_options import resolve_sft_options

    options = resolve_sft_options(art.TrainSFTConfig(learning_rate=[1e-3, 2e-3]), {"max_grad_norm": 0.5},
                                  {"batch_size": 4})
    assert (options.batch_size, options.max_grad_norm, options.rate(1)) == (4, 0.5, 2e-3)
    assert resolve_sft_options(art.TrainSFTConfig()).batch_size == 2  # "auto", as ART's LocalBackend
    with pytest.raises(art.ArtValueError) as info:
        resolve_sft_options(art.TrainSFTConfig(batch_size=2), {"max_grad_norm": -1.0})
    assert info.value.field == "dev_config.max_grad_norm"


def test_switching_between_sft_and_rl_restarts_adams_moments():
    import torch

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.1)
    weight.grad = torch.ones(3)
    optimizer.step()
    switch_optimizer_mode(optimizer, "rl", 0.1)  # a fresh optimizer already counts as RL: kept
    assert optimizer.state[weight]["step"] == 1
    switch_optimizer_mode(optimizer, "sft", 0.01)
    assert not optimizer.state and optimizer.param_groups[0]["weight_decay"] == 0.01
    saved = optimizer.state_dict()
    fresh = torch.optim.AdamW([weight], lr=0.1)
    fresh.load_state_dict(saved)  # the mode is saved with the optimizer, so resume switches alike
    assert fresh.param_groups[0]["art_mode"] == "sft"


def yes_no_rows(n: int) -> list[dict]:
    words = ["Maybe.", "No.", "Yes."]
    return [{"messages": [{"role": "user", "content": f"Question {i}: yes, no or maybe?"},
                          {"role": "assistant", "content": words[i % 3]}]} for i in range(n)]


@pytest.mark.integration
async def test_sft_loss_falls_counts_one_step_per_call_and_resumes(tiny_model_path, tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in yes_no_rows(3)))
    backend = art.LocalBackend(path=str(tmp_path / "runs"))
    model = art.TrainableModel(name="sft", project="sft", base_model=str(tiny_model_path))
    await model.register(backend)
    events: list[dict] = []
    trajectories = list(iterate_file(path, epochs=4))  # each batch of 3 holds the 3 rows: losses compare
    result = await backend.train_sft(model, trajectories, config=art.TrainSFTConfig(learning_rate=1e-2, batch_size=3),
                                     progress=events.append)
    losses = [e["metrics"]["loss/train"] for e in events if e["type"] == "gradient_step"]
    assert len(losses) == 4 and result.metrics["data/step_num_gradient_steps"] == 4
    # The NLL of the answers falls (a random 64-wide model with tied embeddings cannot go far below ~10).
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.4, losses
    assert result.step == 1 and await model.get_step() == 1  # one call, one checkpoint (as in ART)
    tokenizer.chat_template = art_template = backend.service.loaded(("sft", "sft")).tokenizer.chat_template
    assert art_template and result.metrics["sft/trained_tokens"] == sum(
        sum(render_chat(tokenizer, t.messages()).trained) for t in trajectories)

    # The ART helpers: a file in one call, then chunks with a schedule; each call is one step.
    await train_sft_from_file(model, path, epochs=1, batch_size=2, peak_lr=1e-2, schedule_type="cosine")
    assert await model.get_step() == 2
    chunks = list(create_sft_dataset_iterator(trajectories[:6], chunk_size=1, batch_size=2, peak_lr=1e-2,
                                              show_progress=False))
    assert [c.step for c in chunks] == [0, 1, 2]
    await model.train_sft(chunks[0].trajectories, chunks[0].config)
    assert await model.get_step() == 3
    saved = json.loads((tmp_path / "runs" / "sft" / "models" / "sft" / "model.json").read_text())
    assert saved["sft_options"]["batch_size"] == 2 and "learning_rate" not in saved["sft_options"]
    with pytest.raises(art.ArtValueError) as info:  # one learning rate per batch, or an error naming it
        await model.train_sft(trajectories[:4], art.TrainSFTConfig(learning_rate=[1e-3], batch_size=2))
    assert info.value.field == "learning_rate"
    with pytest.raises(art.TrajectoryError) as info:
        await model.train_sft([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}])])
    assert info.value.field == "trajectories[0].messages_and_choices"
    assert await model.get_step() == 3
    history = [json.loads(line) for line in (tmp_path / "runs" / "sft" / "models" / "sft" / "history.jsonl").open()]
    # One row per optimizer step and a summary, at the step each call wrote (ART's layout).
    assert [(row["step"], row.get("sft/gradient_step")) for row in history] == [
        (2, 1.0), (2, 2.0), (2, None), (3, 1.0), (3, None)]
    assert history[2]["loss/train"] == pytest.approx((history[0]["sft/loss/train"] + history[1]["sft/loss/train"]) / 2)
    await backend.close()

    # A new backend resumes mid-run: the step counter, checkpoints and SFT optimizer state continue.
    backend2 = art.LocalBackend(path=str(tmp_path / "runs"))
    model2 = art.TrainableModel(name="sft", project="sft", base_model=str(tiny_model_path))
    await model2.register(backend2)
    step = await model2.get_step()
    assert step == 3
    optimizer = backend2.service.loaded(("sft", "sft")).trainer.optimizer
    assert optimizer.param_groups[0]["art_mode"] == "sft" and optimizer.state
    for chunk in create_sft_dataset_iterator(trajectories[:6], chunk_size=1, batch_size=2, peak_lr=1e-2,
                                             initial_step=step - 2, show_progress=False):
        await model2.train_sft(chunk.trajectories, chunk.config)
    assert await model2.get_step() == 5
    assert await backend2.list_checkpoints(model2) == [0, 1, 2, 3, 4, 5]
    completion = await model2.openai_client().chat.completions.create(
        model="sft", messages=[{"role": "user", "content": "yes, no or maybe?"}], max_tokens=2)
    assert completion.model_extra["step"] == 5
    await backend2.close()


async def test_sft_over_art_serve(tiny_model_path, tmp_path):
    local = LocalService(str(tmp_path / "server"))
    app = create_serve_app(local, api_key="k")
    async with art.RemoteBackend("http://testserver", api_key="k", transport=httpx.ASGITransport(app)) as backend:
        model = art.TrainableModel(name="tiny", project="remote", base_model=str(tiny_model_path))
        await model.register(backend)
        events: list[dict] = []
        rows = [dict(row, tools=TOOLS) for row in yes_no_rows(4)]
        result = await backend.train_sft(model, rows, learning_rate=[1e-2, 5e-3], batch_size=2, progress=events.append)
        assert result.step == 1 and await model.get_step() == 1
        kinds = [e["type"] for e in events]
        assert kinds[0] == "accepted" and kinds.count("gradient_step") == 2 and kinds[-1] == "result"
        assert [e["metrics"]["loss/learning_rate"] for e in events if e["type"] == "gradient_step"] == [1e-2, 5e-3]
        await model.train_sft([art.Trajectory(messages_and_choices=rows[0]["messages"])])
        assert await model.get_step() == 2
        history = await backend.get_history(model)
        assert [(row["step"], row.get("sft/gradient_step")) for row in history] == [(2, 1.0), (2, None)]
        with pytest.raises(art.ArtValueError) as info:  # the server's error names the field
            await backend.train_sft(model, [{"messages": [{"role": "user", "content": "hi"}]}])
        assert info.value.field == "trajectories[0].messages_and_choices"
        with pytest.raises(art.ArtValueError) as info:  # checked on the client before sending
            await backend.train_sft(model, rows, assistant_turns="first")
        assert info.value.field == "options.assistant_turns"
        assert await model.get_step() == 2
    await local.close()


@pytest.mark.integration
async def test_the_sft_then_rl_example_at_tiny_scale(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    import sft_then_rl

    curves = await sft_then_rl.main(str(tmp_path), steps=1, group_size=2, prompts_per_step=1, per_prompt=1,
                                    compare=True, base_model=str(tiny_model_path))
    assert [len(curves["sft_then_rl"]), len(curves["rl_only"])] == [1, 1]
    runs = tmp_path / "yes-no-maybe" / "models"
    assert sorted(p.name for p in (runs / "sft-then-rl-seed0" / "checkpoints").iterdir()) == ["0000", "0001", "0002"]
    assert sorted(p.name for p in (runs / "rl-only-seed0" / "checkpoints").iterdir()) == ["0000", "0001"]
    rows = (tmp_path / "yes-no-maybe" / "sft-seed0.jsonl").read_text().splitlines()
    assert len(rows) == 24 and sft_then_rl.steps_to([0.5, 0.95]) == 1 and sft_then_rl.steps_to([0.8]) is None
