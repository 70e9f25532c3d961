"""The main job on the real default model, run as command 1 runs it (seed 0, SFT warm-up, then
10 RL steps): the task must be learnt, and both parts must show (about 45 s on 2 CPU cores)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "yes_no_maybe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("yes_no_maybe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_function_orders_the_answers():
    example = load_example()
    assert example.score("Maybe.") == 1.0
    assert example.score("No") == 0.75
    assert example.score("yes!") == 0.5
    assert example.score("I think the answer is maybe") == 0.5  # maybe, halved: > 3 words
    assert example.score("Sure thing") == 0.0
    assert len(set(example.make_prompts())) == len(example.make_prompts()) == 24


def test_warmup_data_does_not_say_which_word_is_best():
    example = load_example()
    trajectories = example.warmup_trajectories(seed=0)
    replies = [t.messages_and_choices[-1]["content"] for t in trajectories]
    assert sorted({t.messages_and_choices[0]["content"] for t in trajectories}) == sorted(example.make_prompts())
    assert {reply: replies.count(reply) for reply in replies} == {"Maybe.": 8, "No.": 8, "Yes.": 8}


@pytest.mark.integration
@pytest.mark.slow
async def test_default_model_learns_maybe(tmp_path):
    """Measured on seeds 0-4 (2 CPU cores): before training 0.13-0.17 ("maybe" first in 0-2% of
    replies); after the warm-up 0.64-0.75 ("maybe" 12-27%); first RL step 0.52-0.72; last two
    RL steps 0.98-1.00; final evaluation 0.94-1.00 ("maybe" first in 100%). Seed 0 (this test):
    0.14, then 0.75 (27%), RL steps 0.63 0.91 1.00 ... 1.00, final 0.99."""
    example = load_example()
    result = await example.main(seed=0, path=str(tmp_path))
    before, warm, final, rewards = result["before"], result["after_warmup"], result["final"], result["rewards"]
    assert len(rewards) == 10
    assert before[0] < 0.3 and before[1] < 0.1, f"the base model already answers well: {result}"
    # the warm-up: one-word replies, "maybe" from rare to sometimes, not to always
    assert 0.05 <= warm[1] <= 0.6 and 0.45 < warm[0] < 0.85, f"warm-up: {result}"
    # RL: from the warm-up's level to the task learnt
    assert rewards[0] < 0.85, f"RL had nothing to do: {result}"
    assert (rewards[-1] + rewards[-2]) / 2 >= 0.95, f"last two RL steps below 0.95: {result}"
    assert final[0] >= 0.9 and final[1] >= 0.9, f"final evaluation: {result}"
    run_dir = tmp_path / "yes-no-maybe" / "models" / "maybe-seed0"
    assert (run_dir / "reward.png").stat().st_size > 1000
    evals = sorted(p for p in example._history_points(run_dir)[3])
    assert [step for step, _ in evals] == [0, 1, 11]  # before, after the warm-up, after RL
