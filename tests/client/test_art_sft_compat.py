"""SFT as ART's own tests define it: dataset chunks that resume at any batch, its learning-rate
schedule's edge cases, `train_sft_from_file(assistant_turns=)`, the history rows one
`train_sft` call writes, calls with nothing to train, and `backend.train(save_checkpoint=False)`,
on a real LocalBackend (and RemoteBackend over the real app) with the tiny model."""

from __future__ import annotations

import json
import random

import httpx
import pytest

import art
from art.serve import create_serve_app
from art.service.local import LocalService
from art.training.chat_tokens import render_chat
from art.utils.sft import SFTChunk, create_lr_schedule, create_sft_dataset_iterator, iterate_file, train_sft_from_file
from tests.support.fakes import groups_of_choices


def chats(n: int, turns: int = 1) -> list[art.Trajectory]:
    messages = lambda i: [m for t in range(turns) for m in (  # noqa: E731
        {"role": "user", "content": f"Question {i}.{t}: yes or no?"},
        {"role": "assistant", "content": "Yes." if (i + t) % 2 else "No."})]
    return [art.Trajectory(messages_and_choices=messages(i)) for i in range(n)]


def batches_of(chunks: list[SFTChunk], batch_size: int) -> list[tuple]:
    """Every batch the chunks hold: (its questions, learning rate, step, epoch, epoch_step)."""
    out = []
    for chunk in chunks:
        rates = chunk.config.learning_rate
        assert isinstance(rates, list) and len(rates) == -(-len(chunk.trajectories) // batch_size)
        for k, rate in enumerate(rates):
            part = chunk.trajectories[k * batch_size:(k + 1) * batch_size]
            out.append(([t.messages_and_choices[0]["content"] for t in part], rate, chunk.step + k, chunk.epoch,
                        chunk.epoch_step + k))
    return out


@pytest.mark.parametrize("size", [5, 6])  # 3 batches an epoch, the last one short with 5
@pytest.mark.parametrize("shuffle", [False, True])
def test_dataset_iterator_resumes_at_any_batch_even_inside_a_chunk(size, shuffle):
    kwargs = dict(chunk_size=2, epochs=2, batch_size=2, shuffle=shuffle, show_progress=False)
    everything = batches_of(list(create_sft_dataset_iterator(chats(size), **kwargs)), 2)
    assert [b[2:] for b in everything] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    for initial_step in range(8):
        resumed = list(create_sft_dataset_iterator(chats(size), initial_step=initial_step, **kwargs))
        # No batch is trained twice or skipped: the chunk holding batch k starts at it.
        assert batches_of(resumed, 2) == everything[initial_step:], initial_step
    inside = list(create_sft_dataset_iterator(chats(size), initial_step=1, **kwargs))[0]
    assert (inside.step, inside.epoch, inside.epoch_step, len(inside.trajectories)) == (1, 0, 1, 2)


def test_dataset_iterator_cuts_one_schedule_into_chunks():
    chunks = list(create_sft_dataset_iterator(chats(100), chunk_size=15, epochs=2, batch_size=2, peak_lr=2e-4,
                                              seed=42, show_progress=False))
    rates = [rate for chunk in chunks for rate in chunk.config.learning_rate]
    assert rates == create_lr_schedule(100, 2e-4, "linear", warmup_steps=10)
    assert [(c.step, c.epoch, c.epoch_step) for c in chunks[:5]] == [(0, 0, 0), (15, 0, 15), (30, 0, 30),
                                                                    (45, 0, 45), (50, 1, 0)]  # epochs not mixed
    again = list(create_sft_dataset_iterator(chats(100), chunk_size=15, epochs=2, batch_size=2, peak_lr=2e-4,
                                             seed=42, show_progress=False))
    questions = lambda cs: [t.messages_and_choices[0]["content"] for c in cs for t in c.trajectories]  # noqa: E731
    assert questions(again) == questions(chunks)  # the same seed, the same order
    assert list(create_sft_dataset_iterator([], chunk_size=10, show_progress=False)) == []


def test_lr_schedule_edge_cases():
    assert create_lr_schedule(0, 1e-4) == []
    assert create_lr_schedule(1, 1e-4) == [1e-4]
    warmup = create_lr_schedule(10, 1e-4, "constant", warmup_steps=5)
    assert warmup[0] == pytest.approx(2e-5) and warmup[4:] == pytest.approx([1e-4] * 6)
    # A warmup longer than the run: the run stops part-way up the ramp, as in ART.
    assert create_lr_schedule(5, 1e-4, warmup_steps=10) == pytest.approx([1e-5, 2e-5, 3e-5, 4e-5, 5e-5])
    for method in ("linear", "cosine"):
        rates = create_lr_schedule(5, 1e-4, method, min_lr=1e-5)
        assert rates[0] == pytest.approx(1e-4) and rates[-1] == pytest.approx(1e-5)
        assert rates == sorted(rates, reverse=True)


def test_iterate_file_epochs_skip_and_seed(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": t.messages_and_choices}) + "\n" for t in chats(10)) + "\n")
    first = [t.messages_and_choices for t in iterate_file(path, epochs=3, seed=7)]
    assert len(first) == 30 and first == [t.messages_and_choices for t in iterate_file(path, epochs=3, seed=7)]
    assert first[:10] != first[10:20]  # each epoch its own order
    assert [t.messages_and_choices for t in iterate_file(path, epochs=1, seed=7, initial_skip=5)] == first[5:10]


@pytest.fixture
async def local(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path / "runs"))
    model = art.TrainableModel(name="sft", project="compat", base_model=str(tiny_model_path))
    await model.register(backend)
    yield backend, model
    await backend.close()


def history(model) -> list[dict]:
    path = model._run_dir() / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_train_sft_logs_each_gradient_step_and_a_summary_at_the_new_step(local):
    backend, model = local
    await model.train_sft(chats(6), art.TrainSFTConfig(learning_rate=[3e-3, 2e-3, 1e-3], batch_size=2))
    rows = history(model)
    assert await model.get_step() == 1 and {row["step"] for row in rows} == {1}
    per_step, summary = rows[:3], rows[3]
    assert [row["sft/gradient_step"] for row in per_step] == [1.0, 2.0, 3.0] and "sft/gradient_step" not in summary
    assert [row["sft/loss/learning_rate"] for row in per_step] == [3e-3, 2e-3, 1e-3]
    losses = [row["sft/loss/train"] for row in per_step]
    assert summary["loss/train"] == pytest.approx(sum(losses) / 3)
    assert summary["loss/learning_rate"] == pytest.approx(2e-3) and summary["loss/grad_norm"] > 0
    assert (summary["data/step_num_gradient_steps"], summary["data/step_num_trajectories"],
            summary["data/step_num_dropped_trajectories"]) == (3, 6, 0)
    assert summary["data/step_trainer_tokens"] == sum(row["sft/data/step_trainer_tokens"] for row in per_step)
    assert summary["time/step_trainer_s"] > 0 and summary["sft/loss_first"] == losses[0]

    await model.train_sft(chats(2), art.TrainSFTConfig(learning_rate=1e-3, batch_size=2), log_metrics=False)
    assert await model.get_step() == 2 and len(history(model)) == 4  # trained, not logged


async def test_train_sft_from_file_trains_only_the_last_assistant_turn(local, tmp_path):
    backend, model = local
    path = tmp_path / "two-turns.jsonl"
    trajectories = chats(4, turns=2)
    path.write_text("".join(json.dumps({"messages": t.messages_and_choices}) + "\n" for t in trajectories))
    await train_sft_from_file(model, str(path), batch_size=2, peak_lr=1e-3, assistant_turns="last")
    tokenizer = backend.service.loaded(("compat", "sft")).tokenizer
    tokens = {turns: sum(sum(render_chat(tokenizer, t.messages(), assistant_turns=turns).trained) for t in trajectories)
              for turns in ("all", "last")}
    assert tokens["last"] < tokens["all"]
    assert history(model)[-1]["sft/trained_tokens"] == tokens["last"]


async def test_nothing_to_train_is_no_step_and_a_dropped_batch_takes_no_learning_rate(local):
    backend, model = local
    too_long = art.Trajectory(messages_and_choices=[{"role": "user", "content": "yes " * 600},
                                                    {"role": "assistant", "content": "No."}])  # context: 512
    await model.train_sft([])
    result = await backend.train_sft(model, [too_long, too_long], batch_size=1, learning_rate=[1e-3, 1e-3])
    assert result.step == 0 and result.metrics["data/step_num_dropped_trajectories"] == 2
    assert await model.get_step() == 0 and history(model) == []  # as in ART: no step, no rows

    events: list[dict] = []
    result = await backend.train_sft(model, [too_long, *chats(1)], batch_size=1, learning_rate=[1e-3, 5e-4],
                                     progress=events.append)
    rates = [e["metrics"]["loss/learning_rate"] for e in events if e["type"] == "gradient_step"]
    assert rates == [1e-3]  # the batch that trains takes the first rate, as in ART
    assert (result.step, result.metrics["data/step_num_dropped_trajectories"],
            result.metrics["data/step_num_trajectories"]) == (1, 1, 1)


async def test_backend_train_accepts_save_checkpoint_false(local, tiny_model_path, tmp_path):
    backend, model = local
    result = await backend.train(model, groups_of_choices(seed=1), save_checkpoint=False, learning_rate=1e-3)
    assert result.step == 1 and await model.get_step() == 1
    service = LocalService(str(tmp_path / "server"))
    transport = httpx.ASGITransport(create_serve_app(service, api_key="k"))
    async with art.RemoteBackend("http://testserver", api_key="k", transport=transport) as remote:
        served = art.TrainableModel(name="tiny", project="remote", base_model=str(tiny_model_path))
        await served.register(remote)
        result = await remote.train(served, groups_of_choices(seed=2), save_checkpoint=False, loss_fn="cispo")
        assert result.step == 1 and await served.get_step() == 1
    await service.close()


def test_random_state_is_left_alone():
    random.seed(3)
    expected = [random.random() for _ in range(3)]
    random.seed(3)
    list(create_sft_dataset_iterator(chats(10), chunk_size=2, epochs=2, show_progress=False))
    assert [random.random() for _ in range(3)] == expected
