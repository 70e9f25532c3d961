"""The token audit: trained tokens, advantages, logprobs, and turns that break the token chain."""

import json

import pytest

import art
from art.training.audit import audit
from art.training.audit import main as audit_cli
from tests.support.fakes import make_choice


def test_audit_lists_trained_tokens_and_flags_a_rerendered_turn():
    first = make_choice([1, 2, 3], [4, 5], [-0.1, -0.2])
    second = make_choice([1, 2, 3, 4, 9, 6], [7], [-0.3])  # token 5 came back as 9: re-rendered
    trajectory = art.Trajectory(messages_and_choices=[first, {"role": "user", "content": "more"}, second], reward=1.0)
    other = art.Trajectory(messages_and_choices=[make_choice([1], [2])], reward=0.0)
    group = art.TrajectoryGroup([trajectory, other])
    report = audit(trajectory, group=group)
    assert [(r.sequence, r.token_id, r.trained) for r in report.rows] == [
        (0, 1, False), (0, 2, False), (0, 3, False), (0, 4, True), (0, 5, True),
        (1, 1, False), (1, 2, False), (1, 3, False), (1, 4, False), (1, 9, False), (1, 6, False), (1, 7, True)]
    assert report.trained_tokens == 3
    assert [r.advantage for r in report.rows if r.trained] == pytest.approx([1.0] * 3, abs=1e-5)
    assert [r.sampler_logprob for r in report.rows if r.trained] == [-0.1, -0.2, -0.3]
    (brk,) = report.breaks
    assert (brk.choice, brk.position, brk.expected, brk.got) == (2, 4, 5, 9)
    text = report.format()
    assert "BREAK at choice 2" in text and "3 trained tokens in 2 sequence(s)" in text


def test_audit_notes_assistant_dicts_as_context_or_unused():
    demo = {"role": "assistant", "content": "a demonstration"}
    trajectory = art.Trajectory(messages_and_choices=[demo, make_choice([1, 2], [3]), dict(demo)], reward=0.0)
    report = audit(trajectory)
    assert dict(report.issues) == {"context_assistant_turns": 1, "assistant_dict_after_last_choice": 1}
    assert "note: 1 x context_assistant_turns" in report.format()


@pytest.mark.integration
async def test_audit_cli_on_a_logged_run_matches_trainer_logprobs(tiny_model_path, tmp_path, capsys):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="audited", project="audit", base_model=str(tiny_model_path))
    await model.register(backend)
    messages = [{"role": "user", "content": "hello"}]
    completion = await model.openai_client().chat.completions.create(
        model="audited", messages=messages, max_tokens=5, n=2, seed=3)
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, c], reward=float(i))
                                 for i, c in enumerate(completion.choices)])
    await model.log([group], split="train")
    path = tmp_path / "audit" / "models" / "audited" / "trajectories" / "train" / "0000.jsonl"
    assert audit_cli([str(path), "--index", "1", "--model", str(tiny_model_path), "--trained-only"]) == 0
    out = capsys.readouterr().out
    assert "5 trained tokens in 1 sequence(s)" in out and "BREAK" not in out
    # At step 0 the adapter is zero, so the trainer's logprobs must equal what the engine served.
    from art import base_models

    base, tokenizer = base_models.load(str(tiny_model_path))
    trajectory = art.Trajectory.from_logging(json.loads(path.read_text().splitlines()[1]))
    report = audit(trajectory, tokenizer=tokenizer, model=base)
    pairs = [(r.sampler_logprob, r.trainer_logprob) for r in report.rows if r.trained]
    assert len(pairs) == 5 and all(abs(a - b) < 1e-4 for a, b in pairs)
    await backend.close()
